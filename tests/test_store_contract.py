"""The one contract every Store implementation keeps (memory, gRPC, etcd).

Each test runs once per implementation through the parametrised `store` fixture. A new
backend joins by adding its id to `STORE_KINDS` and a branch to `store` (and to
`compact_history`, which makes early history unavailable the backend's way).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from elasticrun.errors import CompactedError, LeaseExpiredError, StoreError
from elasticrun.store.client.grpc_store import GrpcStore
from elasticrun.store.etcd.backend import EtcdStore
from elasticrun.store.interface import EventType, Store
from elasticrun.store.server.memory import MemoryStore
from elasticrun.store.server.store_server import StoreServer
from tests.support.helpers import next_events

STORE_KINDS = ["memory", "grpc", pytest.param("etcd", marks=pytest.mark.etcd)]
#: Small enough that a test outruns it with a few dozen writes.
HISTORY_BYTES = 16 * 1024
#: Bounds every wait on the store in these tests; far above any healthy latency.
EVENT_WAIT = 10.0


@pytest.fixture(params=STORE_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
async def store(store_kind: str, request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if store_kind == "memory":
        s = MemoryStore(history_bytes=HISTORY_BYTES)
        yield s
        await s.close()
    elif store_kind == "grpc":
        server = StoreServer("127.0.0.1", 0, engine=MemoryStore(history_bytes=HISTORY_BYTES))
        await server.start()
        client = GrpcStore(server.endpoint)
        yield client
        await client.close()
        await server.stop()
        await server.engine.close()
    elif store_kind == "etcd":
        cluster = request.getfixturevalue("etcd_server")
        client = EtcdStore(cluster.endpoints)
        await client.delete_prefix("")  # the server is shared by the whole session
        yield client
        await client.close()


@pytest.fixture
def compact_history(
    store_kind: str, request: pytest.FixtureRequest
) -> Callable[[Store], Awaitable[None]]:
    """An action that makes revision 1 unavailable to watchers of `store`."""
    if store_kind == "etcd":
        cluster = request.getfixturevalue("etcd_server")

        async def compact(store: Store) -> None:
            await asyncio.to_thread(cluster.compact)

        return compact

    async def outrun_ring(store: Store) -> None:
        for i in range(2 * HISTORY_BYTES // 1024):
            await store.put("filler", b"x" * 1024 + str(i).encode())

    return outrun_ring


# --- reads and writes ------------------------------------------------------------


async def test_put_get_revisions(store: Store) -> None:
    assert await store.get("a") is None
    r1 = await store.put("a", b"1")
    kv = await store.get("a")
    assert kv is not None
    assert (kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease) == (
        b"1", r1, r1, 1, 0
    )
    r2 = await store.put("a", b"2")
    assert r2 > r1
    kv = await store.get("a")
    assert kv is not None
    assert (kv.value, kv.create_revision, kv.mod_revision, kv.version) == (b"2", r1, r2, 2)


async def test_get_prefix_sorted_with_revision(store: Store) -> None:
    await store.put("p/b", b"b")
    await store.put("p/a", b"a")
    await store.put("q/a", b"x")
    last = await store.put("p/c", b"c")
    result = await store.get_prefix("p/")
    assert [(kv.key, kv.value) for kv in result.kvs] == [
        ("p/a", b"a"), ("p/b", b"b"), ("p/c", b"c")
    ]
    assert result.revision == last
    assert (await store.get_prefix("nothing/")).kvs == ()


async def test_compare_and_put(store: Store) -> None:
    assert await store.compare_and_put("k", b"1", expected_mod_revision=0)
    assert not await store.compare_and_put("k", b"2", expected_mod_revision=0)
    kv = await store.get("k")
    assert kv is not None
    assert not await store.compare_and_put("k", b"2", expected_mod_revision=kv.mod_revision + 1)
    assert await store.compare_and_put("k", b"3", expected_mod_revision=kv.mod_revision)
    kv2 = await store.get("k")
    assert kv2 is not None and kv2.value == b"3" and kv2.version == 2


async def test_delete_and_compare_and_delete(store: Store) -> None:
    await store.put("k", b"v")
    assert await store.delete("k")
    assert not await store.delete("k")
    assert await store.get("k") is None
    rev = await store.put("k", b"v")
    assert not await store.compare_and_delete("k", expected_mod_revision=rev + 1)
    assert await store.get("k") is not None
    assert await store.compare_and_delete("k", expected_mod_revision=rev)
    assert await store.get("k") is None
    assert not await store.compare_and_delete("k", expected_mod_revision=rev)


async def test_delete_prefix_is_one_revision(store: Store) -> None:
    for key in ("d/1", "d/2", "d/3", "e/1"):
        await store.put(key, b"v")
    start = (await store.get_prefix("")).revision + 1
    watch = store.watch("d/", start_revision=start, prefix=True)
    assert await store.delete_prefix("d/") == 3
    assert await store.delete_prefix("d/") == 0
    assert [kv.key for kv in (await store.get_prefix("")).kvs] == ["e/1"]
    events = await next_events(watch, 3)
    assert {e.key for e in events} == {"d/1", "d/2", "d/3"}
    assert {e.type for e in events} == {EventType.DELETE}
    assert len({e.revision for e in events}) == 1
    await watch.aclose()


async def test_empty_key_is_refused_whatever_the_compare(store: Store) -> None:
    rev = await store.put("k", b"v")
    for expected in (0, rev):  # a compare that fails must not hide the refusal
        with pytest.raises(StoreError):
            await store.compare_and_put("", b"x", expected_mod_revision=expected)
        with pytest.raises(StoreError):
            await store.compare_and_delete("", expected_mod_revision=expected)
    assert (await store.get_prefix("")).revision == rev


# --- concurrency ------------------------------------------------------------------


async def test_cas_race_counter(store: Store) -> None:
    tasks, rounds = 8, 10

    async def increment() -> None:
        for _ in range(rounds):
            while True:
                kv = await store.get("counter")
                value = int(kv.value) if kv else 0
                expected = kv.mod_revision if kv else 0
                if await store.compare_and_put(
                    "counter", str(value + 1).encode(), expected_mod_revision=expected
                ):
                    break

    await asyncio.gather(*(increment() for _ in range(tasks)))
    kv = await store.get("counter")
    assert kv is not None and int(kv.value) == tasks * rounds


async def test_cas_create_race_has_one_winner(store: Store) -> None:
    results = await asyncio.gather(
        *(store.compare_and_put("leader", str(i).encode(), expected_mod_revision=0)
          for i in range(10))
    )
    assert results.count(True) == 1
    kv = await store.get("leader")
    assert kv is not None and kv.value == str(results.index(True)).encode()


# --- watch ------------------------------------------------------------------------


async def test_read_then_watch_has_no_gap(store: Store) -> None:
    await store.put("w/0", b"0")
    snapshot = await store.get_prefix("w/")
    writes = asyncio.gather(*(store.put(f"w/{i}", str(i).encode()) for i in range(1, 21)))
    watch = store.watch("w/", start_revision=snapshot.revision + 1, prefix=True)
    events = await next_events(watch, 20)
    await writes
    assert sorted(e.key for e in events) == sorted(f"w/{i}" for i in range(1, 21))
    assert [e.revision for e in events] == sorted(e.revision for e in events)
    assert events[0].revision == snapshot.revision + 1
    await watch.aclose()


async def test_watch_key_ordering_and_filter(store: Store) -> None:
    start = await store.put("other", b"")
    watch = store.watch("k", start_revision=start + 1)
    for i in range(5):
        await store.put("k", str(i).encode())
        await store.put("k2", b"not me")  # a key with `k` as a prefix must not match
    await store.delete("k")
    events = await next_events(watch, 6)
    assert [(e.type, e.key, e.value) for e in events] == [
        *((EventType.PUT, "k", str(i).encode()) for i in range(5)),
        (EventType.DELETE, "k", b""),
    ]
    revisions = [e.revision for e in events]
    assert revisions == sorted(set(revisions))
    await watch.aclose()


async def test_watch_replays_history_from_a_revision(store: Store) -> None:
    first = await store.put("h", b"1")
    await store.put("h", b"2")
    await store.put("h", b"3")
    watch = store.watch("h", start_revision=first + 1)
    events = await next_events(watch, 2)
    assert [e.value for e in events] == [b"2", b"3"]
    await store.put("h", b"4")
    assert [e.value for e in await next_events(watch, 1)] == [b"4"]
    await watch.aclose()


async def test_many_watchers_see_the_same_change(store: Store) -> None:
    start = await store.put("round", b"0")
    watches = [store.watch("round", start_revision=start + 1) for _ in range(10)]
    prefix_watches = [store.watch("ro", start_revision=start + 1, prefix=True) for _ in range(5)]
    rev = await store.put("round", b"1")
    for watch in [*watches, *prefix_watches]:
        (event,) = await next_events(watch, 1)
        assert (event.value, event.revision) == (b"1", rev)
        await watch.aclose()


async def test_watch_from_compacted_revision_raises(
    store: Store, compact_history: Callable[[Store], Awaitable[None]]
) -> None:
    await store.put("c", b"1")
    await compact_history(store)
    watch = store.watch("c", start_revision=1)
    with pytest.raises(CompactedError):
        await next_events(watch, 1)


# --- leases -----------------------------------------------------------------------


async def test_lease_expiry_deletes_keys_and_notifies_watchers(store: Store) -> None:
    lease = await store.grant_lease(1.0)
    await store.put("node/a", b"alive", lease=lease)
    rev = await store.put("node/b", b"no lease")
    kv = await store.get("node/a")
    assert kv is not None and kv.lease == lease
    watch = store.watch("node/", start_revision=rev + 1, prefix=True)
    (event,) = await next_events(watch, 1)
    assert (event.type, event.key) == (EventType.DELETE, "node/a")
    assert await store.get("node/a") is None
    assert await store.get("node/b") is not None
    with pytest.raises(LeaseExpiredError):
        await store.keep_alive(lease)
    await watch.aclose()


async def test_keep_alive_holds_the_lease(store: Store) -> None:
    lease = await store.grant_lease(1.5)
    await store.put("held", b"v", lease=lease)
    loop = asyncio.get_running_loop()
    end = loop.time() + 3.0  # twice the TTL
    while loop.time() < end:
        await store.keep_alive(lease)
        await asyncio.sleep(0.1)  # the keep-alive pace is what is under test
    assert await store.get("held") is not None
    await store.revoke_lease(lease)


async def test_revoke_deletes_keys_at_once(store: Store) -> None:
    lease = await store.grant_lease(60)
    await store.put("r/1", b"", lease=lease)
    rev = await store.put("r/2", b"", lease=lease)
    watch = store.watch("r/", start_revision=rev + 1, prefix=True)
    await store.revoke_lease(lease)
    events = await next_events(watch, 2)
    assert {(e.type, e.key) for e in events} == {
        (EventType.DELETE, "r/1"), (EventType.DELETE, "r/2")
    }
    assert (await store.get_prefix("r/")).kvs == ()
    await store.revoke_lease(lease)  # already gone: not an error
    with pytest.raises(LeaseExpiredError):
        await store.keep_alive(lease)
    with pytest.raises(LeaseExpiredError):
        await store.put("r/3", b"", lease=lease)
    await watch.aclose()


async def test_rebinding_a_key_detaches_it_from_its_old_lease(store: Store) -> None:
    lease = await store.grant_lease(60)
    await store.put("moved", b"1", lease=lease)
    await store.put("moved", b"2")
    await store.revoke_lease(lease)
    kv = await store.get("moved")
    assert kv is not None and kv.value == b"2" and kv.lease == 0
