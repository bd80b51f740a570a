"""Stragglers and stalls in a plain DDP job, as users run them: no elasticrun API, no flag.

Real agents as nodes on 127.0.0.x, a real store, and tests/workers/ddp_worker.py: a
`DistributedDataParallel` model on gloo whose gradient all-reduce runs inside
`backward()`, where only the DDP hook's timing sees a fast rank wait for a slow one.

A slow DDP node is in tests/fault/test_shared_cpu_stragglers.py, with the examples'.
"""

from __future__ import annotations

import re
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


@pytest.mark.slow  # a minute's wait (STALL_MIN); tests/test_stacks_jobs.py names a stuck rank sooner
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
