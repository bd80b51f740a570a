"""A hung worker (alive, no progress) under the opt-in progress watchdog.

Real agent, real worker (tests/workers/fault_hang_worker.py): the worker heartbeats
every step, then stops making progress without exiting. With --progress-timeout the
agent stops the group, restarts it (spending one of --max-restarts), and the failure
report names the hang as the root cause; the restarted worker finishes.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parents[1] / "workers" / "fault_hang_worker.py"


@pytest.mark.timeout(120)
def test_a_hung_worker_is_restarted_and_named_as_a_hang(tmp_path: Path, reliability) -> None:
    marker = tmp_path / "hung-once"
    started = time.monotonic()
    argv = [sys.executable, "-m", "elasticrun", "--standalone", "--max-restarts=1",
            "--progress-timeout=2", f"--log-dir={tmp_path / 'logs'}", str(WORKER), "--marker", str(marker)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert marker.exists() and "hanging at step=3" in out
    # the agent named the hang and restarted once
    assert re.search(r"worker rank 0 hung: no progress for \d+s", out), out[-4000:]
    assert "restarting (1/1)" in out
    assert "worker done" in out
    pids = set(re.findall(r"step=\d+ pid=(\d+)", out))
    assert len(pids) == 2  # the hung process was replaced
    reliability.record(
        scenario="hung worker (progress watchdog)",
        injected="a worker stops calling heartbeat() at step 3 and sleeps (alive, no progress); --progress-timeout=2",
        happened="the agent stopped the group after 2 s of silence, named 'worker rank 0 hung' as the root "
        "cause, restarted it (1 of --max-restarts=1); the new worker finished",
        recovery_s=time.monotonic() - started,
        restarts=1,
        lost="the hung attempt's work since its last checkpoint",
    )
