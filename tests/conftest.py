"""Shared test fixtures. Fixture modules of each area are plugged in here."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from elasticrun.agent.processes import Warden

pytest_plugins: list[str] = [
    "tests.support.etcd_cluster",
    "tests.support.elastic_cluster",
    "tests.support.reliability_rows",
]


@pytest.fixture
async def warden() -> AsyncIterator[Warden]:
    """A warden for a test that starts a WorkerGroup itself, as an agent would."""
    started = await Warden.start()
    try:
        yield started
    finally:
        await started.close()
