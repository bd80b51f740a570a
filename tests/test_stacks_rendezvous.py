"""Job-wide stacks over a real store: who asks, who answers, who reads the answers.

Several `ElasticRendezvous` nodes in one event loop over a `MemoryStore`, as in
tests/test_rendezvous.py: when every node's watchdog fires at once, one request stands,
one node reads the answers, and every node gets the same summary; a node answers each
request of the round it runs once, and none of another round.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

import pytest

from elasticrun.rendezvous.elastic import ElasticRendezvous
from elasticrun.rendezvous.keys import Keys
from elasticrun.rendezvous.records import Frame, JobSpec, NodeInfo, NodeStacks, RankStacks, ThreadStack
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.rendezvous.stacks import answer, ask, gather, new_request
from elasticrun.store.server.memory import MemoryStore

pytestmark = pytest.mark.timeout(30)

ALL_REDUCE = (
    Frame("/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", 3252, "all_reduce"),
    Frame("/job/train.py", 120, "step"),
)
LOAD_BATCH = (Frame("/job/train.py", 88, "load_batch"), Frame("/job/train.py", 118, "step"))


def node(store: MemoryStore, name: str) -> ElasticRendezvous:
    s = RendezvousSettings(run_id="job", min_nodes=3, max_nodes=3, last_call=0.2, heartbeat_ttl=2.0,
                           join_timeout=10.0, closed_ttl=1.0)
    me = NodeInfo(node_id=name, host="localhost", addr="127.0.0.1", nproc=2, pid=os.getpid(), started_at=0.0)
    return ElasticRendezvous(store, s, me, spec=JobSpec(command=("train.py",)))


def stacks_of(name: str, offset: int, round_number: int, stuck: int | None = None) -> NodeStacks:
    ranks = tuple(
        RankStacks(rank=r, local_rank=r - offset, node_id=name, pid=100 + r,
                   threads=(ThreadStack("0x1", LOAD_BATCH if r == stuck else ALL_REDUCE, main=True),))
        for r in (offset, offset + 1)
    )
    return NodeStacks(node_id=name, request="", reason="hang", at=0.0, round=round_number, ranks=ranks)


@pytest.fixture
async def job():
    store = MemoryStore()
    nodes = [node(store, n) for n in ("a", "b", "c")]
    places = await asyncio.gather(*(n.next_round() for n in nodes))
    yield store, nodes, places
    await asyncio.gather(*(n.aclose() for n in nodes))
    await store.close()


async def test_when_every_watchdog_fires_at_once_one_request_stands(job) -> None:
    store, nodes, places = job
    mine = [stacks_of(n._me.node_id, p.rank_offset, p.round, stuck=3) for n, p in zip(nodes, places, strict=True)]
    asks = (n.control.job_stacks(m, f"{m.node_id}: hang") for n, m in zip(nodes, mine, strict=True))
    results = await asyncio.gather(*asks)
    assert all(r is not None for r in results)
    requests = {r.request.id for r in results if r is not None}
    assert len(requests) == 1, "one request stood"
    readers = [r for r in results if r is not None and r.answers]
    assert len(readers) == 1 and sorted(a.node_id for a in readers[0].answers) == ["a", "b", "c"]
    owner = next(m.node_id for m in mine if any(k.rank == 3 for k in m.ranks))
    for r in results:
        assert r is not None and r.request.done and r.request.answered == 3 and r.request.nodes == 3
        assert r.request.summary == (
            f"rank 3 on node {owner}: train.py:88 in load_batch",
            "5 ranks: in all_reduce (train.py:120)",
        )
    # a node whose watchdog fires moments later takes that summary: no new request
    again = await nodes[0].control.job_stacks(mine[0], "a: hang")
    assert again is not None and again.request.id in requests and not again.answers


async def test_a_node_answers_each_request_of_its_round_once_and_none_of_another(job) -> None:
    store, nodes, places = job
    a, keys = nodes[0], Keys("job")
    asked = asyncio.ensure_future(a.control.stacks_asked())
    first = new_request("op", "on demand", places[0].round, 3)
    revision = await ask(store, keys, first, 0)
    assert revision is not None and (await asked).id == first.id
    await a.control.answer_stacks(stacks_of("a", places[0].rank_offset, places[0].round))
    # answered: a request of another round is skipped, the next one of this round comes
    asked = asyncio.ensure_future(a.control.stacks_asked())
    other = new_request("op", "stale", places[0].round + 7, 3)
    later = new_request("op", "again", places[0].round, 3)
    r1 = await ask(store, keys, other, revision)
    assert r1 is not None
    r2 = await ask(store, keys, later, r1)
    assert r2 is not None and (await asked).id == later.id
    # what a node publishes answers its request, on its lease, and whoever asked reads it
    mine = stacks_of("a", places[0].rank_offset, places[0].round)
    await answer(store, keys, replace(mine, request=later.id), a._lease or 0)
    got = await gather(store, keys, later.id, r2, nodes=1, timeout=5)
    assert list(got) == ["a"] and got["a"].ranks == mine.ranks
