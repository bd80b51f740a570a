"""A model-based test of the store: random sequences of operations, every reply checked.

Hypothesis' stateful testing drives put (with and without a lease), delete, delete_prefix,
get, get_prefix, compare_and_put / compare_and_delete (both outcomes), lease grant,
keep-alive, revoke and expiry, and watches opened at some revision, against a real
store and against `Model`, a reference written for clarity rather than speed. Every
reply is compared, revisions included; at the end of each sequence every watch must
have delivered exactly the model's events on its keys from its start revision on.

The built-in store runs as in production: a `StoreServer` on loopback, reached by a
`GrpcStore`. The same machine runs against a real etcd (`etcd` marker): where the two
differ on purpose, `Quirks` names the difference per backend (docs/backends.md lists
them), so no difference is skipped silently.

The keys come from a tiny alphabet ("a" is a prefix of "a/1") so that prefixes overlap
and writes collide. The store clients are async: one event loop runs in a background
thread for the whole test, and each step submits its calls to it; lease keep-alives
(etcd) and watch readers run there between the steps too.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test
from pyetcd import etcdrpc

from elasticrun.errors import LeaseExpiredError, StoreError, StoreRequestError
from elasticrun.store.client.grpc_store import GrpcStore
from elasticrun.store.etcd.backend import EtcdStore
from elasticrun.store.interface import EventType, KeyValue, RangeResult, Store, WatchEvent
from elasticrun.store.server.memory import MemoryStore
from elasticrun.store.server.store_server import StoreServer
from tests.support.etcd_cluster import EtcdCluster

#: Bounds every wait on the store; far above any healthy latency.
EVENT_WAIT = 10.0
#: etcd's expiry can only be waited for: its lessor looks for due leases every 0.5 s.
ETCD_EXPIRY_WAIT = 15.0
KEYS = ("a", "a/1", "b")
PREFIXES = ("", "a", "a/", "b", "c")
VALUES = (b"", b"x", b"yy")
MAX_WATCHES = 4
#: Per CI run: sequences (hypothesis examples) and the most steps in each.
BUILTIN_BUDGET = settings(
    max_examples=200, stateful_step_count=50, deadline=None, database=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
#: etcd's expiry costs over 2 s a lease (its lessor looks for due leases twice a second):
#: fewer, shorter sequences.
ETCD_BUDGET = settings(BUILTIN_BUDGET, max_examples=15, stateful_step_count=25)
#: `ELASTICRUN_SOAK=1` (the fault suite's soak switch) runs more and longer sequences,
#: drawn afresh each time (a few minutes each).
SOAK_VAR = "ELASTICRUN_SOAK"
BUILTIN_SOAK = settings(BUILTIN_BUDGET, max_examples=500, stateful_step_count=100, derandomize=False)
ETCD_SOAK = settings(BUILTIN_SOAK, max_examples=60, stateful_step_count=40)
#: a failing etcd sequence is replayed many times while hypothesis shrinks it
TEST_TIMEOUT = 900
soak = pytest.mark.skipif(os.environ.get(SOAK_VAR) != "1", reason=f"soak test: set {SOAK_VAR}=1")

T = TypeVar("T")


# --- the reference model -----------------------------------------------------------------


@dataclass
class Model:
    """The store as the API documents it: a dict, a revision counter, leases, a log."""

    revision: int
    kvs: dict[str, KeyValue] = field(default_factory=dict)
    leases: dict[int, set[str]] = field(default_factory=dict)  # live lease -> its keys
    log: list[WatchEvent] = field(default_factory=list)

    def get(self, key: str) -> KeyValue | None:
        return self.kvs.get(key)

    def get_prefix(self, prefix: str) -> RangeResult:
        return RangeResult(tuple(self.kvs[k] for k in sorted(self.kvs) if k.startswith(prefix)), self.revision)

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        if lease and lease not in self.leases:
            raise LeaseExpiredError(lease)
        self.revision += 1
        old = self.kvs.get(key)
        if old is not None and old.lease:
            self.leases[old.lease].discard(key)
        if lease:
            self.leases[lease].add(key)
        create, version = (old.create_revision, old.version + 1) if old else (self.revision, 1)
        self.kvs[key] = KeyValue(key, value, create, self.revision, version, lease)
        self.log.append(WatchEvent(EventType.PUT, key, value, self.revision))
        return self.revision

    def delete_keys(self, keys: set[str]) -> int:
        """Delete those of `keys` that exist, in key order, at one new revision (none: no revision)."""
        present = sorted(k for k in keys if k in self.kvs)
        if present:
            self.revision += 1
        for key in present:
            lease = self.kvs.pop(key).lease
            if lease:
                self.leases[lease].discard(key)
            self.log.append(WatchEvent(EventType.DELETE, key, b"", self.revision))
        return len(present)

    def delete(self, key: str) -> bool:
        return self.delete_keys({key}) == 1

    def delete_prefix(self, prefix: str) -> int:
        return self.delete_keys({k for k in self.kvs if k.startswith(prefix)})

    def mod_revision(self, key: str) -> int:
        kv = self.kvs.get(key)
        return kv.mod_revision if kv else 0

    def compare_and_put(self, key: str, value: bytes, expected: int, lease: int) -> bool:
        if self.mod_revision(key) != expected:
            return False
        self.put(key, value, lease)
        return True

    def compare_and_delete(self, key: str, expected: int) -> bool:
        return key in self.kvs and self.mod_revision(key) == expected and self.delete(key)

    def grant(self, lease: int) -> int:
        self.leases[lease] = set()
        return lease

    def keep_alive(self, lease: int) -> None:
        if lease not in self.leases:
            raise LeaseExpiredError(lease)

    def end_lease(self, lease: int) -> None:
        """A revoke, or the lease's TTL running out: the same to the keys and the log."""
        if lease in self.leases:
            self.delete_keys(set(self.leases[lease]))
            del self.leases[lease]

    def events(self, key: str, prefix: bool, start: int) -> list[WatchEvent]:
        def mine(e: WatchEvent) -> bool:
            return e.key.startswith(key) if prefix else e.key == key

        return [e for e in self.log if e.revision >= start and mine(e)]


# --- the backends ------------------------------------------------------------------------


@dataclass(frozen=True)
class Quirks:
    """How a backend differs from the built-in store where the sequences reach it
    (docs/backends.md, "Differences from etcd")."""

    #: whether a watch from revision 0 replays the history kept (built-in store) rather
    #: than starting at the next write (etcd: not comparable, so not drawn)
    watch_from_zero: bool = True
    #: whether a watch of the empty key, not as a prefix, is refused (etcd takes it
    #: and never reports anything, not comparable, so not drawn)
    refuses_empty_watch: bool = True


ETCD_QUIRKS = Quirks(watch_from_zero=False, refuses_empty_watch=False)


@dataclass
class Backend:
    """A store under test and the means to make one of its leases expire."""

    store: Store
    #: the store revision when the sequence starts (etcd's server is shared by the session)
    first_revision: int
    lease_ttl: float
    #: returns once the lease's TTL has run out and the store has ended it
    expire: Callable[[int], Awaitable[None]]
    close: Callable[[], Awaitable[None]]
    quirks: Quirks = Quirks()
    #: leases the backend keeps alive between steps (etcd's TTLs run in real time)
    kept: set[int] = field(default_factory=set)


async def builtin_backend() -> Backend:
    server = StoreServer("127.0.0.1", 0, engine=MemoryStore())
    await server.start()
    client = GrpcStore(server.endpoint)
    engine = server.engine

    async def expire(lease: int) -> None:
        # The engine's clock is the loop's: a deadline moved to now is the TTL run out,
        # and the engine's own expiry timer ends the lease, as it would after the TTL.
        held = engine._leases[lease]
        held.deadline = asyncio.get_running_loop().time()
        engine._push_deadline(held)
        async with asyncio.timeout(EVENT_WAIT):
            while lease in engine._leases:
                await asyncio.sleep(0)

    async def close() -> None:
        await client.close()
        await server.stop()
        await engine.close()

    return Backend(client, 0, 60.0, expire, close)


async def etcd_backend(cluster: EtcdCluster) -> Backend:
    store = EtcdStore(cluster.endpoints)
    await store.delete_prefix("")
    first = (await store.get_prefix("")).revision
    kept: set[int] = set()
    lost: list[int] = []

    async def keep() -> None:  # etcd's TTLs run in real time: renew until the test lets go
        while True:
            for lease in list(kept):
                try:
                    await store.keep_alive(lease)
                except LeaseExpiredError:
                    if lease in kept:
                        lost.append(lease)
            await asyncio.sleep(0.25)

    keeper = asyncio.create_task(keep())

    def ttl_left(lease: int) -> int:
        with grpc.insecure_channel(cluster.endpoints[0]) as channel:
            request = etcdrpc.LeaseTimeToLiveRequest(ID=lease)
            return int(etcdrpc.LeaseStub(channel).LeaseTimeToLive(request, timeout=EVENT_WAIT).TTL)

    async def expire(lease: int) -> None:
        kept.discard(lease)
        async with asyncio.timeout(ETCD_EXPIRY_WAIT):
            # -1: revoked, not merely due (a due lease takes puts until its revoke is applied)
            while await asyncio.to_thread(ttl_left, lease) != -1:
                await asyncio.sleep(0.1)  # etcd offers no event for a lease without keys

    async def close() -> None:
        keeper.cancel()
        for lease in list(kept):
            await store.revoke_lease(lease)
        await store.close()
        assert not lost, f"etcd let leases lapse that the test kept alive: {lost}"

    return Backend(store, first, 2.0, expire, close, ETCD_QUIRKS, kept)


# --- the machine -------------------------------------------------------------------------


class LoopThread:
    """One event loop in a background thread; `run` waits for a coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 2 * ETCD_EXPIRY_WAIT) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(EVENT_WAIT)
        self.loop.close()


@dataclass
class Watch:
    key: str
    prefix: bool
    start: int
    events: list[WatchEvent] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    error: BaseException | None = None
    reader: asyncio.Task[None] | None = None

    async def read(self, it: AsyncIterator[WatchEvent]) -> None:
        try:
            async for event in it:
                self.events.append(event)
                self.arrived.set()
        except Exception as e:  # reported by the final check
            self.error = e
            self.arrived.set()

    async def wait_for(self, n: int) -> list[WatchEvent]:
        async with asyncio.timeout(EVENT_WAIT):
            while len(self.events) < n and self.error is None:
                self.arrived.clear()
                await self.arrived.wait()
        return self.events


async def outcome(call: Awaitable[T] | Callable[[], T]) -> tuple[str, Any]:
    """("ok", the result) or ("error", the exception's type), for comparing two stores."""
    try:
        return "ok", await call if not callable(call) else call()
    except StoreError as e:
        return "error", type(e)


@dataclass
class Tally:
    """What one run did, for reporting its budget."""

    sequences: int = 0
    steps: int = 0


class StoreMachine(RuleBasedStateMachine):
    """Every step does one operation on the store and on the model and compares them."""

    def __init__(self, loop: LoopThread, backend: Coroutine[Any, Any, Backend], tally: Tally) -> None:
        super().__init__()
        self.loop, self.tally = loop, tally
        self.broken = False
        self.backend = self.loop.run(backend)
        self.store = self.backend.store
        self.model = Model(self.backend.first_revision)
        self.granted: list[int] = []  # every lease of this sequence, live or not
        self.watches: list[Watch] = []
        tally.sequences += 1

    def same(self, real: Callable[[], Awaitable[T]], model: Callable[[], T]) -> T:
        """Run the operation on the store, then on the model; their outcomes must match."""
        self.tally.steps += 1
        try:
            got = self.loop.run(outcome(real()))
            want = self.loop.run(outcome(model))
            assert got == want, f"store: {got}\nmodel: {want}"
        except BaseException:
            self.broken = True
            raise
        return got[1]  # type: ignore[no-any-return]

    def lease(self, pick: int) -> int:
        return self.granted[pick % len(self.granted)] if self.granted and pick >= 0 else 0

    def expected(self, key: str, kind: str) -> int:
        current = self.model.mod_revision(key)
        return {"zero": 0, "current": current, "next": current + 1}[kind]

    @rule(key=st.sampled_from(KEYS), value=st.sampled_from(VALUES), pick=st.integers(-1, 3))
    def put(self, key: str, value: bytes, pick: int) -> None:
        lease = self.lease(pick)
        self.same(lambda: self.store.put(key, value, lease=lease), lambda: self.model.put(key, value, lease))

    @rule(key=st.sampled_from(KEYS))
    def delete(self, key: str) -> None:
        self.same(lambda: self.store.delete(key), lambda: self.model.delete(key))

    @rule(prefix=st.sampled_from(PREFIXES))
    def delete_prefix(self, prefix: str) -> None:
        self.same(lambda: self.store.delete_prefix(prefix), lambda: self.model.delete_prefix(prefix))

    @rule(key=st.sampled_from(KEYS))
    def get(self, key: str) -> None:
        self.same(lambda: self.store.get(key), lambda: self.model.get(key))

    @rule(prefix=st.sampled_from(PREFIXES))
    def get_prefix(self, prefix: str) -> None:
        self.same(lambda: self.store.get_prefix(prefix), lambda: self.model.get_prefix(prefix))

    @rule(
        key=st.sampled_from(KEYS), value=st.sampled_from(VALUES),
        kind=st.sampled_from(("zero", "current", "next")), pick=st.integers(-1, 3),
    )
    def compare_and_put(self, key: str, value: bytes, kind: str, pick: int) -> None:
        expected, lease = self.expected(key, kind), self.lease(pick)
        self.same(
            lambda: self.store.compare_and_put(key, value, expected_mod_revision=expected, lease=lease),
            lambda: self.model.compare_and_put(key, value, expected, lease),
        )

    @rule(key=st.sampled_from(KEYS), kind=st.sampled_from(("zero", "current", "next")))
    def compare_and_delete(self, key: str, kind: str) -> None:
        expected = self.expected(key, kind)
        self.same(
            lambda: self.store.compare_and_delete(key, expected_mod_revision=expected),
            lambda: self.model.compare_and_delete(key, expected),
        )

    @rule()
    def grant_lease(self) -> None:
        lease = self.loop.run(self.store.grant_lease(self.backend.lease_ttl))
        assert lease not in self.granted
        self.granted.append(self.model.grant(lease))
        self.backend.kept.add(lease)

    @precondition(lambda self: self.granted)
    @rule(pick=st.integers(0, 3))
    def keep_alive(self, pick: int) -> None:
        lease = self.lease(pick)
        self.same(lambda: self.store.keep_alive(lease), lambda: self.model.keep_alive(lease))

    @precondition(lambda self: self.granted)
    @rule(pick=st.integers(0, 3))
    def revoke_lease(self, pick: int) -> None:
        lease = self.lease(pick)
        self.backend.kept.discard(lease)
        self.same(lambda: self.store.revoke_lease(lease), lambda: self.model.end_lease(lease))

    @precondition(lambda self: self.model.leases)
    @rule(pick=st.integers(0, 3))
    def expire_lease(self, pick: int) -> None:
        live = [lease for lease in self.granted if lease in self.model.leases]  # in grant order: ids are random
        lease = live[pick % len(live)]
        self.same(lambda: self.backend.expire(lease), lambda: self.model.end_lease(lease))

    @precondition(lambda self: len(self.watches) < MAX_WATCHES)
    @rule(key=st.sampled_from(KEYS + PREFIXES), prefix=st.booleans(), back=st.integers(0, 8))
    def watch(self, key: str, prefix: bool, back: int) -> None:
        if not key:
            prefix = True  # an empty key names nothing but as a prefix
        start = max(self.model.revision + 1 - back, self.backend.first_revision + 1)
        if back > self.model.revision and self.backend.quirks.watch_from_zero:
            start = 0  # from the oldest revision kept: all of this sequence
        watch = Watch(key, prefix, start)

        async def open_watch() -> None:
            watch.reader = asyncio.create_task(watch.read(self.store.watch(key, start_revision=start, prefix=prefix)))

        self.loop.run(open_watch())
        self.watches.append(watch)

    @rule(
        op=st.sampled_from(("get", "put", "delete", "compare_and_put", "compare_and_delete", "watch")),
        expected=st.sampled_from((0, 1)),
    )
    def empty_key(self, op: str, expected: int) -> None:
        """Every operation on one key refuses the empty key, whatever its compare, and
        changes nothing."""
        if op == "watch" and not self.backend.quirks.refuses_empty_watch:
            return
        calls: dict[str, Callable[[], Awaitable[object]]] = {
            "get": lambda: self.store.get(""),
            "put": lambda: self.store.put("", b"x"),
            "delete": lambda: self.store.delete(""),
            "compare_and_put": lambda: self.store.compare_and_put("", b"x", expected_mod_revision=expected),
            "compare_and_delete": lambda: self.store.compare_and_delete("", expected_mod_revision=expected),
            "watch": lambda: anext(aiter(self.store.watch("", start_revision=1))),
        }
        def refused() -> None:
            raise StoreRequestError("a key must not be empty")

        self.same(calls[op], refused)

    def check_watches(self) -> None:
        """Write once more to each watched key (a fence: nothing can hide after it), then
        every watch must have delivered exactly the model's events."""
        for fence in sorted({w.key or "a" for w in self.watches}):
            self.put(fence, b"fence", -1)
        for w in self.watches:
            want = self.model.events(w.key, w.prefix, w.start)
            got = self.loop.run(w.wait_for(len(want)))
            assert w.error is None, f"watch {w.key!r} (prefix={w.prefix}) from {w.start} failed: {w.error!r}"
            assert got == want, f"watch {w.key!r} (prefix={w.prefix}) from {w.start}:\n{got}\nmodel:\n{want}"

    def teardown(self) -> None:
        try:
            if not self.broken:
                self.check_watches()
        finally:
            readers = [w.reader for w in self.watches if w.reader is not None]

            async def stop() -> None:
                for reader in readers:
                    reader.cancel()
                await asyncio.gather(*readers, return_exceptions=True)
                await self.backend.close()

            self.loop.run(stop())


def run_machine(
    loop: LoopThread, make_backend: Callable[[], Coroutine[Any, Any, Backend]], budget: settings
) -> None:
    tally = Tally()
    run_state_machine_as_test(lambda: StoreMachine(loop, make_backend(), tally), settings=budget)
    print(f"\n{tally.sequences} sequences, {tally.steps} steps")  # the budget's worth, with -s


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("budget", [BUILTIN_BUDGET, pytest.param(BUILTIN_SOAK, marks=soak)], ids=["ci", "soak"])
def test_builtin_store_over_grpc_matches_the_model(loop: LoopThread, budget: settings) -> None:
    run_machine(loop, builtin_backend, budget)


@pytest.mark.slow  # the built-in store's run above stays in the README's command
@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("budget", [ETCD_BUDGET, pytest.param(ETCD_SOAK, marks=soak)], ids=["ci", "soak"])
def test_etcd_matches_the_model(loop: LoopThread, etcd_server: EtcdCluster, budget: settings) -> None:
    run_machine(loop, lambda: etcd_backend(etcd_server), budget)
