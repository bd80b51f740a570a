"""A hung worker (alive, no progress) under the opt-in progress watchdog.

Real agent, real worker (tests/workers/fault_hang_worker.py): the worker heartbeats
every step, then stops making progress without exiting. With --progress-timeout the
agent stops the group, restarts it (spending one of --max-restarts), and the failure
report names the hang as the root cause; the restarted worker finishes.

And a plain gloo script that never calls heartbeat() (tests/workers/straggler_worker.py):
its optimizer steps are its progress; when one node's worker stops in Python, the
other node's, waiting for it in all_reduce, is found hung, with where it waits.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.elastic_cluster import RDZV_CONF, Cluster, run_id
from tests.support.helpers import ELASTICRUN

WORKER = Path(__file__).resolve().parents[1] / "workers" / "fault_hang_worker.py"


@pytest.mark.timeout(120)
def test_a_hung_worker_is_restarted_and_named_as_a_hang(tmp_path: Path, reliability) -> None:
    marker = tmp_path / "hung-once"
    started = time.monotonic()
    argv = [*ELASTICRUN, "--standalone", "--max-restarts=1",
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


STRAGGLER_WORKER = Path(__file__).resolve().parents[1] / "workers" / "straggler_worker.py"


@pytest.mark.timeout(180)
def test_a_plain_script_without_heartbeat_is_watched_and_the_hang_says_where_it_waits(
    cluster: Cluster, c10d_store: str, tmp_path: Path, reliability
) -> None:
    hang_dir = tmp_path / "hang"
    hang_dir.mkdir()
    rid = run_id()

    def agent(name: str, addr: int):
        return cluster.agent(
            name, backend="c10d", endpoint=c10d_store, run_id=rid, local_addr=f"127.0.0.{addr}", nnodes="2",
            max_restarts=1, conf=RDZV_CONF + ",is_host=false", worker=STRAGGLER_WORKER,
            # the restarted attempt imports torch again: on a loaded machine that took more
            # than 15 s, a slow start taken for a hang (hence the start's own allowance)
            extra=["--progress-timeout=15", "--progress-start-timeout=120"],
            worker_args=["--hang-dir", str(hang_dir), "--hang-step", "3"],
        )

    a, b = agent("a", 2), agent("b", 3)
    (hang_dir / f"{socket.gethostname()}_{b.pid}").touch()  # b's worker stops in Python after step 3
    b.wait_for(r"hanging after step=3 rank=(\d+)")
    started = time.monotonic()
    # the job restarts (one of --max-restarts=1) and trains on
    for p in (a, b):
        p.wait_for(r"step=5 rank=\d+ world=2 round=2 ")
    # Both workers' last step was step 3, so either watchdog may be first: b's finds its
    # worker silent outside any collective; a's finds its worker waiting for b's in the
    # all_reduce of step 4 (no step, so no progress), and says so.
    verdict = (
        r"worker rank (\d+) hung: no progress for (\d+)s( \(waiting in all_reduce for (\d+)s\))?; "
        r"asking the leader to restart"
    )
    found = {p.name: m for p in (a, b) if (m := re.search(verdict, p.text()))}
    assert found, a.text()[-3000:] + b.text()[-3000:]
    for name, hung in found.items():
        assert int(hung[2]) >= 15
        assert bool(hung[3]) == (name == "a") and (name == "b" or int(hung[4]) >= 10), hung[0]
    cluster.stop_training()
    assert a.wait_exit() == 0 and b.wait_exit() == 0
    cluster.assert_no_orphans()
    reliability.record(
        scenario="hung worker, no heartbeat() (plain script)",
        injected="one node's worker of a plain gloo script stops in Python after step 3; --progress-timeout=15",
        happened="the other node's watchdog, fed by its optimizer steps, found its worker silent and waiting in "
        "all_reduce; the job restarted (1 of --max-restarts=1) and trained on",
        recovery_s=time.monotonic() - started,
        restarts=1,
        lost="the hung attempt's work since its last checkpoint",
    )


@pytest.mark.slow  # the plain script's hang above stays in the README's command
@pytest.mark.timeout(180)
def test_of_two_silent_workers_the_hang_is_the_one_outside_any_collective(tmp_path: Path) -> None:
    """Rank 1 stops in Python; rank 0, on the same node, waits for it in all_reduce: both
    are silent, and the one named is rank 1, the one that does not wait for a peer."""
    hang_dir = tmp_path / "hang"
    hang_dir.mkdir()
    argv = [*ELASTICRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=0",
            "--progress-timeout=15", f"--log-dir={tmp_path / 'logs'}", str(STRAGGLER_WORKER),
            "--hang-dir", str(hang_dir), "--hang-rank", "1", "--steps", "50"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, GLOO_SOCKET_IFNAME="lo"))
    (hang_dir / f"{socket.gethostname()}_{proc.pid}").touch()  # the node id: before its workers' step 3
    try:
        out = proc.communicate(timeout=150)[0]
    finally:
        proc.kill()
    assert proc.returncode != 0 and "hanging after step=3 rank=1" in out, out[-4000:]
    assert re.search(r"worker rank 1 hung: no progress for \d+s; no restarts left", out), out[-4000:]
