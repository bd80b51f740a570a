"""The hang watchdog's parts: the worker's `heartbeat()` and the agent's `ProgressWatchdog`.

Real files throughout; the watchdog's clock is injected (and its sleep replaced by one
that moves that clock), so nothing here waits for time to pass, except one test of
`hang()` on the real clock that waits for its result, bounded by pytest-timeout.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import elasticrun.agent.watchdog as watchdog
import elasticrun.worker.progress as progress
from elasticrun.agent.watchdog import Hang, ProgressWatchdog, hang_failure
from elasticrun.worker import heartbeat

pytestmark = pytest.mark.timeout(30)


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def _fresh_heartbeat(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no heartbeat sent and no progress file named."""
    monkeypatch.setattr(progress, "_last_path", "")
    monkeypatch.setattr(progress, "_last_at", float("-inf"))
    monkeypatch.delenv(progress.PROGRESS_FILE_ENV, raising=False)


def touch(path: Path) -> None:
    path.touch()
    os.utime(path)


# --- heartbeat() -----------------------------------------------------------------------


def test_heartbeat_is_a_no_op_without_a_watchdog(tmp_path: Path) -> None:
    heartbeat()
    assert list(tmp_path.iterdir()) == []


def test_heartbeat_touches_its_file_at_most_twice_a_second(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "progress_0"
    monkeypatch.setenv(progress.PROGRESS_FILE_ENV, str(path))
    clock = FakeClock(0.0)
    touches: list[str] = []

    def utime(path: str) -> None:
        touches.append(path)
        os.utime(path)

    # progress.py's own view of the clock and of os, nobody else's
    monkeypatch.setattr(progress, "time", SimpleNamespace(monotonic=clock))
    monkeypatch.setattr(progress, "os", SimpleNamespace(environ=os.environ, utime=utime))

    heartbeat()  # the first one creates the file
    assert path.exists()
    for _ in range(900):  # a fast training loop, 0.9 s of it: no storm of system calls
        clock.now += 0.001
        heartbeat()
    assert len(touches) == 2  # the first (the file was missing), then one after 0.5 s
    clock.now += 0.5
    heartbeat()
    assert len(touches) == 3
    # another file (a new attempt): it is touched at once
    monkeypatch.setenv(progress.PROGRESS_FILE_ENV, str(tmp_path / "progress_1"))
    heartbeat()
    assert (tmp_path / "progress_1").exists()


def test_heartbeat_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(progress.PROGRESS_FILE_ENV, str(tmp_path / "gone" / "progress_0"))
    heartbeat()  # the folder does not exist: nothing happens, nothing is raised


def test_importing_the_worker_package_imports_no_torch() -> None:
    code = "import sys, elasticrun.worker as w; w.heartbeat(); sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_the_variable_name_is_the_same_on_both_sides() -> None:
    assert watchdog.PROGRESS_FILE_ENV == progress.PROGRESS_FILE_ENV == "ELASTICRUN_PROGRESS_FILE"


# --- ProgressWatchdog ------------------------------------------------------------------


def test_env_names_one_file_per_worker_under_the_folder(tmp_path: Path) -> None:
    dog = ProgressWatchdog(10.0, tmp_path / "progress", [0, 1], clock=FakeClock())
    files = {dog.env(r)["ELASTICRUN_PROGRESS_FILE"] for r in (0, 1)}
    assert len(files) == 2 and all(Path(f).parent == tmp_path / "progress" for f in files)
    with pytest.raises(ValueError, match="local rank 2 is not watched"):
        dog.env(2)
    with pytest.raises(ValueError, match="positive number of seconds"):
        ProgressWatchdog(0.0, tmp_path, [0])


def test_a_silent_worker_is_hung_once_the_timeout_has_passed_since_its_start(tmp_path: Path) -> None:
    clock = FakeClock(100.0)
    dog = ProgressWatchdog(10.0, tmp_path, [0, 1], clock=clock)
    assert dog.next_check_at() == 110.0
    clock.now = 109.9
    assert dog.check() is None
    clock.now = 110.0
    assert dog.check() == Hang(local_rank=0, silent_for=10.0, never=True)  # both silent: the first
    assert dog.check().reason(global_rank=0) == (  # type: ignore[union-attr]
        "worker rank 0 hung: no progress for 10s since it started: it never called elasticrun.worker.heartbeat() "
        "and made no optimizer step"
    )


def test_a_slow_start_is_no_hang_within_the_start_timeout(tmp_path: Path) -> None:
    """Imports, a model or a checkpoint loaded, compiling: the first progress may come
    late (--progress-start-timeout); from then on the timeout applies."""
    clock = FakeClock(100.0)
    dog = ProgressWatchdog(10.0, tmp_path, [0, 1], clock=clock, start_timeout=60.0)
    assert dog.next_check_at() == 110.0  # a look: a first step now would be due then
    clock.now = 155.0
    touch(Path(dog.env(0)["ELASTICRUN_PROGRESS_FILE"]))  # rank 0 made its first step at 155
    assert dog.check() is None and dog.next_check_at() == pytest.approx(160.0, abs=0.5)  # rank 1 may start until 160
    clock.now = 159.0
    assert dog.check() is None
    clock.now = 160.0
    found = dog.check()
    assert found is not None and (found.local_rank, found.never) == (1, True)
    touch(Path(dog.env(1)["ELASTICRUN_PROGRESS_FILE"]))
    assert dog.check() is None  # both started: 10 s from their latest progress now
    assert dog.next_check_at() == pytest.approx(165.0, abs=0.5)  # rank 0's, 10 s after 155


async def test_a_hang_soon_after_the_first_step_is_found_at_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start allowance ends with the first step: a worker that steps once at 103 and
    then hangs is overdue a timeout after that step (dated, as any, no earlier than the
    look that saw it: 110), not when the allowance (160) would have ended."""
    clock = FakeClock(100.0)
    dog = ProgressWatchdog(10.0, tmp_path, [0], clock=clock, start_timeout=60.0)

    async def fake_sleep(seconds: float) -> None:
        if clock.now < 103.0 <= clock.now + seconds:
            clock.now = 103.0
            touch(Path(dog.env(0)["ELASTICRUN_PROGRESS_FILE"]))
            seconds -= 3.0
        clock.now += seconds

    monkeypatch.setattr(watchdog.asyncio, "sleep", fake_sleep)
    found = await dog.hang()
    assert (found.local_rank, found.never) == (0, False)
    assert 113.0 <= clock.now <= 120.5 and found.silent_for >= 10.0


def test_heartbeats_restart_the_clock_and_the_silent_one_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock(100.0)
    dog = ProgressWatchdog(10.0, tmp_path, [0, 1], clock=clock)
    clock.now = 108.0
    monkeypatch.setenv(progress.PROGRESS_FILE_ENV, dog.env(0)["ELASTICRUN_PROGRESS_FILE"])
    heartbeat()  # rank 0 makes progress at 108 (on the watchdog's clock: just now)
    assert dog.check() is None
    clock.now = 110.0
    found = dog.check()
    assert found is not None and found.local_rank == 1 and found.silent_for == 10.0
    assert dog.silences() == {0: pytest.approx(2.0, abs=0.5), 1: 10.0}  # what the agent weighs besides
    # once rank 1 shows progress too, the next possible verdict is rank 0's, from 108
    touch(Path(dog.env(1)["ELASTICRUN_PROGRESS_FILE"]))
    assert dog.check() is None
    assert dog.next_check_at() == pytest.approx(118.0, abs=0.5)


def test_a_file_of_an_earlier_attempt_is_no_progress(tmp_path: Path) -> None:
    clock = FakeClock(100.0)
    first = ProgressWatchdog(10.0, tmp_path, [0], clock=clock)
    touch(Path(first.env(0)["ELASTICRUN_PROGRESS_FILE"]))
    second = ProgressWatchdog(10.0, tmp_path, [0], clock=clock)  # the next attempt
    clock.now = 110.0
    assert second.check() == Hang(local_rank=0, silent_for=10.0, never=True)


def test_a_skewed_file_clock_never_makes_a_live_worker_look_hung(tmp_path: Path) -> None:
    clock = FakeClock(100.0)
    dog = ProgressWatchdog(10.0, tmp_path, [0], clock=clock)
    path = Path(dog.env(0)["ELASTICRUN_PROGRESS_FILE"])
    clock.now = 105.0
    assert dog.check() is None
    touch(path)
    os.utime(path, (1.0, 1.0))  # an mtime far in the past (a file server's clock)
    clock.now = 112.0
    # the change was seen after the look at 105: that is the earliest it can date from
    assert dog.check() is None
    assert dog.next_check_at() == 115.0


async def test_hang_sleeps_until_the_earliest_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(100.0)
    dog = ProgressWatchdog(10.0, tmp_path, [0, 1], clock=clock)
    sleeps: list[float] = []

    async def fake_sleep(seconds: float) -> None:  # moves the watchdog's clock instead
        sleeps.append(seconds)
        if len(sleeps) == 1:  # during the first wait, rank 0 shows progress at 104
            clock.now += 4.0
            touch(Path(dog.env(0)["ELASTICRUN_PROGRESS_FILE"]))
            clock.now += seconds - 4.0
        else:
            clock.now += seconds

    monkeypatch.setattr(watchdog.asyncio, "sleep", fake_sleep)
    found = await dog.hang()
    assert found == Hang(local_rank=1, silent_for=10.0, never=True)
    assert sleeps == [10.0]  # one wait, to the first possible deadline; no polling


async def test_hang_on_the_real_clock_names_the_worker_that_stopped(tmp_path: Path) -> None:
    dog = ProgressWatchdog(1.0, tmp_path, [0, 1])
    alive = Path(dog.env(0)["ELASTICRUN_PROGRESS_FILE"])

    async def keep_alive() -> None:
        while True:
            touch(alive)
            await asyncio.sleep(0.05)

    beating = asyncio.ensure_future(keep_alive())
    try:
        found = await dog.hang()
    finally:
        beating.cancel()
    assert found.local_rank == 1 and found.silent_for >= 1.0


def test_the_hang_as_a_failure_report_root_cause() -> None:
    from elasticrun.agent.failures import make_report

    hang = Hang(local_rank=1, silent_for=61.4)
    assert hang.reason(global_rank=5) == "worker rank 5 hung: no progress for 61s"
    failure = hang_failure(
        hang, node_id="n", node_rank=1, rank_offset=4, pid=123, returncode=-15, timeout=60.0,
        stderr_tail=["loading shard 7", "waiting for rank 0"], at=1.0,
    )
    assert (failure.global_rank, failure.local_rank, failure.traceback_source) == (5, 1, "the progress watchdog")
    text = make_report([failure], title="job 'j' failed").text
    assert "hung: no progress for 61s (--progress-timeout=60s)" in text
    assert "waiting for rank 0" in text
    # the agent stopped it: its SIGTERM is no cause of its own
    assert "exit      : SIGTERM (-15), stopped by the progress watchdog" in text
    assert "from outside the job" not in text
