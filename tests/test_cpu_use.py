"""The CPU a set of processes used between two looks (elasticrun.agent.cpu_use), of real processes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from elasticrun.agent.cpu_use import CpuUse
from elasticrun.agent.sessions import cpu_seconds
from tests.support.helpers import wait_until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def busy_and_idle() -> Iterator[tuple[int, int]]:
    """A process that computes without end, and one that waits for a signal.

    The waiting one says when its start-up (tens of milliseconds of CPU on a loaded
    machine) is over, so that no look at it counts that."""
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        for code in ("while True: pass", "import signal; print('waiting', flush=True); signal.pause()")
    ]
    try:
        assert procs[1].stdout is not None
        assert procs[1].stdout.readline() == b"waiting\n"
        yield procs[0].pid, procs[1].pid
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_computing_process_uses_cpu_and_a_waiting_one_none(busy_and_idle: tuple[int, int]) -> None:
    busy, idle = busy_and_idle
    use = CpuUse()
    wait_until(lambda: use.share([busy]) > 0.05, timeout=30, what="the busy process's CPU seen")
    use.share([idle])
    start = cpu_seconds(busy)
    wait_until(lambda: cpu_seconds(busy) - start > 0.3, timeout=30, what="time passing, as the busy process counts it")
    assert use.share([idle]) < 0.05


def test_a_new_process_counts_from_its_start_and_a_gone_one_counts_nothing(busy_and_idle: tuple[int, int]) -> None:
    busy, _ = busy_and_idle
    clock = iter([0.0, 1.0, 2.0])
    use = CpuUse(lambda: next(clock))
    start = cpu_seconds(busy)
    wait_until(lambda: cpu_seconds(busy) > start, timeout=30, what="the busy process's CPU time")
    before = cpu_seconds(busy)
    shown = use.share([busy])  # not seen before: all its CPU time, over the one second since
    assert 0 < before <= shown <= cpu_seconds(busy)
    assert use.share([2**22 + 1]) == 0.0  # no such process (above the kernel's pid limit)
