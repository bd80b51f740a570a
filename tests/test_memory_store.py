"""What only the in-process store promises: its bounds, its history ring, its timer."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticrun.errors import (
    CompactedError,
    LeaseExpiredError,
    StoreLimitError,
    StoreUnavailableError,
    UsageError,
)
from elasticrun.rendezvous.memory_store import MemoryStore
from elasticrun.rendezvous.store import EventType


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


async def test_lease_ttl_must_be_positive() -> None:
    store = MemoryStore()
    with pytest.raises(UsageError):
        await store.grant_lease(0)
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



async def test_a_due_lease_is_expired_even_before_its_timer_runs() -> None:
    store = MemoryStore()
    lease = await store.grant_lease(0.05)
    await store.put("k", b"", lease=lease)
    time.sleep(0.1)  # block the loop past the deadline: the timer cannot run
    with pytest.raises(LeaseExpiredError):
        await store.keep_alive(lease)
    assert await store.get("k") is None
    await store.close()
