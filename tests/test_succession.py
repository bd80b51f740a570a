"""The store's successors: who is named, what a successor copies, how a client finds the
node that serves (real gRPC servers on loopback; the whole failover: tests/fault/test_store_failover.py)."""

from __future__ import annotations

import asyncio

import pytest

from elasticrun.errors import StoreGoneError
from elasticrun.rendezvous.codec import encode
from elasticrun.rendezvous.keys import Keys
from elasticrun.rendezvous.records import JobSpec, NodeInfo
from elasticrun.rendezvous.rounds import Participant, Round
from elasticrun.rendezvous.succession import copied, follow, quorum, successors_of
from elasticrun.store.client.grpc_store import GrpcStore
from elasticrun.store.interface import EventType
from elasticrun.store.server.memory import MemoryStore
from elasticrun.store.server.store_server import StoreServer
from tests.support.helpers import free_port

pytestmark = pytest.mark.timeout(60)

KEYS = Keys("job")


def _round(*names: str, number: int = 4) -> Round:
    return Round(number=number, participants=tuple(Participant(n, n, 1) for n in names), restart_count=0,
                 reason="", opened_at=0.0)


def _info(name: str, port: int = 7) -> NodeInfo:
    return NodeInfo(node_id=name, host=name, addr=f"10.0.0.{ord(name[0]) - 96}", nproc=1, pid=1, started_at=0.0,
                    liveness_port=port)


def test_the_first_members_but_the_serving_one_are_named_in_rank_order() -> None:
    nodes = {n: _info(n) for n in "abcde"}
    named = successors_of(_round("b", "a", "c", "d", "e"), "a", nodes, 29400)
    assert named is not None
    assert [(s.node_id, s.endpoint) for s in named.nodes] == [("b", "10.0.0.2:29400"), ("c", "10.0.0.3:29400")]
    assert (named.serving, named.round, named.quorum) == ("a", 4, 3)


def test_a_round_of_two_names_nobody_and_a_node_without_a_liveness_port_is_passed_over() -> None:
    nodes = {"a": _info("a"), "b": _info("b", port=0), "c": _info("c")}
    assert successors_of(_round("a", "b"), "a", nodes, 29400) is None
    named = successors_of(_round("a", "b", "c"), "a", nodes, 29400)
    assert named is not None and [s.node_id for s in named.nodes] == ["c"]


def test_a_majority_is_more_than_half() -> None:
    assert [quorum(n) for n in (3, 4, 5, 6)] == [2, 3, 3, 4]


def test_what_a_successor_copies_outlives_its_writers() -> None:
    lasting = [KEYS.spec, KEYS.launch, KEYS.round, KEYS.quarantine, KEYS.successors, KEYS.shard("00000004-a", 0),
               KEYS.hold("a"), KEYS.drain("a"), KEYS.departure("a"), KEYS.event(1.0, "a")]
    leased = [KEYS.node("a"), KEYS.ack("a"), KEYS.leader, KEYS.master, KEYS.state, KEYS.ping, KEYS.restart,
              KEYS.status("a"), KEYS.log(0), KEYS.step_report("a"), KEYS.stragglers]
    assert [k for k in lasting if not copied(KEYS, k)] == []
    assert [k for k in leased if copied(KEYS, k)] == []


async def test_the_copy_follows_the_serving_store() -> None:
    source, copy = MemoryStore(), MemoryStore()
    await source.put(KEYS.spec, encode(JobSpec(command=("train.py",))))
    lease = await source.grant_lease(30)
    await source.put(KEYS.node("a"), b"{}", lease=lease)
    task = asyncio.ensure_future(follow(source, copy, KEYS))
    try:
        async with asyncio.timeout(10):
            copied_at = 0
            async for put in copy.watch(KEYS.spec, start_revision=1):  # read once: the spec is there
                copied_at = put.revision
                break
            await source.put(KEYS.event(2.0, "a"), b"{}")
            await source.delete(KEYS.spec)
            async for deleted in copy.watch(KEYS.spec, start_revision=copied_at + 1):  # then followed
                assert deleted.type is EventType.DELETE
                break
        held = {kv.key for kv in (await copy.get_prefix(KEYS.prefix)).kvs}
        assert held == {KEYS.event(2.0, "a")}  # the spec gone with its deletion; no registration
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await source.close()
        await copy.close()


async def test_a_client_given_a_list_finds_the_node_that_serves() -> None:
    port = free_port()
    serving = StoreServer("127.0.0.3", port, hosted_by_agent=True)
    await serving.start()
    client = GrpcStore(f"127.0.0.1:{port}", others=[f"127.0.0.2:{port}", f"127.0.0.3:{port}"], timeout=5)
    try:
        await client.put("k", b"v")  # refused at .1 and .2; served at .3
        assert client.endpoint == f"127.0.0.3:{port}"
        assert (await serving.engine.get("k")) is not None
        # that agent goes and a successor serves: the client turns to it once told where
        successor = StoreServer("127.0.0.2", port, hosted_by_agent=True)
        await serving.stop()
        with pytest.raises(StoreGoneError):
            await client.get("k")
        await successor.start()
        try:
            assert await client.turn_to([f"127.0.0.2:{port}"]) == f"127.0.0.2:{port}"
            assert (await client.get("k")) is None  # a store of its own: what it copied, nothing else
        finally:
            await successor.stop()
    finally:
        await client.close()
