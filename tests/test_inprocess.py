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
from collections import defaultdict
from pathlib import Path

import pytest

from tests.support.elastic_cluster import Cluster, Proc, Rdzv, etcd_run_is_slow
from tests.support.helpers import ELASTICRUN
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


def joins(cluster: Cluster, rdzv: Rdzv, name: str, addr: int, survivors: dict[Proc, int]) -> Proc:
    """A new node joins the survivors (agent -> its worker's PID) of a world of 2: all
    three train at world 3; each survivor in the same process, its steps resumed (never
    restarted), and the newcomer from at least the survivors' commit (sent by broadcast)."""
    marks = {p: p.mark() for p in survivors}
    before = {p: int(world_step(p, 2, start=marks[p])["step"]) for p in survivors}
    newcomer = node(cluster, rdzv, name, addr)
    for p in survivors:
        m = world_step(p, 3, start=marks[p])
        assert int(m["pid"]) == survivors[p]  # the same process
        assert int(m["step"]) > before[p]  # resumed, not restarted
        said_in_place(p, marks[p])
        assert re.search(r"\] round \d+: scale up .*: re-forming in place, the workers kept$",
                         p.text()[marks[p]:], re.M), p.text()[-3000:]
    joined = newcomer.wait_for(r"joined rank=\d+ world=3 round=\d+ pid=\d+ step=(\d+)")
    assert int(joined.group(1)) >= min(before.values())
    world_step(newcomer, 3)
    return newcomer


def survive(survivors: dict[Proc, int], marks: dict[Proc, int]) -> None:
    """After a node's loss (marks: the survivors' output then), the survivors train at
    world 2 in the same processes, with no restart spent (--max-restarts=0): a loss is a
    membership change, not a failure."""
    for p, pid in survivors.items():
        m = world_step(p, 2, start=marks[p])
        assert int(m["pid"]) == pid, p.name  # never restarted
        assert p.text().count("worker started") == 1
        said_in_place(p, marks[p])
        assert re.search(r"ranks \d+-\d+ of 2, restart 0/0", p.text()[marks[p]:]), p.name


def said_in_place(agent: Proc, mark: int) -> None:
    """The agent's lines since `mark` say the group re-formed in place; none says its
    workers stopped (they did not)."""
    since = agent.text()[mark:]
    assert re.search(r"workers init -> healthy: round \d+, re-formed in place: node rank", since), since[-3000:]
    assert "workers healthy -> stopped" not in since, since[-3000:]
    assert "Traceback" not in since, since[-3000:]  # a lost peer's broken collective: one line


@etcd_run_is_slow
def test_survivors_keep_running_through_a_join_a_leave_a_kill_and_a_freeze(
    cluster: Cluster, rdzv: Rdzv
) -> None:
    """One job through every membership change the mode handles in place, in turn (each
    newcomer's worker start imports torch, the bulk of the test's time): a node joins;
    it leaves on SIGTERM; another joins and is SIGKILLed with its worker; a third joins
    and freezes mid-collective (agent and worker stopped, sockets open: gloo would wait
    out its timeout, so the survivors' agents must see its lease expire and interrupt
    their workers' collectives). Nodes a and b train in the same processes throughout."""
    a, b = node(cluster, rdzv, "a", 2), node(cluster, rdzv, "b", 3)
    survivors = {p: worker_pid(p) for p in (a, b)}
    agents = [a, b]

    c = joins(cluster, rdzv, "c", 4, survivors)  # scale up
    agents.append(c)
    marks = {p: p.mark() for p in survivors}
    c.signal(signal.SIGTERM)
    assert c.wait_exit() != 0
    survive(survivors, marks)

    d = joins(cluster, rdzv, "d", 5, survivors)
    agents.append(d)
    marks = {p: p.mark() for p in survivors}
    kill_node(d, worker_pid(d))
    survive(survivors, marks)

    e = joins(cluster, rdzv, "e", 6, survivors)
    agents.append(e)
    marks = {p: p.mark() for p in survivors}
    frozen = (e.pid, worker_pid(e))
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        survive(survivors, marks)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGKILL)
    finish(cluster, a, b)
    check_consistent(agents)


def test_script_without_the_api_fails_at_start_with_a_clear_error(tmp_path: Path) -> None:
    """train_worker.py reads RANK from its environment; in this mode it gets no RANK
    (values that change between rounds come from the agent) and fails at once."""
    proc = subprocess.run(
        [*ELASTICRUN, "--standalone", "--elastic-mode=in-process",
         str(Path(__file__).parent / "workers" / "train_worker.py"), "--steps", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "KeyError: 'RANK'" in proc.stderr
    assert "worker local rank 0 exited with exit code 1 before it connected to its agent" in proc.stderr
    assert "elasticrun.worker.elastic.run" in proc.stderr
