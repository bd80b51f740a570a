"""The elastic rendezvous protocol, several nodes in one event loop over a real store.

These tests drive `ElasticRendezvous` instances the way agents do, without worker
processes: formation, scale-up, graceful leave, lease expiry, restart requests, close
and spec checks. The multi-process agent tests (tests/test_elastic_agents.py) cover
the same protocol end to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import socket
import time

import pytest

from elasticrun.errors import LeaseExpiredError, RendezvousClosedError, RendezvousTimeoutError, SpecMismatchError
from elasticrun.rendezvous.codec import FORMAT_VERSION, decode
from elasticrun.rendezvous.elastic import ElasticRendezvous
from elasticrun.rendezvous.keys import Keys
from elasticrun.rendezvous.ports import PortReservation
from elasticrun.rendezvous.records import JOB_SPEC_VERSION, JobSpec, NodeInfo, QuarantineEntry, QuarantineTable
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.store.interface import Store
from elasticrun.store.server.memory import MemoryStore
from tests.support.helpers import eventually

pytestmark = pytest.mark.timeout(30)


def settings(min_nodes: int, max_nodes: int, **kw: float) -> RendezvousSettings:
    base: dict = dict(last_call=0.2, heartbeat_ttl=1.0, join_timeout=10.0, closed_ttl=1.0)
    base.update(kw)
    return RendezvousSettings(run_id="job", min_nodes=min_nodes, max_nodes=max_nodes, **base)


def make_node(
    store: Store, name: str, s: RendezvousSettings, spec: JobSpec | None = None, **kw: object
) -> ElasticRendezvous:
    me = NodeInfo(node_id=name, host="localhost", addr="127.0.0.1", nproc=2, pid=os.getpid(), started_at=0.0)
    return ElasticRendezvous(store, s, me, spec=spec or JobSpec(command=("train.py",)), **kw)


@pytest.fixture
async def store():
    s = MemoryStore()
    yield s
    await s.close()


async def test_formation_assigns_ranks_and_a_shared_master(store):
    s = settings(2, 3)
    a, b = make_node(store, "a", s), make_node(store, "b", s)
    ra, rb = await asyncio.gather(a.next_round(), b.next_round())
    assert {ra.node_rank, rb.node_rank} == {0, 1}
    assert ra.world_size == rb.world_size == 4
    assert (ra.master_addr, ra.master_port) == (rb.master_addr, rb.master_port)
    assert sorted([ra.rank_offset, rb.rank_offset]) == [0, 2]
    assert ra.round == rb.round == 1 and ra.restart_count == 0
    await asyncio.gather(a.aclose(), b.aclose())


async def test_scale_up_ends_the_round_and_keeps_ranks(store):
    s = settings(1, 3)
    a, b = make_node(store, "a", s), make_node(store, "b", s)
    first = await a.next_round()
    assert first.node_count == 1
    ended = asyncio.ensure_future(a.round_ended())
    rb = asyncio.ensure_future(b.next_round())
    reason = await ended
    assert "scale up" in reason and "b" in reason
    second, rb = await asyncio.gather(a.next_round(), rb)
    assert (second.node_rank, rb.node_rank) == (0, 1)
    assert second.world_size == 4 and second.restart_count == 0
    await asyncio.gather(a.aclose(), b.aclose())


class TrackedReservation(PortReservation):
    """A real port reservation that remembers whether it was released."""

    def __init__(self) -> None:
        super().__init__()
        self.released = False

    def close(self) -> None:
        self.released = True
        super().close()


def port_taken(port: int) -> bool:
    """Whether an ordinary bind of `port` (no SO_REUSEADDR) is refused."""
    try:
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return True
        raise
    return False


async def test_the_master_port_stays_reserved_until_the_next_round_or_leave(store):
    s = settings(1, 3, heartbeat_ttl=30.0)
    reservations: list[TrackedReservation] = []

    def reserve() -> TrackedReservation:
        reservations.append(TrackedReservation())
        return reservations[-1]

    a, b = make_node(store, "a", s, reserve_port=reserve), make_node(store, "b", s)
    first = await a.next_round()
    assert [r.port for r in reservations] == [first.master_port]
    assert port_taken(first.master_port)  # nobody can take it before rank 0's store binds it
    ended = asyncio.ensure_future(a.round_ended())
    rb = asyncio.ensure_future(b.next_round())
    assert "scale up" in await ended
    assert port_taken(first.master_port)  # held until a asks for its next round
    second, _ = await asyncio.gather(a.next_round(), rb)
    assert [r.released for r in reservations] == [True, False]
    assert reservations[1].port == second.master_port and port_taken(second.master_port)
    await a.leave("done")
    assert reservations[1].released and not port_taken(second.master_port)
    await b.aclose()


async def test_graceful_leave_restarts_the_others_at_once(store):
    s = settings(1, 3, heartbeat_ttl=30.0)  # a lease expiry could not explain a quick restart
    a, b, c = (make_node(store, n, s) for n in "abc")
    await asyncio.gather(a.next_round(), b.next_round(), c.next_round())
    ended = asyncio.ensure_future(a.round_ended())
    await b.leave("SIGTERM")
    assert await ended == "round 2: b left"  # not "lost": it said it leaves
    again = await asyncio.gather(a.next_round(), c.next_round())
    assert [x.node_rank for x in again] == [0, 1]
    assert all(x.world_size == 4 for x in again)
    await asyncio.gather(a.aclose(), c.aclose())


async def test_a_node_that_leaves_asking_to_be_kept_out_is_quarantined(store):
    s = settings(1, 2, heartbeat_ttl=30.0)
    keys = Keys("job")
    a, b, c = (make_node(store, n, s) for n in "abc")
    await asyncio.gather(a.next_round(), b.next_round())
    spare = asyncio.ensure_future(c.next_round())  # max 2: c waits as a spare
    await eventually(lambda: c._lease is not None, 10)
    ended = asyncio.ensure_future(a.round_ended())
    sick = "health check failed (exit 1): eth0 is down"
    await b.leave(sick, keep_out=True)
    # the round that lets it go holds it, with its reason; the spare takes its place
    assert await ended == f"round 2: b left; joined: c; quarantined b for 60s ({sick})"
    await asyncio.gather(a.next_round(), spare)

    async def record(key: str) -> bytes:
        kv = await store.get(key)
        assert kv is not None, key
        return kv.value

    async def gone(key: str) -> None:
        async with asyncio.timeout(10):
            while await store.get(key) is not None:
                await asyncio.sleep(0.01)

    table = decode(QuarantineTable, await record(keys.quarantine))
    assert table.get("b").reason == sick and table.get("b").active(time.time())
    assert decode(QuarantineEntry, await record(keys.hold("b"))).reason == sick
    await gone(keys.departure("b"))
    # a node outside the round that leaves so is held too, and its record cleared
    # (kept, it would hold the node again each time its quarantine ended)
    d = make_node(store, "d", s)
    waiting = asyncio.ensure_future(d.next_round())
    await eventually(lambda: d._lease is not None, 10)
    await d.leave("too slow", keep_out=True)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await gone(keys.departure("d"))
    table = decode(QuarantineTable, await record(keys.quarantine))
    assert table.get("d").reason == "too slow" and table.get("d").active(time.time())
    await asyncio.gather(a.aclose(), c.aclose(), d.aclose())


async def test_dead_node_is_dropped_when_its_lease_expires(store):
    s = settings(1, 2)
    a, b = make_node(store, "a", s), make_node(store, "b", s)
    await asyncio.gather(a.next_round(), b.next_round())
    # b dies: its tasks stop and nobody revokes its lease.
    b._lost = "killed"
    await b.aclose()
    assert "lost b" in await a.round_ended()
    survivor = await a.next_round()
    assert survivor.node_count == 1
    await a.aclose()


async def test_fixed_size_job_waits_for_a_replacement(store):
    s = settings(2, 2, heartbeat_ttl=30.0)
    a, b = make_node(store, "a", s), make_node(store, "b", s)
    await asyncio.gather(a.next_round(), b.next_round())
    await b.leave("preempted")
    assert "b left" in await a.round_ended()  # not "lost": it said it leaves
    waiting = asyncio.ensure_future(a.next_round())
    done, _ = await asyncio.wait({waiting}, timeout=0.5)
    assert not done, "a fixed-size job must not run below its size"
    x = make_node(store, "x", s)
    rx, ra = await asyncio.gather(x.next_round(), waiting)
    assert (ra.node_rank, rx.node_rank) == (0, 1)
    await asyncio.gather(a.aclose(), x.aclose())


async def test_restart_request_counts_and_keeps_members(store):
    s = settings(2, 2)
    a, b = make_node(store, "a", s), make_node(store, "b", s)
    await asyncio.gather(a.next_round(), b.next_round())
    ended = asyncio.ensure_future(a.round_ended())
    await b.request_restart("exit code 1")
    assert "worker failure on b" in await ended
    ra, rb = await asyncio.gather(a.next_round(), b.next_round())
    assert ra.restart_count == rb.restart_count == 1
    assert ra.round == 2
    await asyncio.gather(a.aclose(), b.aclose())


async def test_failure_closes_the_job_for_everyone_with_the_report(store):
    s = settings(2, 2)
    a, b = make_node(store, "a", s), make_node(store, "b", s)
    await asyncio.gather(a.next_round(), b.next_round())
    ended = asyncio.ensure_future(a.round_ended())
    await b.fail("rank 3 exited with code 1")
    with pytest.raises(RendezvousClosedError, match="rank 3 exited with code 1"):
        await ended  # the round ends with the job: no round follows
    with pytest.raises(RendezvousClosedError, match="rank 3 exited with code 1") as info:
        await a.next_round()
    assert info.value.outcome == "failed"
    await a.aclose()


async def test_success_closes_then_late_nodes_exit_and_the_id_is_reused(store):
    s = settings(1, 2, closed_ttl=0.5)
    a = make_node(store, "a", s)
    await a.next_round()
    await a.finish()
    late = make_node(store, "late", s)
    with pytest.raises(RendezvousClosedError) as info:
        await late.next_round()
    assert info.value.outcome == "succeeded"
    # The close marker expires; a new job with the same id then starts clean.
    fresh = make_node(store, "fresh", s, spec=JobSpec(command=("other.py",)))
    while True:
        try:
            assignment = await fresh.next_round()
            break
        except RendezvousClosedError:
            await store_change(store)
    assert assignment.round == 1 and assignment.restart_count == 0
    await fresh.aclose()


async def store_change(store: Store) -> None:
    """Wait for the next write to the store (here: the close marker's expiry)."""
    rng = await store.get_prefix("/elasticrun/")
    async for _ in store.watch("/elasticrun/", start_revision=rng.revision + 1, prefix=True):
        return


async def test_other_spec_is_refused_clearly(store):
    s = settings(1, 2)
    a = make_node(store, "a", s, spec=JobSpec(command=("train.py",), nproc_per_node="2"))
    await a.next_round()
    b = make_node(store, "b", s, spec=JobSpec(command=("train.py",), nproc_per_node="4"))
    with pytest.raises(SpecMismatchError, match="nproc_per_node: job has '2', this node '4'"):
        await b.next_round()
    await a.aclose()


async def test_a_spec_of_another_version_is_refused_before_its_fields_are_read(store):
    s = settings(1, 2)
    newer = {"v": FORMAT_VERSION, "version": JOB_SPEC_VERSION + 1, "command": ["train.py"], "what_v2_adds": 1}
    await store.put(Keys("job").spec, json.dumps(newer).encode())
    a = make_node(store, "a", s)
    with pytest.raises(SpecMismatchError, match=f"spec has version {JOB_SPEC_VERSION + 1}, this node's"):
        await a.next_round()
    await a.aclose()


async def test_join_timeout_says_what_was_missing(store):
    s = settings(3, 3, join_timeout=0.5)
    a = make_node(store, "a", s)
    with pytest.raises(RendezvousTimeoutError, match="1 of min 3 registered"):
        await a.next_round()
    await a.aclose()


async def test_two_jobs_share_one_store(store):
    s1 = RendezvousSettings(run_id="one", min_nodes=1, max_nodes=1, last_call=0.1)
    s2 = RendezvousSettings(run_id="two", min_nodes=1, max_nodes=1, last_call=0.1)
    a, b = make_node(store, "a", s1), make_node(store, "b", s2)
    ra, rb = await asyncio.gather(a.next_round(), b.next_round())
    assert ra.node_count == rb.node_count == 1 and ra.node_rank == rb.node_rank == 0
    await asyncio.gather(a.aclose(), b.aclose())


async def test_leader_loss_hands_over(store):
    s = settings(1, 3, heartbeat_ttl=30.0)
    a, b = make_node(store, "a", s), make_node(store, "b", s)
    await asyncio.gather(a.next_round(), b.next_round())
    leader, other = (a, b) if a._leader_task else (b, a)
    await leader.leave("bye")
    await other.round_ended()
    solo = await other.next_round()
    assert solo.node_count == 1
    c = make_node(store, "c", s)
    ended = asyncio.ensure_future(other.round_ended())
    rc = asyncio.ensure_future(c.next_round())
    assert "scale up" in await ended
    again, rc = await asyncio.gather(other.next_round(), rc)
    assert (again.node_rank, rc.node_rank) == (0, 1)
    await asyncio.gather(other.aclose(), c.aclose())


class LateRepliesStore(MemoryStore):
    """A store whose keep-alive replies are held back while `late` is set: the renewals
    land (the store keeps every lease), but the nodes cannot know, so each gives its
    membership up after a TTL and registers again, its old key still in place."""

    def __init__(self) -> None:
        super().__init__()
        self.late = False
        self.released = asyncio.Event()

    async def keep_alive(self, lease: int) -> None:
        await super().keep_alive(lease)
        if self.late:
            await self.released.wait()


async def test_members_that_register_again_get_a_new_round_though_their_keys_stayed():
    store = LateRepliesStore()
    s = settings(2, 2)
    a, b = make_node(store, "a", s), make_node(store, "b", s)
    first = await asyncio.gather(a.next_round(), b.next_round())
    store.late = True
    ended = await asyncio.gather(a.round_ended(), b.round_ended())
    assert all("lost its membership" in e for e in ended), ended
    store.late = False
    store.released.set()
    again = await asyncio.gather(a.next_round(), b.next_round())
    assert {x.round for x in again} == {first[0].round + 1}
    assert all(x.restart_count == 0 and x.node_count == 2 for x in again)
    await asyncio.gather(a.aclose(), b.aclose())
    await store.close()


class SlowAnswersStore(MemoryStore):
    """A store that renews a lease when the renewal arrives and answers `delay` seconds
    later, as a busy store, or a busy client's loop, does."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.answered = 0
        self._answer = asyncio.Condition()

    async def keep_alive(self, lease: int) -> None:
        await super().keep_alive(lease)
        await asyncio.sleep(self.delay)
        async with self._answer:
            self.answered += 1
            self._answer.notify_all()

    async def answers(self, count: int) -> None:
        async with self._answer:
            await self._answer.wait_for(lambda: self.answered >= count)


async def test_renewals_answered_late_keep_the_membership_while_each_lands_in_time():
    """TTL 2 s, a renewal every 0.67 s, each answered 0.8 s after the store renewed the
    lease: every renewal lands within the TTL of the one before, so the node stays. It
    lost its place when the next renewal waited an interval after the last one's answer
    (sent 1.47 s after the last, answered 0.8 s later: past the TTL)."""
    store = SlowAnswersStore(0.8)
    a = make_node(store, "a", settings(1, 2, heartbeat_ttl=2.0))
    await a.next_round()
    ended = asyncio.ensure_future(a.round_ended())
    renewed = asyncio.ensure_future(store.answers(4))
    await asyncio.wait({ended, renewed}, return_when=asyncio.FIRST_COMPLETED)
    assert renewed.done() and not ended.done(), ended.result() if ended.done() else None
    ended.cancel()
    await a.aclose()
    await store.close()


async def test_a_member_silent_to_the_ping_is_dropped_and_its_registration_ended(store):
    # etcd may expire a dead node's lease late: here the lease is kept alive on purpose.
    s = settings(2, 3, heartbeat_ttl=1.0)
    a, b, c = (make_node(store, n, s) for n in "abc")
    await asyncio.gather(a.next_round(), b.next_round(), c.next_round())
    key = Keys("job").node("c")
    lease = (await store.get(key)).lease
    c._lost = "killed"  # c dies: its tasks stop and nobody revokes its lease
    await c.aclose()

    async def zombie() -> None:
        with contextlib.suppress(LeaseExpiredError):
            while True:
                await store.keep_alive(lease)
                await asyncio.sleep(0.2)

    kept = asyncio.ensure_future(zombie())
    ended = asyncio.ensure_future(a.round_ended())
    await b.request_restart("collective failed")  # c's death broke b's collectives
    assert "lost c" in await ended
    again = await asyncio.gather(a.next_round(), b.next_round())
    assert all(x.node_count == 2 and x.restart_count == 0 for x in again)
    await asyncio.wait_for(kept, 5.0)  # the leader revoked c's lease: the renewals fail
    assert await store.get(key) is None
    await asyncio.gather(a.aclose(), b.aclose())
