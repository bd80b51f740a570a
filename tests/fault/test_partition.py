"""Partition one node: it runs in its own network namespace, joined to the host (the
store and the other nodes) by one veth pair that the test takes down and up again.

Three agents (c10d, a standalone `elasticrun store serve` on the host end of the veth)
train at world 3; node c — the job's leader, the harder case — sits in the namespace.
The link goes down. The survivors must go on at world 2 once c's lease lapses; c must
stop its own workers when it loses its lease and train nothing while cut off (with
--nnodes=1:3 a lone node *could* form a job on its own: it must not, nor may its old
group go on after the survivors start at world 2). When the link returns, c either
rejoins (scale-up to world 3, nothing spent) or — when it gave up on the store first —
has exited non-zero with one clear line.
"""

from __future__ import annotations

import re
import time

import pytest

from elasticrun.errors import EXIT_INFRASTRUCTURE
from tests.fault.conftest import (
    FaultCluster,
    Netns,
    agent_of,
    check_no_line_lost,
    check_steps_never_go_back,
    redone,
    serve_store,
    step_pattern,
    steps_in,
)
from tests.support.elastic_cluster import RDZV_CONF, pid_alive, run_id
from tests.support.helpers import wait_until
from tests.support.reliability_rows import Reliability

pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]


@pytest.mark.parametrize("after", ["rejoin", "exit"])
def test_partitioned_node_stops_its_workers_and_rejoins_or_exits(
    netns: Netns, fault_cluster: FaultCluster, reliability: Reliability, after: str
) -> None:
    cluster = fault_cluster
    store, endpoint = serve_store(netns.host_ip, cluster.tmp / "store.log")
    try:
        _partition(netns, cluster, reliability, endpoint, after)
    finally:
        store.kill()


def _partition(netns: Netns, cluster: FaultCluster, reliability: Reliability, endpoint: str, after: str) -> None:
    job = run_id()
    # c rides out the cut when it may wait long enough for the store; else it gives up
    store_timeout = 120 if after == "rejoin" else 3
    host_env = {"GLOO_SOCKET_IFNAME": netns.host_if}
    common = dict(endpoint=endpoint, run_id=job, nnodes="1:3")
    c = cluster.agent(
        "c", local_addr=netns.ns_ip, prefix=netns.prefix, env={"GLOO_SOCKET_IFNAME": netns.ns_if},
        conf=f"{RDZV_CONF},is_host=false,store_timeout={store_timeout}", **common,
    )
    c.wait_for(r"node \S+ leads job")
    a = cluster.agent("a", local_addr=netns.host_ip, env=host_env, **common)
    b = cluster.agent("b", local_addr=netns.host_ip, env=host_env, **common)
    three = {p.name: p.wait_for(step_pattern(3)) for p in (a, b, c)}
    c_worker = int(three["c"]["pid"])
    marks = {p.name: p.mark() for p in (a, b, c)}

    cut_at = time.time()
    netns.cut()

    # c: loses its membership (its lease lapses) and stops its own workers
    c.wait_for(r"lost its membership", start=marks["c"])
    wait_until(lambda: not pid_alive(c_worker), what=f"c's worker {c_worker} to stop")
    c_stopped_at = time.time()
    # the survivors go on at world 2, for free
    two = {p.name: p.wait_for(step_pattern(2, restart=0), start=marks[p.name]) for p in (a, b)}
    first_two = min(row["t"] for p in (a, b) for row in steps_in(p.text()[marks[p.name]:]) if row["world"] == 2)

    if after == "exit":
        code = c.wait_exit()
        text = c.text()
        assert code == EXIT_INFRASTRUCTURE, text[-4000:]
        errors = re.findall(r"^elasticrun: error: .*$", text, re.MULTILINE)
        assert len(errors) == 1 and f"store at {endpoint} is unreachable" in errors[0], text[-4000:]
        assert "Traceback" not in text, text[-4000:]
    heal_at = time.time()
    netns.heal()
    marks = {p.name: p.mark() for p in (a, b, c)}
    if after == "rejoin":
        for p in (a, b, c):
            p.wait_for(step_pattern(3, restart=0), start=marks[p.name])
        c.wait_for(r"workers \w+ -> healthy", start=marks["c"])
    else:
        for p in (a, b):  # the survivors are not disturbed by the link's return
            p.wait_for(step_pattern(2, restart=0, round=two[p.name]["round"]), start=marks[p.name], count=5)

    # no split brain: c trained nothing once cut off (no step of it after the survivors'
    # first step at world 2, and no worker of it started while the link was down)
    c_steps = [row for row in cluster.worker_steps() if row["pid"] in _pids_of(cluster, c.pid)]
    overlap = [row for row in c_steps if first_two <= row["t"] < heal_at]
    assert not overlap, f"c trained while cut off: {overlap[:5]}"
    started_cut = [s for s in _starts(cluster, c.pid) if cut_at < s < heal_at]
    assert not started_cut, f"c started workers while cut off at {started_cut}"
    last_c = max((row["t"] for row in c_steps if row["t"] < heal_at), default=cut_at)

    cluster.stop_training()
    ends = {p.name: p.wait_exit() for p in (a, b, c)}
    assert ends["a"] == ends["b"] == 0, ends
    if after == "rejoin":
        assert ends["c"] == 0, c.text()[-4000:]
    cluster.assert_no_orphans()
    for p in (a, b, c):
        assert "Traceback" not in p.text(), f"{p.name}:\n{p.text()[-4000:]}"
    lines = check_no_line_lost(cluster)
    steps = check_steps_never_go_back(cluster)
    restarts = max(row["restart"] for row in cluster.worker_steps())
    assert restarts == 0

    if after == "rejoin":
        back = min(
            row["t"] for row in cluster.worker_steps() if row["world"] == 3 and row["t"] > heal_at
        )
        happened = (
            f"survivors at world 2 after {first_two - cut_at:.1f} s; c lost its lease, its worker "
            f"stopped {c_stopped_at - cut_at:.1f} s after the cut, no step of c after "
            f"{last_c - cut_at:+.1f} s; link back: c rejoined, world 3 after {back - heal_at:.1f} s"
        )
    else:
        happened = (
            f"survivors at world 2 after {first_two - cut_at:.1f} s; c lost its lease, its worker "
            f"stopped {c_stopped_at - cut_at:.1f} s after the cut, then c gave up on the store "
            f"(store_timeout=3) and exited {ends['c']} with one line; survivors undisturbed"
        )
    reliability.record(
        scenario=f"partition one node (c10d), link back: {after}",
        injected=(
            f"veth link of the leader node c down for {heal_at - cut_at:.1f} s "
            "(--nnodes=1:3, heartbeat_timeout=2)"
        ),
        happened=happened,
        recovery_s=first_two - cut_at,
        restarts=restarts,
        lost=f"{redone(steps['steps_redone_max'])}; 0 of {lines['lines']} log lines",
        split_brain=False,
        **lines,
        **steps,
    )


def _pids_of(cluster: FaultCluster, agent_pid: int) -> set[int]:
    """The worker PIDs of one agent, from its attempt logs."""
    return {
        int(p)
        for log in agent_of(cluster, agent_pid)
        for p in re.findall(r"^worker started .* pid=(\d+)", log.read_text(errors="replace"), re.MULTILINE)
    }


def _starts(cluster: FaultCluster, agent_pid: int) -> list[float]:
    """When each worker of one agent read its checkpoint (its start), wall clock."""
    return [
        float(t)
        for log in agent_of(cluster, agent_pid)
        for t in re.findall(r"^worker started .* read_at=([\d.]+)", log.read_text(errors="replace"), re.MULTILINE)
    ]
