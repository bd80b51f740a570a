"""What only the in-process store promises: its bounds, its history ring, its timer."""

from __future__ import annotations

import asyncio

import pytest

from elasticrun.errors import (
    CompactedError,
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
