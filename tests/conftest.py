"""Shared test fixtures. Fixture modules of each area are plugged in here."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from elasticrun.agent.processes import Warden

pytest_plugins: list[str] = [
    "tests.support.etcd_cluster",
    "tests.support.elastic_cluster",
    "tests.support.reliability_rows",
]


#: the files that take half a minute or more (CI's --durations), the longest first: the suite's
#: `--dist loadfile --no-loadscope-reorder` (scripts/test.sh) hands whole files out in
#: collection order, and a long file handed out last runs alone at the end while the other
#: process has nothing left to do
LONG_FILES = (
    "test_state_buddy.py",
    "fault/test_shared_cpu_stragglers.py",
    "test_gpu_check.py",
    "fault/test_ddp_jobs.py",
    "test_warm_start.py",
    "test_example_frameworks.py",
    "fault/test_straggler.py",
    "test_state_restart.py",
    "fault/test_hang.py",
    "test_inprocess.py",
    "test_state_reshard.py",
    "test_store_model.py",
    "test_slurm.py",
    "fault/test_inprocess_store_faults.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run LONG_FILES first, in that order; every other file keeps its place."""
    here = Path(__file__).parent
    rank = {here / name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path, len(LONG_FILES)))


@pytest.fixture
async def warden() -> AsyncIterator[Warden]:
    """A warden for a test that starts a WorkerGroup itself, as an agent would."""
    started = await Warden.start()
    try:
        yield started
    finally:
        await started.close()
