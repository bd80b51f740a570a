"""examples/train_inprocess.py does what it says: under `--elastic-mode=in-process` it
trains through a scale-up (2 -> 3 nodes) and a node loss (SIGKILL, 3 -> 2) in the same
survivor processes, the newcomer starts from the survivors' step, the loss falls, and
`elasticrun stop` ends it with every agent exiting 0. On the built-in store only: the
etcd path of the same mode is tests/test_inprocess.py's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.elastic_cluster import RDZV_CONF, Cluster, Proc, Rdzv, run_id
from tests.test_elastic_agents import kill_node
from tests.test_job_control import ctl

pytestmark = pytest.mark.timeout(180)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_inprocess.py"
ROUND = r"rank (?P<rank>\d+) pid (?P<pid>\d+): round at step (?P<step>\d+), world size {world}"
LOSS = re.compile(r"Step #(\d+)  Loss: ([\d.]+)  \(world size (\d+)\)")


def node(cluster: Cluster, rdzv: Rdzv, name: str, addr: int) -> Proc:
    return cluster.launch(name, "--elastic-mode=in-process",
        "--nnodes=2:3", "--nproc-per-node=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.run_id}", f"--rdzv-conf={rdzv.conf}",
        f"--local-addr=127.0.0.{addr}", "--shutdown-timeout=5", f"--log-dir={cluster.tmp / 'logs'}",
        str(EXAMPLE), "--steps", "1000000", "--step-time", "0.05",
    )


def loss_at(world: int) -> str:
    return LOSS.pattern.replace(r"(\d+)\)", rf"({world})\)")


def round_at(agent: Proc, world: int, start: int = 0) -> re.Match[str]:
    return agent.wait_for(ROUND.format(world=world), start=start)


def test_train_inprocess_scales_up_and_survives_a_node_loss(cluster: Cluster, c10d_store: str) -> None:
    rdzv = Rdzv("c10d", c10d_store, RDZV_CONF + ",is_host=false", run_id())
    a, b = node(cluster, rdzv, "a", 2), node(cluster, rdzv, "b", 3)
    rounds = {p.name: round_at(p, 2) for p in (a, b)}
    pids = {name: m["pid"] for name, m in rounds.items()}
    leader = a if rounds["a"]["rank"] == "0" else b  # rank 0 prints the loss; node ranks stay
    trained = int(leader.wait_for(loss_at(2))[1])
    marks = {p.name: p.mark() for p in (a, b)}

    c = node(cluster, rdzv, "c", 4)
    for p in (a, b):
        assert round_at(p, 3, marks[p.name])["pid"] == pids[p.name]  # the same process
    joined = round_at(c, 3)
    assert int(joined["step"]) >= trained  # the state came from a survivor, not step 0

    marks = {p.name: p.mark() for p in (a, b)}
    kill_node(c, int(joined["pid"]))
    for p in (a, b):
        assert round_at(p, 2, marks[p.name])["pid"] == pids[p.name]
    leader.wait_for(loss_at(2), start=marks[leader.name])

    losses = [float(m[2]) for m in LOSS.finditer(leader.text())]
    assert losses[-1] < losses[0]
    done = ctl(rdzv, "stop", "--timeout", "30")
    assert done.returncode == 0, done.stderr
    for p in (a, b):
        assert p.wait_exit() == 0, p.text()[-3000:]
        assert p.text().count("round at step") >= 3  # rounds of 2, 3, 2 in one process
    cluster.assert_no_orphans()
