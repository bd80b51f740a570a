"""Shared test fixtures. Fixture modules of each area are plugged in here."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from elasticrun.agent.processes import Warden

pytest_plugins: list[str] = ["tests.etcd_support", "tests.elastic_cluster", "tests.reliability_rows"]

#: The files that take longest (BENCHMARKS.md, "Test suite"), collected first: scripts/test.sh
#: hands whole files to 2 processes (`-n 2 --dist loadfile`), and a long file handed out
#: last keeps one process busy alone at the end. The rest keep their order.
SLOWEST_FIRST = (
    "test_inprocess.py", "test_torchrun_parity.py", "test_job_control.py", "test_example_frameworks.py",
    "test_elastic_agents.py", "test_store_model.py", "test_slurm.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))  # stable: files stay whole


@pytest.fixture
async def warden() -> AsyncIterator[Warden]:
    """A warden for a test that starts a WorkerGroup itself, as an agent would."""
    started = await Warden.start()
    try:
        yield started
    finally:
        await started.close()
