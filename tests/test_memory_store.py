"""What only the in-process store promises: its bounds, its history ring, its timer."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticrun.errors import (
    CompactedError,
    LeaseExpiredError,
    StoreLimitError,
    StoreRequestError,
    StoreUnavailableError,
)
from elasticrun.store.credentials import worker_prefix
from elasticrun.store.interface import MAX_LEASE_TTL, EventType, WatchEvent
from elasticrun.store.server import memory as memory_store
from elasticrun.store.server.memory import MemoryStore, SpaceQuota

#: Bounds every wait on the store in these tests; far above any healthy latency.
EVENT_WAIT = 10.0
#: A long history: enough writes that reading them one by one took seconds.
LONG_HISTORY = 300_000


async def test_key_and_value_bounds() -> None:
    store = MemoryStore(max_key_bytes=16, max_value_bytes=100)
    await store.put("k" * 16, b"v" * 100)
    with pytest.raises(StoreLimitError, match="max_key_bytes"):
        await store.put("k" * 17, b"")
    with pytest.raises(StoreLimitError, match="max_key_bytes"):
        await store.put("é" * 9, b"")  # 18 bytes in UTF-8
    with pytest.raises(StoreLimitError, match="max_value_bytes"):
        await store.put("k", b"v" * 101)
    with pytest.raises(StoreLimitError, match="max_value_bytes"):
        await store.compare_and_put("k", b"v" * 101, expected_mod_revision=0)
    assert store.revision == 1  # refused writes leave no trace
    await store.close()


async def test_key_count_bound_counts_only_new_keys() -> None:
    store = MemoryStore(max_keys=3)
    for key in "abc":
        await store.put(key, b"")
    await store.put("a", b"overwrite is fine")
    with pytest.raises(StoreLimitError, match="max_keys"):
        await store.put("d", b"")
    await store.delete("a")
    await store.put("d", b"")
    assert len(store) == 3
    await store.close()


async def test_history_ring_is_bounded_and_keeps_recent_revisions() -> None:
    store = MemoryStore(history_bytes=10_000)
    for i in range(200):
        await store.put("k", b"x" * 100 + str(i).encode())
    with pytest.raises(CompactedError) as info:
        await anext(store.watch("k", start_revision=1))
    oldest = info.value.oldest
    assert 1 < oldest <= store.revision
    watch = store.watch("k", start_revision=oldest)
    event = await anext(watch)
    assert event.revision == oldest
    await watch.aclose()
    await store.close()


async def test_idle_watch_survives_unrelated_traffic_past_the_ring() -> None:
    store = MemoryStore(history_bytes=10_000)
    watch = store.watch("quiet", start_revision=1)
    pending = asyncio.ensure_future(anext(watch))
    await asyncio.sleep(0)  # let the watch go to sleep on its key
    for i in range(200):
        await store.put("busy", b"x" * 100 + str(i).encode())
    rev = await store.put("quiet", b"news")
    async with asyncio.timeout(10):
        event = await pending
    assert (event.value, event.revision) == (b"news", rev)
    await watch.aclose()
    await store.close()


async def fill(store: MemoryStore, writes: int, every_tenth: str = "other") -> None:
    """`writes` puts of empty values: one in ten to `every_tenth`/<i % 100>, the rest to
    other/<i % 1000>."""
    for i in range(writes):
        await store.put(f"{every_tenth}/{i % 100}" if i % 10 == 0 else f"other/{i % 1000}", b"")


async def test_a_watch_from_revision_1_on_a_long_history_lets_the_loop_run() -> None:
    """A watch from revision 1 read every revision kept without suspending:
    after 300,000 writes one such 22-byte request held the loop for seconds (leases
    expired meanwhile)."""
    store = MemoryStore()
    await fill(store, LONG_HISTORY)
    rev = await store.put("quiet", b"news")
    loop_ran: list[bool] = []
    async with contextlib.aclosing(store.watch("quiet", start_revision=1)) as watch:
        asyncio.get_running_loop().call_soon(loop_ran.append, True)
        async with asyncio.timeout(EVENT_WAIT):
            event = await anext(watch)
    assert (event.value, event.revision) == (b"news", rev)
    assert loop_ran, "the watch held the loop until it had read the whole history"
    await store.close()


async def test_catching_up_reads_only_the_batches_that_may_hold_its_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Letting the loop run is not enough: each catch-up must also cost little, or a few
    such requests still take the server's CPU. Full segments of the history are indexed
    by key, so only the newest (filling) segment and the watcher's own batches are read."""
    store = MemoryStore()
    await fill(store, LONG_HISTORY, every_tenth="job")
    await store.put("quiet", b"news")
    reads: list[int] = []
    events_in = memory_store._Watcher.events_in

    def counted(watcher: memory_store._Watcher, batch: tuple[WatchEvent, ...]) -> list[WatchEvent]:
        reads.append(batch[0].revision)
        return events_in(watcher, batch)

    monkeypatch.setattr(memory_store._Watcher, "events_in", counted)
    for key, prefix, own in (
        ("quiet", False, 1),
        ("quiet", True, 1),
        ("job/70", False, LONG_HISTORY // 100),
        ("job/", True, LONG_HISTORY // 10),
    ):
        reads.clear()
        async with contextlib.aclosing(store.watch(key, start_revision=1, prefix=prefix)) as watch:
            async with asyncio.timeout(EVENT_WAIT):
                for _ in range(own):
                    await anext(watch)
        assert own <= len(reads) <= own + memory_store._SEGMENT_REVISIONS, (key, prefix)
    await store.close()


async def test_catching_up_through_many_events_of_its_own_lets_the_loop_run() -> None:
    """An index does not shorten a catch-up through 10,000 events the watcher wants (a
    reader in this process takes them without suspending): it must be cut in turns."""
    store = MemoryStore()
    await fill(store, 100_000, every_tenth="job")
    seen = 0
    seen_when_the_loop_ran: list[int] = []
    async with contextlib.aclosing(store.watch("job/", start_revision=1, prefix=True)) as watch:
        asyncio.get_running_loop().call_soon(lambda: seen_when_the_loop_ran.append(seen))
        async with asyncio.timeout(EVENT_WAIT):
            async for _ in watch:
                seen += 1
                if seen == 10_000:
                    break
    assert seen_when_the_loop_ran and seen_when_the_loop_ran[0] < 10_000
    await store.close()


async def test_a_catch_up_that_falls_behind_the_ring_while_it_lets_the_loop_run_is_compacted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between two turns the ring may move past the watch's cursor, as etcd compacts."""
    monkeypatch.setattr(memory_store, "_WORK_PER_TURN", 8)
    store = MemoryStore(history_bytes=100 * (memory_store._EVENT_OVERHEAD_BYTES + 8))
    await fill(store, 50)
    await store.put("k", b"")
    watch = store.watch("k", start_revision=1)
    pending = asyncio.ensure_future(anext(watch))
    await asyncio.sleep(0)  # the watch reads its first turn's worth, then lets us run
    assert not pending.done()
    for i in range(200):
        await store.put("other/0", str(i).encode())
    with pytest.raises(CompactedError) as info:
        async with asyncio.timeout(EVENT_WAIT):
            await pending
    assert info.value.requested < info.value.oldest
    await watch.aclose()
    await store.close()


async def test_many_leases_expire_on_one_timer() -> None:
    store = MemoryStore()
    leases = [await store.grant_lease(0.05 + i * 0.01) for i in range(20)]
    for i, lease in enumerate(leases):
        await store.put(f"n/{i}", b"", lease=lease)
    watch = store.watch("n/", start_revision=store.revision + 1, prefix=True)
    async with asyncio.timeout(10):
        deleted = [(await anext(watch)).key for _ in range(20)]
    assert deleted == [f"n/{i}" for i in range(20)]  # in deadline order
    assert len(store) == 0
    await watch.aclose()
    await store.close()


async def test_frequent_keep_alives_keep_the_timer_heap_small() -> None:
    store = MemoryStore()
    lease = await store.grant_lease(60)
    for _ in range(1000):
        await store.keep_alive(lease)
    assert len(store._expiry_heap) <= 2 * 1 + 64 + 1
    await store.close()


async def test_close_ends_open_watches() -> None:
    store = MemoryStore()
    watch = store.watch("k", start_revision=1)
    pending = asyncio.ensure_future(anext(watch))
    await store.put("k", b"1")
    assert (await pending).type is EventType.PUT
    pending = asyncio.ensure_future(anext(watch))
    await store.close()
    with pytest.raises(StoreUnavailableError):
        async with asyncio.timeout(10):
            await pending
    with pytest.raises(StoreUnavailableError):
        await store.get("k")


async def test_lease_ttl_must_be_positive_and_at_most_etcds_limit() -> None:
    store = MemoryStore()
    for ttl in (0, -1, math.nan, math.inf, 1e300, MAX_LEASE_TTL + 1):
        with pytest.raises(StoreRequestError):
            await store.grant_lease(ttl)
    await store.grant_lease(MAX_LEASE_TTL)
    await store.close()


async def test_put_all_is_all_or_nothing() -> None:
    store = MemoryStore(max_total_bytes=100)
    await store.put("a", b"x" * 40)
    revision = store.revision
    with pytest.raises(StoreLimitError, match="max_total_bytes"):
        await store.put_all([("b", b"y" * 30), ("c", b"z" * 30)])
    with pytest.raises(StoreRequestError, match="empty"):
        await store.put_all([("b", b""), ("", b"")])
    assert store.revision == revision and len(store) == 1
    # the total after the batch is what counts: "a" shrinks as "b" grows
    await store.put_all([("b", b"y" * 50), ("a", b"")])
    assert [kv.value for kv in (await store.get_prefix("")).kvs] == [b"", b"y" * 50]
    await store.close()


_KEYS = st.sampled_from(["a", "a/1", "a/2", "b", "b/1"])
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), _KEYS, st.binary(max_size=4)),
        st.tuples(st.just("delete"), _KEYS),
        st.tuples(st.just("delete_prefix"), st.sampled_from(["", "a", "a/", "b"])),
        st.tuples(st.just("create"), _KEYS, st.binary(max_size=4)),
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(ops=_OPS)
def test_model_and_history_replay(ops: list[tuple]) -> None:  # type: ignore[type-arg]
    """Against a dict model: every write bumps the revision once, and replaying the
    watch history from revision 1 rebuilds exactly the final state."""

    async def run() -> None:
        store = MemoryStore()
        model: dict[str, bytes] = {}
        watch = store.watch("", start_revision=1, prefix=True)
        for op, *args in ops:
            before = store.revision
            if op == "put":
                key, value = args
                assert await store.put(key, value) == before + 1
                model[key] = value
            elif op == "create":
                key, value = args
                created = await store.compare_and_put(key, value, expected_mod_revision=0)
                assert created == (key not in model)
                model.setdefault(key, value)
            elif op == "delete":
                (key,) = args
                assert await store.delete(key) == (key in model)
                model.pop(key, None)
            else:
                (prefix,) = args
                doomed = [k for k in model if k.startswith(prefix)]
                assert await store.delete_prefix(prefix) == len(doomed)
                for k in doomed:
                    del model[k]
            changed = store.revision - before
            assert changed in (0, 1)
        snapshot = await store.get_prefix("")
        assert {kv.key: kv.value for kv in snapshot.kvs} == model
        assert [kv.key for kv in snapshot.kvs] == sorted(model)
        replayed: dict[str, bytes] = {}
        revisions: list[int] = []
        await store.put("~end", b"")  # marks the end of the history to replay
        async with asyncio.timeout(10):
            async for event in watch:
                if event.key == "~end":
                    break
                if event.type is EventType.PUT:
                    replayed[event.key] = event.value
                else:
                    del replayed[event.key]
                revisions.append(event.revision)
        await watch.aclose()
        assert replayed == model
        assert revisions == sorted(revisions)
        await store.close()

    asyncio.run(run())


_WATCHED = [("a", False), ("a/1", False), ("b", False), ("", True), ("a", True), ("a/", True)]


@settings(max_examples=40, deadline=None)
@given(ops=_OPS, history_bytes=st.sampled_from([1 << 20, 1200]))
def test_watches_from_every_revision_match_the_model(
    ops: list[tuple], history_bytes: int  # type: ignore[type-arg]
) -> None:
    """With segments of 4 revisions and turns of 3 units, so that catching up crosses
    indexed segments, the filling one, evicted batches and suspensions: a watch from any
    revision gets exactly the model's events on its keys since then, or CompactedError
    when that revision is older than the oldest kept."""

    async def run() -> None:
        store = MemoryStore(history_bytes=history_bytes)
        model: dict[str, bytes] = {}
        events: list[WatchEvent] = []

        def record(kind: EventType, keys: list[str], value: bytes = b"") -> None:
            events.extend(WatchEvent(kind, k, value, store.revision) for k in sorted(keys))

        last_puts = [("put", key, b"end") for key in ("a", "a/1", "a/2", "b", "b/1")]
        for op, *args in [*ops, *last_puts]:  # the last puts end every watch's events
            if op == "put" or (op == "create" and args[0] not in model):
                await store.put(args[0], args[1])
                model[args[0]] = args[1]
                record(EventType.PUT, [args[0]], args[1])
            elif op == "delete" and args[0] in model:
                await store.delete(args[0])
                del model[args[0]]
                record(EventType.DELETE, [args[0]])
            elif op == "delete_prefix":
                doomed = [k for k in model if k.startswith(args[0])]
                await store.delete_prefix(args[0])
                for k in doomed:
                    del model[k]
                record(EventType.DELETE, doomed)
        assert events[-1].revision == store.revision
        try:
            async with contextlib.aclosing(store.watch("", start_revision=1, prefix=True)) as all_:
                await anext(all_)
            oldest = 1
        except CompactedError as e:
            oldest = e.oldest
        assert oldest == 1 or history_bytes < 1 << 20
        for key, prefix in _WATCHED:
            for start in range(1, store.revision + 1):
                mine = [
                    e for e in events
                    if e.revision >= start and (e.key.startswith(key) if prefix else e.key == key)
                ]
                watch = store.watch(key, start_revision=start, prefix=prefix)
                async with contextlib.aclosing(watch), asyncio.timeout(EVENT_WAIT):
                    if start < oldest:
                        with pytest.raises(CompactedError):
                            await anext(watch)
                    else:
                        assert [await anext(watch) for _ in mine] == mine, (key, prefix, start)
        await store.close()

    with mock.patch.object(memory_store, "_SEGMENT_REVISIONS", 4), mock.patch.object(
        memory_store, "_WORK_PER_TURN", 3
    ):
        asyncio.run(run())


async def test_a_due_lease_is_expired_even_before_its_timer_runs() -> None:
    store = MemoryStore()
    lease = await store.grant_lease(0.05)
    await store.put("k", b"", lease=lease)
    time.sleep(0.1)  # block the loop past the deadline: the timer cannot run
    with pytest.raises(LeaseExpiredError):
        await store.keep_alive(lease)
    assert await store.get("k") is None
    await store.close()


async def test_worker_namespaces_are_counted_as_they_change() -> None:
    """Keys under a job's worker namespace count for its quota until they are gone,
    however they go (delete, a prefix delete, a lease)."""
    store = MemoryStore()
    quota = SpaceQuota(keys=2, bytes=100, all_keys=3, all_bytes=1_000)
    a, b = worker_prefix("a"), worker_prefix("b")
    await store.put(a + "1", b"x" * 10, quota=quota)
    await store.put(a + "1", b"x" * 40, quota=quota)  # an overwrite: still one key, 40 bytes more
    await store.put_all([(a + "2", b"y")], quota=quota)
    assert store.worker_keys("a") == 2
    with pytest.raises(StoreLimitError, match="its fair share"):
        await store.put(a + "3", b"", quota=quota)
    with pytest.raises(StoreLimitError, match="its fair share"):  # bytes: 10 + 40 + len(key) > 100
        await store.put(a + "1", b"x" * 100, quota=quota)
    await store.put(b + "1", b"", quota=quota)
    with pytest.raises(StoreLimitError, match="kept for the agents"):  # 3 worker keys in all
        await store.put(b + "2", b"", quota=quota)
    await store.put("/elasticrun/a/r/nodes/n", b"", quota=quota)  # outside every namespace: no quota
    assert await store.delete_prefix(a) == 2 and store.worker_keys("a") == 0
    lease = await store.grant_lease(60)
    await store.put(a + "1", b"z", lease=lease, quota=quota)
    await store.revoke_lease(lease)
    assert store.worker_keys("a") == 0 and store.worker_keys("b") == 1
    await store.put_all([(b + "2", b""), (a + "1", b"")], quota=quota)  # room again, for both
    await store.close()
