"""Every background task of a node is supervised: one that dies of an unexpected error
ends the node's membership with the cause (its workers stop, it registers again), so a
node never looks alive while its heartbeat, job watch, reporter, look at the leader or
leader (with its watch, its straggler judge and its look outside the round) is dead."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from elasticrun.rendezvous import leader as leader_module
from elasticrun.rendezvous.elastic import ElasticRendezvous
from elasticrun.rendezvous.keys import Keys
from elasticrun.store.interface import WatchEvent
from elasticrun.store.server.memory import MemoryStore
from tests.test_rendezvous import make_node, settings

pytestmark = pytest.mark.timeout(30)

KEYS = Keys("job")


class Injected(RuntimeError):
    """The unexpected error a task dies of."""


class FaultyStore(MemoryStore):
    """A store whose calls raise `Injected` for one task once `broken` names it."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = ""

    async def keep_alive(self, lease: int) -> None:
        if self.broken == "keep-alive":
            raise Injected("heartbeat")
        await super().keep_alive(lease)

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        if self.broken == "reporter" and key.startswith(KEYS.control):
            raise Injected("report")
        return await super().put(key, value, lease=lease)

    async def watch(self, key: str, *, start_revision: int, prefix: bool = False) -> AsyncIterator[WatchEvent]:
        async for event in super().watch(key, start_revision=start_revision, prefix=prefix):
            if (self.broken, key) in (("job watch", KEYS.job), ("leader's watch", KEYS.rdzv)):
                raise Injected("watch")
            yield event


def the_leader(*nodes: ElasticRendezvous) -> ElasticRendezvous:
    return next(n for n in nodes if n._leader_task is not None and not n._leader_task.done())


@pytest.mark.parametrize(
    ("task", "failed"),
    [
        ("keep-alive", "keep-alive"),
        ("job watch", "job watch"),
        ("reporter", "reporter"),
        ("leader", "leader"),
        ("leader's watch", "leader"),  # the leader's own helper task: the leader fails
        ("straggler judge", "leader"),  # the leader's other helper: the step times judged
        ("look outside the round", "leader"),  # and its look at the spares' and waiting nodes' ports
    ],
)
async def test_a_task_that_dies_ends_the_membership_and_the_node_comes_back(
    task: str, failed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FaultyStore()
    s = settings(2, 2, straggler_interval=0.2)
    a, b = make_node(store, "a", s), make_node(store, "b", s)
    first = await asyncio.gather(a.next_round(), b.next_round())
    victim = the_leader(a, b) if failed == "leader" else a

    if task == "leader":
        def decide_round(*args: object, **kw: object) -> object:
            raise Injected("decision")
        monkeypatch.setattr(leader_module, "decide_round", decide_round)
    if task == "straggler judge":
        def judge(*args: object, **kw: object) -> object:
            raise Injected("verdict")
        monkeypatch.setattr(leader_module, "judge", judge)
    if task == "look outside the round":
        def outside(self: object) -> object:
            raise Injected("spares")
        monkeypatch.setattr(leader_module.Leader, "_outside_round", outside)
    store.broken = task
    # Something for every task to act on: a write the watches and the leader see, and
    # an event to publish; the keep-alive runs by itself.
    victim.control.report_event("test", "poke")
    await store.put(KEYS.job + "poke", b"")

    ended = await asyncio.wait_for(victim.round_ended(), 10)
    assert ended.startswith(f"node {victim._me.node_id} lost its membership: its {failed} failed: Injected("), ended
    # What the agent shows while it stops its workers: not the lost round's state.
    assert victim.waiting_status.startswith("registering again (this node lost its membership: "), victim.waiting_status

    # The node registers again and the job goes on at the same size.
    store.broken = ""
    monkeypatch.undo()
    other = b if victim is a else a

    async def after_round_ended(node: ElasticRendezvous) -> object:
        await node.round_ended()  # the victim's loss (or its registering again) ends it
        return await node.next_round()

    again = await asyncio.wait_for(asyncio.gather(victim.next_round(), after_round_ended(other)), 10)
    assert again[0].round == again[1].round > first[0].round
    assert all(x.node_count == 2 and x.restart_count == first[0].restart_count for x in again)
    await asyncio.gather(a.aclose(), b.aclose())
    await store.close()


class _Said(logging.Handler):
    """Sets `said` once the rendezvous logs a line that holds `text`."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text, self.said = text, asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.said.set()


async def test_a_watcher_whose_look_at_the_leader_dies_registers_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # before the first round, the waiting node the leader's state names looks at it
    store = MemoryStore()
    s = settings(3, 3)
    a, b = make_node(store, "a", s), make_node(store, "b", s)
    real_suspect = ElasticRendezvous._suspect_leader

    async def suspect(self: ElasticRendezvous) -> None:
        monkeypatch.setattr(ElasticRendezvous, "_suspect_leader", real_suspect)  # once
        raise Injected("look")

    monkeypatch.setattr(ElasticRendezvous, "_suspect_leader", suspect)
    said = _Said("lost its membership: its leader look failed: Injected(")
    logging.getLogger("elasticrun.rendezvous").addHandler(said)
    try:
        waits = [asyncio.ensure_future(n.next_round()) for n in (a, b)]
        await asyncio.wait_for(said.said.wait(), 10)
    finally:
        logging.getLogger("elasticrun.rendezvous").removeHandler(said)

    # it registers again, and the first round takes it with a third node
    c = make_node(store, "c", s)
    rounds = await asyncio.wait_for(asyncio.gather(*waits, c.next_round()), 10)
    assert {x.round for x in rounds} == {rounds[0].round} and all(x.node_count == 3 for x in rounds)
    await asyncio.gather(a.aclose(), b.aclose(), c.aclose())
    await store.close()


async def test_aclose_lets_the_callers_cancellation_through() -> None:
    store = MemoryStore()
    s = settings(1, 1)
    a = make_node(store, "a", s)
    await a.next_round()
    closing = asyncio.ensure_future(a.aclose())
    await asyncio.sleep(0)  # aclose is inside its gather now
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    await a.aclose()
    await store.close()
