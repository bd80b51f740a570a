"""In-process elasticity end to end: real agents with `--elastic-mode=in-process`, real
gloo workers that use `elasticrun.worker.elastic` (tests/workers/inprocess_worker.py).

Across each membership change the test checks what the mode promises: the survivors'
worker PIDs are unchanged, the world size changed, every rank of a round holds the same
parameters (the workers print a digest of them each step), and the step counter resumes
from the last commit (never behind what that worker had committed). Each scenario runs
on the built-in store and on etcd.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.elastic_cluster import Cluster, Proc, Rdzv
from tests.test_elastic_agents import finish, kill_node, start

pytestmark = pytest.mark.timeout(180)

WORKER = Path(__file__).resolve().parent / "workers" / "inprocess_worker.py"
STEP = re.compile(
    r"step=(?P<step>\d+) rank=(?P<rank>\d+) world=(?P<world>\d+) round=(?P<round>\d+) "
    r"pid=(?P<pid>\d+) digest=(?P<digest>\w+)"
)
JOINED = re.compile(r"joined rank=\d+ world=(?P<world>\d+) round=\d+ pid=(?P<pid>\d+) step=(?P<step>\d+)")


def node(cluster: Cluster, rdzv: Rdzv, name: str, addr: int, nnodes: str = "2:3") -> Proc:
    return start(
        cluster, rdzv, name, addr, nnodes, worker=WORKER, extra=("--elastic-mode=in-process",)
    )


def world_step(agent: Proc, world: int, *, start: int = 0) -> re.Match[str]:
    return agent.wait_for(STEP.pattern.replace(r"(?P<world>\d+)", str(world)), start=start)


def worker_pid(agent: Proc) -> int:
    return int(agent.wait_for(r"worker started pid=(\d+)").group(1))


def check_consistent(agents: list[Proc]) -> None:
    """Every rank of a round agrees on the parameters at every step; no worker's step
    counter ever goes back behind what it committed."""
    digests: dict[tuple[str, str], set[str]] = defaultdict(set)
    for agent in agents:
        last: dict[str, int] = {}  # pid -> last step it printed (and then committed)
        for line in agent.text().splitlines():
            if m := STEP.search(line):
                digests[m["round"], m["step"]].add(m["digest"])
                last[m["pid"]] = int(m["step"])
            elif m := JOINED.search(line):
                assert int(m["step"]) >= last.get(m["pid"], 0), f"{agent.name}: {line}"
    split = {k: v for k, v in digests.items() if len(v) > 1}
    assert not split, f"ranks disagree on the parameters at (round, step): {split}"


def three_training(cluster: Cluster, rdzv: Rdzv) -> tuple[list[Proc], dict[str, int], dict[str, int]]:
    """Nodes a, b, c training at world 3: the agents, their worker PIDs, and a mark in
    a's and b's output taken then."""
    agents = [node(cluster, rdzv, n, i + 2) for i, n in enumerate("abc")]
    pids = {p.name: worker_pid(p) for p in agents}
    for p in agents:
        world_step(p, 3)
    return agents, pids, {p.name: p.mark() for p in agents[:2]}


def test_scale_up_keeps_survivors_running(cluster: Cluster, rdzv: Rdzv) -> None:
    a, b = node(cluster, rdzv, "a", 2), node(cluster, rdzv, "b", 3)
    pids = {p.name: worker_pid(p) for p in (a, b)}
    before = {p.name: int(world_step(p, 2)["step"]) for p in (a, b)}

    c = node(cluster, rdzv, "c", 4)
    after = {p.name: world_step(p, 3) for p in (a, b, c)}
    for p in (a, b):
        assert int(after[p.name]["pid"]) == pids[p.name]  # the same process
        assert int(after[p.name]["step"]) > before[p.name]  # resumed, not restarted
    # the newcomer started from the survivors' commit, received by broadcast
    joined = c.wait_for(r"joined rank=\d+ world=3 round=\d+ pid=\d+ step=(\d+)")
    assert int(joined.group(1)) >= min(before.values())
    for p in (a, b):
        assert p.text().count("worker started") == 1
    finish(cluster, a, b, c)
    check_consistent([a, b, c])


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_node_loss_keeps_survivors_running(cluster: Cluster, rdzv: Rdzv, how: str) -> None:
    (a, b, c), pids, marks = three_training(cluster, rdzv)

    if how == "sigterm":
        c.signal(signal.SIGTERM)
        assert c.wait_exit() != 0
    else:
        kill_node(c, pids["c"])

    for p in (a, b):
        m = world_step(p, 2, start=marks[p.name])
        assert int(m["pid"]) == pids[p.name]  # survivors were never restarted
        assert p.text().count("worker started") == 1
        # a node's loss is a membership change: no restart spent (--max-restarts=0)
        assert re.search(r"ranks \d+-\d+ of 2, restart 0/0", p.text()[marks[p.name]:])
    finish(cluster, a, b)
    check_consistent([a, b])


def test_frozen_peer_does_not_hang_the_survivors(cluster: Cluster, rdzv: Rdzv) -> None:
    """A node frozen mid-collective (agent and worker stopped, sockets open) never
    answers: gloo would wait out its timeout. The survivors' agents see its lease expire
    and interrupt their workers' collectives; training goes on at world 2 in the same
    processes."""
    (a, b, c), pids, marks = three_training(cluster, rdzv)

    frozen = (c.pid, pids["c"])
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        for p in (a, b):
            m = world_step(p, 2, start=marks[p.name])
            assert int(m["pid"]) == pids[p.name]
            assert p.text().count("worker started") == 1
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGKILL)
    finish(cluster, a, b)
    check_consistent([a, b])


def test_script_without_the_api_fails_at_start_with_a_clear_error(tmp_path: Path) -> None:
    """train_worker.py reads RANK from its environment; in this mode it gets no RANK
    (values that change between rounds come from the agent) and fails at once."""
    proc = subprocess.run(
        [sys.executable, "-m", "elasticrun", "--standalone", "--elastic-mode=in-process",
         str(Path(__file__).parent / "workers" / "train_worker.py"), "--steps", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "KeyError: 'RANK'" in proc.stderr
    assert "worker local rank 0 exited with exit code 1 before it connected to its agent" in proc.stderr
    assert "elasticrun.worker.elastic.run" in proc.stderr
