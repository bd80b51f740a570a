"""The agent that serves the job's store goes, and the job goes on without any external store.

Four agents on loopback addresses (127.0.0.1 hosts the store at the start); the host
names the first two other members of the round as its successors; when it is SIGKILLed
the first successor serves the copy of the job's records it kept, at its own address,
and the others register there and train on at world 3, the restart count kept; `status`
given the list of the job's nodes finds the new serving node and shows the events from
before the failover, and a new node given that list joins there. SIGTERM hands
the store over at once. A partition that cuts the host off from the two other nodes of a
three-node job: only the majority side trains. docs/concepts.md, "When the store's host
goes".
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time

import pytest

from tests.fault.conftest import FaultCluster, Netns, agent_of, step_pattern, steps_in
from tests.support.elastic_cluster import RDZV_CONF, Proc, pid_alive, run_id
from tests.support.helpers import free_port, wait_until
from tests.support.reliability_rows import Reliability

pytestmark = pytest.mark.timeout(180)

NNODES = "3:4"


def _four(cluster: FaultCluster, job: str, endpoint: str) -> tuple[Proc, list[Proc]]:
    host = cluster.agent("h", endpoint=endpoint, run_id=job, local_addr="127.0.0.1", nnodes=NNODES,
                         conf=f"{RDZV_CONF},is_host=true")
    host.wait_for(r"hosting the rendezvous store on .* take it over if this node goes")
    others = [
        cluster.agent(n, endpoint=endpoint, run_id=job, local_addr=f"127.0.0.{i + 2}", nnodes=NNODES,
                      conf=f"{RDZV_CONF},is_host=false")
        for i, n in enumerate(["a", "b", "c"])
    ]
    return host, others


def test_killed_host_survivors_step_at_a_successor(fault_cluster: FaultCluster, reliability: Reliability) -> None:
    cluster = fault_cluster
    job = run_id()
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    host, others = _four(cluster, job, endpoint)
    running = {p.name: p.wait_for(step_pattern(4)) for p in [host, *others]}
    lost_round = max(int(m["round"]) for m in running.values())
    named = host.wait_for(r"the store's successors after round \d+: (?P<first>\S+) \((?P<at>[\d.:]+)\)")
    marks = {p.name: p.mark() for p in others}
    workers = [int(m["pid"]) for m in running.values()]

    since_kill = reliability.clock()
    host.signal(signal.SIGKILL)
    host.wait_exit()
    heir = next(p for p in others if f"_{p.pid}" in named["first"])
    heir.wait_for(rf"serving the job's store on {re.escape(named['at'])}", start=marks[heir.name])
    for p in others:
        p.wait_for(rf"a store answers at {re.escape(named['at'])}, [\d.]+ s after the one at "
                   rf"{re.escape(endpoint)} refused: registered again", start=marks[p.name])
    stepping = {p.name: p.wait_for(step_pattern(3), start=marks[p.name]) for p in others}
    recovery = since_kill()
    for name, m in stepping.items():
        assert int(m["round"]) > lost_round, f"{name} stepped in round {m['round']}, not above {lost_round}"
        assert int(m["restart"]) == 0, f"{name}: a restart was spent: {m[0]}"
    wait_until(lambda: not any(pid_alive(w) for w in workers), what="the lost round's workers to stop")
    rounds = sorted({int(m["round"]) for m in stepping.values()})
    reliability.record(
        scenario="c10d store host lost, 4 nodes (failover to a successor)",
        injected="SIGKILL to the agent hosting the store (is_host=true) while 4 nodes train; no external store",
        happened=(
            f"its first successor served its copy of the job's records at {named['at']}; the 3 survivors "
            f"registered there and stepped at world 3 in round(s) {rounds}; "
            "status found it from a list of the nodes, with the events from before; a new node given the list joined"
        ),
        recovery_s=round(recovery, 2),
        restarts=0,
        lost="the round that ran (new workers, from the last checkpoint)",
    )

    # the new serving node shows what happened before it served, found from a list of the
    # job's nodes whose first one (the old host) is gone
    every = ",".join(f"127.0.0.{i}:{port}" for i in range(1, 5))
    status = cluster.control("status", f"--rdzv-endpoint={every}", f"--rdzv-id={job}", "--json")
    assert status.returncode == 0, status.stderr
    events = json.loads(status.stdout)["events"]
    before = [e for e in events if re.search(rf"round {lost_round}\b", e["detail"])]
    assert before, events

    # a new node given the list joins the job where it is served (it hosts no new store at
    # the old host's address, which is this machine's too)
    d = cluster.agent("d", endpoint=every, run_id=job, local_addr="127.0.0.5", nnodes=NNODES, conf=RDZV_CONF)
    for p in [*others, d]:
        p.wait_for(step_pattern(4), start=marks.get(p.name, 0))
    assert "hosting the rendezvous store" not in d.text(), d.text()[-3000:]

    cluster.stop_training()
    codes = {p.name: p.wait_exit() for p in [*others, d]}
    assert codes == {"a": 0, "b": 0, "c": 0, "d": 0}, {p.name: p.text()[-3000:] for p in [*others, d]}
    cluster.assert_no_orphans()


def test_preempted_host_hands_the_store_over(fault_cluster: FaultCluster) -> None:
    """SIGTERM to the serving agent: it leaves the job and stops serving at once, without
    waiting for the others to leave (its successor takes the store over); the others
    never wait store_host_grace (30 s here) for a store at the old endpoint."""
    cluster = fault_cluster
    job = run_id()
    endpoint = f"127.0.0.1:{free_port()}"
    host, others = _four(cluster, job, endpoint)
    running = {p.name: p.wait_for(step_pattern(4)) for p in [host, *others]}
    lost_round = max(int(m["round"]) for m in running.values())
    named = host.wait_for(r"the store's successors after round \d+: (?P<first>\S+) \((?P<at>[\d.:]+)\)")
    marks = {p.name: p.mark() for p in others}

    host.signal(signal.SIGTERM)
    host.wait_for(rf"handing the store over to {re.escape(named['first'])}: it serves the job from now on")
    host.wait_exit()
    assert "keeping the store up until" not in host.text(), host.text()[-3000:]
    for p in others:
        p.wait_for(rf"a store answers at {re.escape(named['at'])}, [\d.]+ s after the one at "
                   rf"{re.escape(endpoint)} refused: registered again", start=marks[p.name])
    stepping = {p.name: p.wait_for(step_pattern(3), start=marks[p.name]) for p in others}
    for name, m in stepping.items():
        assert int(m["round"]) > lost_round, f"{name} stepped in round {m['round']}, not above {lost_round}"
        assert int(m["restart"]) == 0, f"{name}: a restart was spent: {m[0]}"
    for p in others:
        p.wait_for(rf"refused a connection: turning to its successors \({re.escape(named['at'])}, \S+\) until "
                   r"\d\d:\d\d:\d\d \(store_host_grace=30s\)", start=marks[p.name])
        assert "for a new store there" not in p.text()[marks[p.name]:], p.text()[-3000:]

    cluster.stop_training()
    codes = {p.name: p.wait_exit() for p in others}
    assert codes == {"a": 0, "b": 0, "c": 0}, {p.name: p.text()[-3000:] for p in others}
    cluster.assert_no_orphans()


@pytest.mark.netns
def test_partition_only_the_majority_side_trains(netns: Netns, fault_cluster: FaultCluster) -> None:
    """Three nodes: the host h in a network namespace, a and b outside it (b at an address
    of a second veth pair, so that each successor serves at an address of its own). The
    host's link goes down: h keeps its store but finds only itself of round N's three,
    stops its workers and waits for a majority; a (its first successor) serves its copy
    once the store has not answered for its whole timeout, and a and b train at world 2."""
    other = Netns()
    try:
        other.create()
        # h reaches b's address through its own veth; the host answers for any address of its own
        subprocess.run([*netns.prefix, "ip", "route", "add", f"{other.host_ip}/32", "dev", netns.ns_if],
                       check=True, capture_output=True, timeout=30)
        _partition(netns, other, fault_cluster)
    finally:
        other.remove()


def _partition(netns: Netns, other: Netns, cluster: FaultCluster) -> None:
    job = run_id()
    endpoint = f"{netns.ns_ip}:{free_port()}"
    conf = f"{RDZV_CONF},store_timeout=3"
    common = dict(endpoint=endpoint, run_id=job, nnodes="1:3")
    h = cluster.agent("h", local_addr=netns.ns_ip, prefix=netns.prefix, env={"GLOO_SOCKET_IFNAME": netns.ns_if},
                      conf=f"{conf},is_host=true", **common)
    h.wait_for(r"hosting the rendezvous store on")
    a = cluster.agent("a", local_addr=netns.host_ip, env={"GLOO_SOCKET_IFNAME": netns.host_if},
                      conf=f"{conf},is_host=false", **common)
    h.wait_for(step_pattern(2))  # a is node rank 1: the first successor
    b = cluster.agent("b", local_addr=other.host_ip, env={"GLOO_SOCKET_IFNAME": other.host_if},
                      conf=f"{conf},is_host=false", **common)
    three = {p.name: p.wait_for(step_pattern(3)) for p in (h, a, b)}
    round_n = max(int(m["round"]) for m in three.values())
    h.wait_for(rf"the store's successors after round {round_n}: \S+ \({re.escape(netns.host_ip)}:")
    marks = {p.name: p.mark() for p in (h, a, b)}

    cut_at = time.time()
    netns.cut()
    h.wait_for(rf"waiting for a majority of round {round_n}'s nodes \(1 of 2 here\)", start=marks["h"])
    a.wait_for(rf"serving the job's store on {re.escape(netns.host_ip)}:", start=marks["a"])
    two = {p.name: p.wait_for(step_pattern(2, restart=0), start=marks[p.name]) for p in (a, b)}
    for name, m in two.items():
        assert int(m["round"]) > round_n, f"{name} stepped in round {m['round']}, not above {round_n}"
    first_two = min(row["t"] for p in (a, b) for row in steps_in(p.text()[marks[p.name]:]) if row["world"] == 2)
    for p in (a, b):  # the majority side goes on
        p.wait_for(step_pattern(2, restart=0, round=two[p.name]["round"]), start=marks[p.name], count=5)

    # the minority side trained nothing once the majority side formed: no step of h after
    # the first step at world 2, none of its workers started since the cut
    h_steps = [row for log in agent_of(cluster, h.pid) for row in steps_in(log.read_text(errors="replace"))]
    assert not [row for row in h_steps if row["t"] >= first_two], h_steps[-5:]
    assert not [row for row in h_steps if row["t"] > cut_at and row["world"] < 3], h_steps[-5:]

    cluster.stop_training()
    codes = {p.name: p.wait_exit() for p in (a, b)}
    assert codes == {"a": 0, "b": 0}, {p.name: p.text()[-3000:] for p in (a, b)}
    h.signal(signal.SIGTERM)
    h.wait_exit()
    cluster.assert_no_orphans()
