"""Stragglers and stalls in a plain DDP job, as users run them: no elasticrun API, no flag.

Real agents as nodes on 127.0.0.x, a real store, and tests/workers/ddp_worker.py: a
`DistributedDataParallel` model on gloo whose gradient all-reduce runs inside
`backward()`, where only the DDP hook's timing sees a fast rank wait for a slow one.

The slow node computes three times as much a step (more forward and backward passes
through a local copy of its model): no sleep, and nothing of elasticrun in the script.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest

from tests.support.elastic_cluster import RDZV_CONF, Cluster, Proc, Rdzv, run_id
from tests.support.helpers import wait_until

pytestmark = pytest.mark.timeout(240)

WORKER = Path(__file__).resolve().parents[1] / "workers" / "ddp_worker.py"
#: the leader judges every second and names a node slow in two evaluations in a row
CONF = RDZV_CONF + ",is_host=false,straggler_interval=1,straggler_after=2"
STEP = r"step=(?P<step>\d+) rank=(?P<rank>\d+) world=(?P<world>\d+) round=(?P<round>\d+) node=(?P<node>\S+)"


@pytest.fixture
def rdzv(c10d_store: str) -> Rdzv:
    return Rdzv("c10d", c10d_store, CONF, run_id())


def start(cluster: Cluster, rdzv: Rdzv, name: str, addr: int, *, args: tuple[str, ...] = (),
          extra: tuple[str, ...] = ()) -> Proc:
    """A node of a 2-node job."""
    return cluster.launch(
        name, "--nnodes=2", "--nproc-per-node=1", f"--rdzv-backend={rdzv.backend}",
        f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.run_id}", f"--rdzv-conf={rdzv.conf}",
        f"--local-addr=127.0.0.{addr}", "--max-restarts=0", "--shutdown-timeout=5",
        f"--log-dir={cluster.tmp / 'logs'}", *extra, str(WORKER), "--stop-file", str(cluster.stop_file), *args,
        env={"ELASTICRUN_TEST_COLLECTIVE": "gloo"},
    )


def status(cluster: Cluster, rdzv: Rdzv, *flags: str) -> str:
    done = cluster.control("status", *flags, f"--rdzv-backend={rdzv.backend}", f"--rdzv-endpoint={rdzv.endpoint}",
                           f"--rdzv-id={rdzv.run_id}")
    assert done.returncode == 0, done.stderr
    return done.stdout


def stalled_on_both(page: str) -> str | None:
    """The status page, once it shows the job and both its nodes stalled."""
    job = re.search(r"^stalled: no step for \S+ on 2 of 2 nodes", page, re.M)
    return page if job and len(re.findall(r"\sstalled\s", page)) == 2 else None


def node_of(agent: Proc) -> str:
    return agent.wait_for(STEP)["node"]


def test_a_slow_ddp_node_is_named_and_replaced_by_the_spare(cluster: Cluster, rdzv: Rdzv, tmp_path: Path) -> None:
    slow_dir = tmp_path / "slow"
    slow_dir.mkdir()
    mode, args = ("--straggler=replace",), ("--slow-dir", str(slow_dir))
    a = start(cluster, rdzv, "a", 2, extra=mode, args=args)
    b = start(cluster, rdzv, "b", 3, extra=mode, args=args)
    # b slows down after 10 steps (a shared host's CPU taken): compared with one other node
    # alone, a node is replaced only when it slowed against its own best
    b.wait_for(r"^\[\d\]<stdout>: step=10 ")
    (slow_dir / f"{socket.gethostname()}_{b.pid}").touch()
    slow, fast = node_of(b), node_of(a)
    spare = start(cluster, rdzv, "spare", 4, extra=mode, args=args)
    spare.wait_for(r"waiting: spare: ")

    line = rf"node {re.escape(slow)} is a straggler: compute \d+ms a step, [\d.]+x the other nodes' median"
    wait_until(lambda: any(re.search(line, p.text()) for p in (a, b, spare)), timeout=60, what=f"{slow} named")
    # the spare takes its place, and the slow node waits outside
    spare.wait_for(STEP.replace(r"(?P<round>\d+)", "2").replace(r"(?P<world>\d+)", "2"))
    data = json.loads(status(cluster, rdzv, "--json"))
    assert data["job"]["nodes"] == [fast, node_of(spare)] and data["job"]["restarts"] == 0, data["job"]
    [held] = data["quarantine"]
    assert held["node_id"] == slow and held["reason"].startswith("straggler: "), held
    assert not any(e["kind"] == "straggler" and e["node"] == fast for e in data["events"]), data["events"]

    cluster.stop_training()
    for p in (a, b, spare):
        assert p.wait_exit() == 0, p.text()[-3000:]
    cluster.assert_no_orphans()


def test_a_stuck_ddp_rank_and_a_collective_mismatch_are_shown_stalled_with_no_flag(
    cluster: Cluster, c10d_store: str
) -> None:
    # two jobs at once: the stall is a minute long, and both wait for it together
    stuck = Rdzv("c10d", c10d_store, RDZV_CONF + ",is_host=false", run_id())
    crossed = Rdzv("c10d", c10d_store, RDZV_CONF + ",is_host=false", run_id())
    fault = ("--fault-rank", "1", "--fault-step", "4")
    agents = {
        "stuck": [start(cluster, stuck, f"s{i}", 2 + i, args=(*fault, "--stuck")) for i in range(2)],
        "crossed": [start(cluster, crossed, f"c{i}", 4 + i, args=(*fault, "--mismatch")) for i in range(2)],
    }
    for job, rdzv, expected in (
        ("stuck", stuck, r"rank 1 on node \S+: ddp_worker\.py:\d+ in load_batch"),
        ("crossed", crossed, r"collective mismatch: rank 0 in all_reduce, rank 1 in broadcast"),
    ):
        logged = r"no step for \d+s \(usually [\d.]+s a step\): where the ranks are \(job-wide: 2 of 2 nodes"
        for agent in agents[job]:
            agent.wait_for(logged, timeout=120)
        text = agents[job][0].text()
        assert re.search(expected, text), text[-3000:]
        # a node's step report goes out at most once per straggler_interval: status may lag
        page = wait_until(lambda r=rdzv: stalled_on_both(status(cluster, r)), 30, f"status: job {job} stalled on both")
        assert re.search(rf"^stacks \S+ \(\S+: stalled: no step .*{expected}", page, re.M), page
        for agent in agents[job]:
            assert agent.popen.poll() is None  # nothing is stopped without --progress-timeout
    for agent in (*agents["stuck"], *agents["crossed"]):
        agent.kill()
