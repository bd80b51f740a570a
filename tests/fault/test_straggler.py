"""A slow node: found by its workers' compute time per step, reported, and with
--straggler=replace taken out for a spare.

Real agents as nodes on 127.0.0.x, a real store, and a plain gloo training script
(tests/workers/straggler_worker.py) with nothing of elasticrun in it: the worker boot
times its optimizer steps and its all_reduce waits. One node's worker sleeps three
times as long per step; every rank's wall step is then the same (the others wait for it
in the all_reduce), and only the compute time names it.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.support.elastic_cluster import RDZV_CONF, Cluster, Proc, Rdzv, run_id
from tests.support.helpers import ELASTICRUN, free_port, wait_until

pytestmark = pytest.mark.timeout(240)

WORKER = Path(__file__).resolve().parents[1] / "workers" / "straggler_worker.py"
#: the leader judges every second and names a node slow in two evaluations in a row
CONF = RDZV_CONF + ",is_host=false,straggler_interval=1,straggler_after=2"
#: a step's own compute time, and the slow node's factor
STEP_TIME, FACTOR = 0.2, 3
STEP = r"step=(?P<step>\d+) rank=(?P<rank>\d+) world=(?P<world>\d+) round=(?P<round>\d+) node=(?P<node>\S+)"


@pytest.fixture
def rdzv(c10d_store: str) -> Rdzv:
    return Rdzv("c10d", c10d_store, CONF, run_id())


def node_id(agent: Proc) -> str:
    return f"{socket.gethostname()}_{agent.pid}"


def start(cluster: Cluster, rdzv: Rdzv, name: str, addr: int, slow_dir: Path, *, mode: str, metrics: int = 0) -> Proc:
    # No standbys: these tests count the steps to a verdict, and no node is judged while
    # its standbys import (docs/concepts.md); tests/fault/test_shared_cpu_stragglers.py
    # runs the verdict beside them
    extra = [f"--straggler={mode}", "--warm-imports=off", *([f"--metrics-port=127.0.0.1:{metrics}"] if metrics else [])]
    return cluster.agent(
        name, backend=rdzv.backend, endpoint=rdzv.endpoint, run_id=rdzv.run_id, local_addr=f"127.0.0.{addr}",
        nnodes="2", conf=rdzv.conf, worker=WORKER, extra=extra,
        worker_args=["--step-time", str(STEP_TIME), "--slow-dir", str(slow_dir), "--slow-factor", str(FACTOR)],
    )


def control(rdzv: Rdzv, *argv: str) -> str:
    done = subprocess.run(
        [*ELASTICRUN, *argv, f"--rdzv-backend={rdzv.backend}",
         f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.run_id}"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def named(agents: list[Proc], node: str, start: dict[str, int] | None = None) -> tuple[Proc, int]:
    """The agent whose leader named `node` a straggler, and where in its output."""
    line = rf"node {re.escape(node)} is a straggler: compute \d+ms a step, [\d.]+x the other nodes' median"

    def found() -> tuple[Proc, int] | None:
        for p in agents:
            m = re.compile(line).search(p.text(), (start or {}).get(p.name, 0))
            if m:
                return p, m.start()
        return None

    return wait_until(found, timeout=90, what=f"{node} named a straggler", interval=0.1)


def last_step(text: str) -> int:
    return max(int(m["step"]) for m in re.finditer(STEP, text))


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def test_a_node_three_times_slower_is_named_within_20_steps_and_only_reported_without_a_spare(
    cluster: Cluster, rdzv: Rdzv, tmp_path: Path, reliability
) -> None:
    slow_dir = tmp_path / "slow"
    slow_dir.mkdir()
    ports = [free_port(), free_port()]
    # --straggler=replace, but a job of --nnodes=2 with no spare cannot lose a node
    a = start(cluster, rdzv, "a", 2, slow_dir, mode="replace", metrics=ports[0])
    b = start(cluster, rdzv, "b", 3, slow_dir, mode="replace", metrics=ports[1])
    (slow_dir / node_id(b)).touch()  # before its worker's first step
    clock = reliability.clock()
    leader, at = named([a, b], node_id(b))
    steps = last_step(leader.text()[:at])
    assert steps < 20, f"named after {steps} steps"
    found_s = clock()

    # status: each node's compute per step, the straggler flagged with the reason
    page = control(rdzv, "status")
    assert re.search(rf"{re.escape(node_id(b))}\s+healthy \(straggler\)", page), page
    assert "STEP COMPUTE" in page and "STRAGGLER  SINCE" in page, page
    # slow since its first step, compared with one other node alone: never replaced on that node's word
    assert "not replaced on one other node's word without a slowdown of its own" in page, page
    data = json.loads(control(rdzv, "status", "--json"))
    nodes = {n["node_id"]: n for n in data["nodes"]}
    slow, fast = nodes[node_id(b)], nodes[node_id(a)]
    assert slow["straggler"]["relative"] >= 1.25 and fast["straggler"] is None
    assert slow["steps"]["compute"] > fast["steps"]["compute"] and slow["steps"]["source"] == "optimizer"
    assert data["job"]["round"] == 1 and not data["quarantine"]  # only reported: nothing changed
    events = [e for e in data["events"] if e["kind"] == "straggler"]
    assert [e["node"] for e in events] == [node_id(b)]  # once, not once per evaluation
    assert events[0]["detail"].startswith("named a straggler: compute")

    # metrics: the leader's agent exports every node's scores
    text = scrape(ports[[a, b].index(leader)])
    score = re.search(rf'elasticrun_straggler_score{{node_id="{re.escape(node_id(b))}",score="relative"}} (\S+)', text)
    assert score is not None and float(score[1]) >= 1.25, text
    assert re.search(r"^elasticrun_stragglers 1\.0$", text, re.M), text
    compute = re.search(r"^elasticrun_step_compute_seconds (\S+)$", scrape(ports[[a, b].index(b)]), re.M)
    assert compute is not None and float(compute[1]) == pytest.approx(slow["steps"]["compute"], rel=0.5)

    cluster.stop_training()
    assert a.wait_exit() == 0 and b.wait_exit() == 0
    cluster.assert_no_orphans()
    reliability.record(
        scenario="straggler, no spare",
        injected=f"one of two nodes computes {FACTOR}x as long per step (a plain gloo script); --straggler=replace",
        happened=f"the leader named it after {steps} steps (status, event, metrics); with no spare and "
        "--nnodes=2 it was only reported",
        recovery_s=None,
        restarts=0,
        lost="nothing",
        detect_s=round(found_s, 1),
    )


@pytest.mark.slow  # a spare replacing a straggler: test_shared_cpu_stragglers.py's DDP test stays
def test_with_a_spare_the_straggler_is_replaced_and_kept_out(
    cluster: Cluster, rdzv: Rdzv, tmp_path: Path, reliability
) -> None:
    slow_dir = tmp_path / "slow"
    slow_dir.mkdir()
    a = start(cluster, rdzv, "a", 2, slow_dir, mode="replace")
    b = start(cluster, rdzv, "b", 3, slow_dir, mode="replace")
    # b slows down after 10 steps at full speed (a throttling GPU): compared with one other node
    # alone, it is replaced only when it slowed against its own best, not when it was always slower
    b.wait_for(r"^\[\d\]<stdout>: step=10 ")
    first = json.loads(control(rdzv, "status", "--json"))["job"]["nodes"]  # round 1's, in node-rank order
    (slow_dir / node_id(b)).touch()
    spare = start(cluster, rdzv, "spare", 4, slow_dir, mode="replace")
    spare.wait_for(r"waiting: spare: ")
    clock = reliability.clock()
    named([a, b, spare], node_id(b))

    # the spare takes its place in round 2, for free, and the straggler waits outside
    spare.wait_for(STEP.replace(r"(?P<round>\d+)", "2").replace(r"(?P<world>\d+)", "2"))
    replaced_s = clock()
    b.wait_for(r"quarantined until \S+ \(straggler: compute \d+ms a step")
    data = json.loads(control(rdzv, "status", "--json"))
    assert data["job"]["round"] == 2 and data["job"]["restarts"] == 0
    # in b's place: a keeps its node rank
    assert data["job"]["nodes"] == [node_id(spare) if n == node_id(b) else n for n in first]
    assert sorted(first) == sorted([node_id(a), node_id(b)])
    [entry] = data["quarantine"]
    assert entry["node_id"] == node_id(b) and entry["quarantined"] and entry["reason"].startswith("straggler: ")

    # the job goes on at full speed: in round 2, step after step, nobody is slow
    start_at = {p.name: p.mark() for p in (a, spare)}
    spare.wait_for(STEP.replace(r"(?P<round>\d+)", "2"), start=start_at["spare"], count=25)
    assert not [e for e in json.loads(control(rdzv, "status", "--json"))["events"]
                if e["kind"] == "straggler" and e["node"] != node_id(b)]
    assert all("is a straggler" not in p.text()[start_at[p.name]:] for p in (a, spare))

    cluster.stop_training()
    for p in (a, b, spare):
        assert p.wait_exit() == 0, p.text()[-3000:]
    cluster.assert_no_orphans()
    reliability.record(
        scenario="straggler replaced by a spare",
        injected=f"one of two nodes computes {FACTOR}x as long per step after its 10th; a spare waits; "
        "--straggler=replace",
        happened="the leader named it, quarantined it (like a flapping node) and the spare took its place in "
        "the next round; round 2 ran with no straggler",
        recovery_s=round(replaced_s, 1),
        restarts=0,
        lost="the steps since the last checkpoint (restart mode: every worker restarts)",
    )


def test_a_lying_worker_does_not_get_its_honest_peer_replaced(
    cluster: Cluster, rdzv: Rdzv, tmp_path: Path, reliability
) -> None:
    """One node of two reports almost no compute (its worker computes inside
    `steptime.waiting()`): the honest node is named, said not replaced, and a spare stays out."""
    lie_dir, slow_dir = tmp_path / "lie", tmp_path / "slow"
    lie_dir.mkdir()
    slow_dir.mkdir()
    lying_args = ["--lie-dir", str(lie_dir)]

    def agent(name: str, addr: int) -> Proc:
        return cluster.agent(
            name, backend=rdzv.backend, endpoint=rdzv.endpoint, run_id=rdzv.run_id, local_addr=f"127.0.0.{addr}",
            nnodes="2", conf=rdzv.conf, worker=WORKER, extra=["--straggler=replace"],
            worker_args=["--step-time", str(STEP_TIME), "--slow-dir", str(slow_dir), *lying_args],
        )

    honest, liar = agent("honest", 2), agent("liar", 3)
    (lie_dir / node_id(liar)).touch()
    honest.wait_for(STEP.replace(r"(?P<round>\d+)", "1"))
    spare = agent("spare", 4)
    spare.wait_for(r"waiting: spare: ")
    leader, at = named([honest, liar, spare], node_id(honest))
    assert "not replaced on one other node's word" in leader.text()[at:].splitlines()[0], leader.text()[at:][:500]
    # 20 more steps after the verdict: still round 1, the honest node in it, the spare waiting
    start_at = honest.mark()
    honest.wait_for(STEP.replace(r"(?P<round>\d+)", "1"), start=start_at, count=20)
    data = json.loads(control(rdzv, "status", "--json"))
    assert data["job"]["round"] == 1 and sorted(data["job"]["nodes"]) == sorted([node_id(honest), node_id(liar)])
    assert not data["quarantine"], data["quarantine"]
    assert "round=2" not in honest.text() + spare.text()
    cluster.stop_training()
    for p in (honest, liar, spare):
        assert p.wait_exit() == 0, p.text()[-3000:]
    cluster.assert_no_orphans()
    reliability.record(
        part="security",
        scenario="a lying worker's step reports",
        injected="in a 2-node job with a spare and --straggler=replace, one node's worker computed inside "
        "steptime.waiting(), reporting almost no compute",
        happened="the honest node was named (its compute over the liar's), with 'not replaced on one other node's "
        "word without a slowdown of its own'; 20 steps later still round 1, no quarantine, the spare waiting",
        restarts=0, lost="nothing",
    )
