"""The head of a c10d job restarts: the agent hosting the store in-process (is_host=true)
is SIGKILLed, and a new agent comes up at the same endpoint, as a scheduler restarting
the head does (a Kubernetes pod replaced behind its Service name, a Slurm requeue of the
first task).

The survivors must see the store refuse them, stop their workers, say what they wait
for and until when, register with the new head's fresh store as soon as it answers, and
train on with it at world 2, in a round numbered above the one they lost, with no
restart spent; then the job ends with exit 0 everywhere. The job has two nodes: one of
three or more fails over to a successor instead (tests/fault/test_store_failover.py). When no head comes back, the
survivors exit 200 once `store_host_grace` has passed: that is
test_store_loss.py's `agent` case.

The first two tests run the rendezvous alone (nodes in one event loop, real gRPC store
servers on loopback, no workers): the protocol in a second or two; the last one the
whole agents, workers included.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
from collections.abc import AsyncIterator

import pytest

from elasticrun.errors import StoreGoneError
from elasticrun.rendezvous.elastic import ElasticRendezvous
from elasticrun.rendezvous.records import JobSpec, NodeInfo
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.store.client.grpc_store import GrpcStore
from elasticrun.store.server.store_server import StoreServer
from tests.fault.conftest import FaultCluster, check_no_line_lost, check_steps_never_go_back, step_pattern
from tests.support.elastic_cluster import RDZV_CONF, Proc, pid_alive, run_id
from tests.support.helpers import free_port, wait_until
from tests.support.reliability_rows import Reliability

pytestmark = pytest.mark.timeout(180)

NNODES = "2:3"


# --- the rendezvous alone ----------------------------------------------------------------


class _Nodes:
    """Nodes of one job in this event loop, each with its own client of a store that an
    agent hosts (`hosted_by_agent`, as `serve_here` makes it), at one fixed endpoint."""

    def __init__(self, grace: float) -> None:
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.settings = RendezvousSettings(
            run_id="job", min_nodes=2, max_nodes=3, last_call=0.2, heartbeat_ttl=2.0, join_timeout=30.0,
            store_host_grace=grace,
        )
        self.clients: list[GrpcStore] = []
        self.nodes: list[ElasticRendezvous] = []
        self.servers: list[StoreServer] = []

    async def host(self) -> StoreServer:
        """A new store at the endpoint: what a restarted head serves (empty)."""
        server = StoreServer("127.0.0.1", self.port, hosted_by_agent=True)
        await server.start()
        self.servers.append(server)
        return server

    def node(self, name: str) -> ElasticRendezvous:
        client = GrpcStore(self.endpoint, timeout=5.0)
        me = NodeInfo(node_id=name, host="localhost", addr="127.0.0.1", nproc=1, pid=os.getpid(), started_at=0.0)
        node = ElasticRendezvous(client, self.settings, me, spec=JobSpec(command=("train.py",)))
        self.clients.append(client)
        self.nodes.append(node)
        return node

    async def close(self) -> None:
        await asyncio.gather(*(n.aclose() for n in self.nodes), return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.clients))
        await asyncio.gather(*(s.stop(0) for s in self.servers))


@pytest.fixture
async def nodes(request: pytest.FixtureRequest) -> AsyncIterator[_Nodes]:
    job = _Nodes(request.param)
    try:
        yield job
    finally:
        await job.close()


async def _lose_the_host(job: _Nodes, server: StoreServer) -> None:
    """Stop the store (its agent is gone) and see every node lose its round to it."""
    await server.stop(0)
    ended = await asyncio.gather(*(n.round_ended() for n in job.nodes))
    assert all("the agent that hosted it is gone" in e for e in ended), ended
    grace = job.settings.store_host_grace
    said = (
        rf"the store at {re.escape(job.endpoint)} \(hosted by the agent on 127.0.0.1\) refused a connection: "
        rf"waiting until \d\d:\d\d:\d\d \(store_host_grace={grace:g}s\) for a new store there"
    )
    assert all(re.fullmatch(said, n.waiting_status) for n in job.nodes), [n.waiting_status for n in job.nodes]


@pytest.mark.parametrize("nodes", [30.0], indirect=True)
async def test_nodes_register_with_the_new_store_of_a_restarted_host(
    nodes: _Nodes, caplog: pytest.LogCaptureFixture
) -> None:
    server = await nodes.host()
    a, b = nodes.node("a"), nodes.node("b")
    first = await asyncio.gather(a.next_round(), b.next_round())
    await _lose_the_host(nodes, server)
    caplog.set_level(logging.INFO, logger="elasticrun.rendezvous")
    waiting = asyncio.gather(a.next_round(), b.next_round())
    while sum("waiting: the store at" in r.getMessage() for r in caplog.records) < 2:  # both were refused
        assert not waiting.done()
        await asyncio.sleep(0.01)
    await nodes.host()
    again = await waiting
    # the new store counts from round 1: the leader numbers the round above the lost one
    assert {x.round for x in again} == {first[0].round + 1}, again
    assert all(x.node_count == 2 and x.restart_count == 0 for x in again), again
    back = [r.getMessage() for r in caplog.records if "a store answers at" in r.getMessage()]
    assert len(back) == 2, back


@pytest.mark.parametrize("nodes", [0.5], indirect=True)
async def test_nodes_give_up_when_no_store_comes_back_within_the_grace(nodes: _Nodes) -> None:
    server = await nodes.host()
    a, b = nodes.node("a"), nodes.node("b")
    await asyncio.gather(a.next_round(), b.next_round())
    await _lose_the_host(nodes, server)
    gone = "the agent that hosted it is gone, and no new store answered there within store_host_grace=0.5s$"
    for node in (a, b):
        with pytest.raises(StoreGoneError, match=gone):
            await node.next_round()


# --- whole agents and their workers ------------------------------------------------------


def test_a_restarted_head_brings_the_job_back(fault_cluster: FaultCluster, reliability: Reliability) -> None:
    cluster = fault_cluster
    job = run_id()
    endpoint = f"127.0.0.1:{free_port()}"

    def head(name: str) -> Proc:
        return cluster.agent(name, endpoint=endpoint, run_id=job, local_addr="127.0.0.1", nnodes=NNODES,
                             conf=f"{RDZV_CONF},is_host=true")

    old = head("head")
    old.wait_for(r"hosting the rendezvous store on")
    survivors = [
        cluster.agent(n, endpoint=endpoint, run_id=job, local_addr=f"127.0.0.{i + 2}", nnodes=NNODES,
                      conf=f"{RDZV_CONF},is_host=false")
        for i, n in enumerate(["a"])
    ]
    running = {p.name: p.wait_for(step_pattern(2)) for p in [old, *survivors]}
    lost_round = max(int(m["round"]) for m in running.values())
    workers = {name: int(m["pid"]) for name, m in running.items()}
    marks = {p.name: p.mark() for p in survivors}

    since_kill = reliability.clock()
    old.signal(signal.SIGKILL)
    old.wait_exit()
    host = re.escape(endpoint.rpartition(":")[0])
    waiting = (
        rf"workers stopped -> init: the store at {re.escape(endpoint)} \(hosted by the agent on {host}\) "
        r"refused a connection: waiting until \d\d:\d\d:\d\d \(store_host_grace=30s\) for a new store there$"
    )
    for p in survivors:
        p.wait_for(r"lost its membership: .*the agent that hosted it is gone", start=marks[p.name])
        p.wait_for(waiting, start=marks[p.name])
    # the survivors' workers stop while they wait: the round they ran is lost
    wait_until(lambda: not any(pid_alive(pid) for pid in workers.values()), what="the lost round's workers to stop")
    waited = since_kill()

    new = head("head2")
    new.wait_for(r"hosting the rendezvous store on")
    back = {p.name: p.wait_for(rf"a store answers at {re.escape(endpoint)}, [\d.]+ s after the one at "
                               rf"{re.escape(endpoint)} refused: registered again",
                               start=marks[p.name]) for p in survivors}
    stepping = {p.name: p.wait_for(step_pattern(2), start=back[p.name].end() if p in survivors else 0)
                for p in [new, *survivors]}
    recovery = since_kill()
    for name, m in stepping.items():
        assert int(m["round"]) > lost_round, f"{name} stepped in round {m['round']}, not above the lost {lost_round}"
        assert int(m["restart"]) == 0, f"{name}: a restart was spent: {m[0]}"
        assert int(m["pid"]) not in workers.values(), f"{name}: a worker of the lost round stepped on: {m[0]}"
    # what the survivors said between the kill and their new round: no round but the new one
    for p in survivors:
        said = p.text()[marks[p.name]:back[p.name].start()]
        assert not re.search(r"-> init: round \d+", said), said[-3000:]
        assert "Traceback" not in said, said[-3000:]

    cluster.stop_training()
    codes = {p.name: p.wait_exit() for p in [new, *survivors]}
    assert codes == {"head2": 0, "a": 0}, {p.name: p.text()[-3000:] for p in [new, *survivors]}
    cluster.assert_no_orphans()
    lines = check_no_line_lost(cluster)
    steps = check_steps_never_go_back(cluster)
    rounds = sorted({int(r["round"]) for r in cluster.worker_steps() if int(r["round"]) > lost_round})

    reliability.record(
        scenario="c10d head restarted (store-hosting agent)",
        injected="SIGKILL to the agent hosting the store (is_host=true) while 2 nodes train; a new agent "
                 "at the same endpoint once the survivors say they wait",
        happened=(
            f"the survivor stopped its workers and waited (store_host_grace=30s); the new head was "
            f"started {waited:.1f} s after the kill; both stepped at world 2 in round(s) {rounds} of the new "
            "store; exit 0 everywhere; no process left"
        ),
        recovery_s=round(recovery, 2),
        restarts=0,
        lost=f"{steps['steps_redone_max']} steps redone since the last checkpoint; 0 of {lines['lines']} log lines",
        **lines,
        **steps,
    )
