"""The in-process store: the etcd v3 model held in one asyncio event loop.

It serves `--standalone` runs directly and is the engine behind the gRPC store server.
Every method but `watch` runs to completion without suspending (nothing in it awaits),
so each call is atomic with respect to every other task on the loop: no locks are
needed, and compare-and-put is a plain read-compare-write. A watch suspends only
between the batches it reads, and re-reads the store after each suspension.

History for watches is a ring of write batches, one per revision. Every write bumps the
revision by exactly one, so the batches in the ring have consecutive revisions. They
are kept in segments of `_SEGMENT_REVISIONS` revisions; a full segment is indexed by
key. A watcher is only a cursor into that ring plus a wake-up event: writes wake the
watchers whose key they touch, and each watcher reads the ring from its cursor. A
sleeping watcher is told the revision that woke it, so it skips the writes in between
(none of them were its) and an idle watch survives any amount of unrelated traffic. A
watcher that falls behind the ring on its own keys (or asks for a revision before it)
gets CompactedError, as etcd's watchers do after compaction.

A watch from an old revision catches up through the ring: the index skips each segment
that holds none of its keys with a binary search and names the batches that do, so
catching up costs about one look-up per segment plus the watcher's own events, not one
step per revision (300,000 unrelated writes once held the loop for seconds). The work
is also cut in turns of `_WORK_PER_TURN`, between which the watch lets the loop run: a
catch-up through many events of its own (or a much larger ring) holds the loop for
about a millisecond at a time. Other tasks may write meanwhile; a watcher whose
next revision is evicted in between gets CompactedError, as above.

Leases expire by themselves: one timer on the loop fires at the earliest deadline of a
heap of (deadline, lease id). Keep-alives push a new entry and leave the old one to be
skipped when it surfaces, so a keep-alive is O(log n) and never reschedules the timer.

The keys of each job's worker namespace (`/elasticrun/<job>/w/`, see
`store/credentials.py`) are counted as they change, by job and in all: the server bounds
what a worker credential may make the store hold (`SpaceQuota`) without a scan.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import heapq
import secrets
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

from elasticrun.errors import (
    CompactedError,
    LeaseExpiredError,
    StoreLimitError,
    StoreRequestError,
    StoreUnavailableError,
)
from elasticrun.store.credentials import worker_job_of
from elasticrun.store.interface import (
    EventType,
    KeyValue,
    RangeResult,
    Store,
    WatchEvent,
    check_lease_ttl,
)

#: A round record at 1,000 nodes is ~100 KB; leave room for ten times that.
DEFAULT_MAX_VALUE_BYTES = 1 << 20
DEFAULT_MAX_KEY_BYTES = 4096
DEFAULT_MAX_KEYS = 100_000
#: Bytes of keys and values held at once: with max_keys alone, 100,000 values of 1 MiB
#: (100 GiB) would fit; no job needs more than a small part of this.
DEFAULT_MAX_TOTAL_BYTES = 1 << 30
#: Live leases (one per agent, about): each never-expiring lease would be kept forever.
DEFAULT_MAX_LEASES = 100_000
#: Bytes of watch history kept (keys + values + a fixed cost per event).
DEFAULT_HISTORY_BYTES = 64 << 20
_EVENT_OVERHEAD_BYTES = 64
#: Revisions per segment of the ring. Indexing a full one costs ~0.1 ms (~0.1 µs a
#: write); the ring's default 64 MiB holds at most ~1,000,000 events, ~1,000 segments,
#: so a watch from its oldest revision does ~1,000 look-ups, and reads the newest,
#: filling segment (not indexed) batch by batch.
_SEGMENT_REVISIONS = 1024
#: A catching-up watch lets the loop run after this much work (one unit per step, plus
#: one per event read): 0.3–1.5 ms of CPU on the loaded 2-core box of BENCHMARKS.md.
_WORK_PER_TURN = 256


@dataclass(slots=True)
class _Lease:
    id: int
    ttl: float
    deadline: float
    keys: set[str] = field(default_factory=set)


@dataclass(slots=True, eq=False)
class _Watcher:
    key: str
    prefix: bool
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    #: the first revision that touched this watcher's keys since it last slept
    woken_at: int = 0
    #: the revisions of the indexed segment from `plan_first` that touch its keys
    #: (looked up once per segment, not once per revision read in it)
    plan_first: int = 0
    plan: Sequence[int] = ()

    def events_in(self, batch: tuple[WatchEvent, ...]) -> list[WatchEvent]:
        """The events of `batch` on this watcher's keys."""
        if self.prefix:
            return [e for e in batch if e.key.startswith(self.key)]
        return [e for e in batch if e.key == self.key]

    def next_candidate(self, segment: _Segment, cursor: int) -> int:
        """The first revision from `cursor` on, in `segment` (cursor's), that may touch this watcher's keys.

        Cursor itself while the segment is filling (not indexed), else the next its
        index names, else the first revision of the next segment."""
        if not segment.indexed:
            return cursor
        if self.plan_first != segment.first:
            self.plan_first = segment.first
            self.plan = segment.touching(self.key, self.prefix)
        i = bisect.bisect_left(self.plan, cursor)
        return self.plan[i] if i < len(self.plan) else segment.end

    def drop_plan(self) -> None:
        """Caught up: free the plan (a sleeping watch may last for days)."""
        self.plan_first, self.plan = 0, ()


class _Segment:
    """The write batches of `_SEGMENT_REVISIONS` consecutive revisions from `first`.

    Once full it is indexed: the key of each of its events in sorted order (`keys`)
    beside the event's revision (`revisions`), so that the revisions touching one key or
    one prefix are a binary search away: two list slots (16 bytes) per event, the keys
    and revision numbers shared with the events. An evicted batch is dropped at once (its
    slot left empty) even while the rest of its segment is kept: values can be large.
    """

    __slots__ = ("first", "batches", "indexed", "keys", "revisions")

    def __init__(self, first: int) -> None:
        self.first = first
        self.batches: list[tuple[WatchEvent, ...]] = []
        self.indexed = False
        self.keys: list[str] = []
        self.revisions: list[int] = []

    @property
    def end(self) -> int:
        """The first revision after this segment."""
        return self.first + _SEGMENT_REVISIONS

    def index(self) -> None:
        """Index the full segment (once, by the write that fills it)."""
        events = [e for batch in self.batches for e in batch]
        keys = [e.key for e in events]
        # A stable sort by key alone: each key's revisions stay ascending.
        order = sorted(range(len(keys)), key=keys.__getitem__)
        self.keys = [keys[i] for i in order]
        self.revisions = [events[i].revision for i in order]
        self.indexed = True

    def touching(self, key: str, prefix: bool) -> list[int]:
        """The revisions in this indexed segment with an event on `key`, ascending.

        With `prefix`, on a key under it."""
        keys = self.keys
        lo = bisect.bisect_left(keys, key)
        if not prefix:
            return self.revisions[lo : bisect.bisect_right(keys, key, lo)]
        hi = lo
        while hi < len(keys) and keys[hi].startswith(key):
            hi += 1
        return sorted(set(self.revisions[lo:hi]))  # a delete_prefix: one revision, many keys


@dataclass(frozen=True, slots=True)
class SpaceQuota:
    """What a write may make the worker namespaces hold.

    The keys and bytes (keys and values) of the written key's own job (`keys`, `bytes`),
    and of all of them together (`all_keys`, `all_bytes`). Past one, the write is
    refused with StoreLimitError."""

    keys: int
    bytes: int
    all_keys: int
    all_bytes: int


@dataclass(slots=True)
class _Usage:
    """What one worker namespace (or all of them) holds."""

    keys: int = 0
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class StoreLoad:
    """The engine's size at one moment (see `MemoryStore.load`)."""

    keys: int
    #: UTF-8 bytes of the keys held, and of their values (together, what
    #: max_total_bytes bounds, counted there in characters of the keys)
    key_bytes: int
    value_bytes: int
    leases: int
    history_revisions: int
    history_bytes: int
    revision: int


class MemoryStore(Store):
    """An etcd-like store in the memory of this process, bounded in size.

    `max_key_bytes`, `max_value_bytes`, `max_keys`, `max_total_bytes` (keys and values
    together) and `max_leases` bound what a writer can make the store hold
    (StoreLimitError past them); `history_bytes` bounds the watch history. Empty keys
    are refused (StoreRequestError), as etcd refuses them.
    """

    def __init__(
        self,
        *,
        max_key_bytes: int = DEFAULT_MAX_KEY_BYTES,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        max_keys: int = DEFAULT_MAX_KEYS,
        history_bytes: int = DEFAULT_HISTORY_BYTES,
        max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
        max_leases: int = DEFAULT_MAX_LEASES,
    ) -> None:
        self.endpoint = "memory"
        #: Names this store's history: a watcher resuming elsewhere compares it to know
        #: whether the revisions it saw still mean anything there.
        self.history_id = secrets.randbits(64)
        self.max_key_bytes = max_key_bytes
        self.max_value_bytes = max_value_bytes
        self.max_keys = max_keys
        self.history_bytes = history_bytes
        self.max_total_bytes = max_total_bytes
        self.max_leases = max_leases
        self._kvs: dict[str, KeyValue] = {}
        self._total_bytes = 0  # len(key) + len(value) over the keys held
        self._key_bytes = 0  # for metrics: the keys' UTF-8 bytes
        self._value_bytes = 0
        self._sorted_keys: list[str] = []
        self._revision = 0
        self._segments: deque[_Segment] = deque()
        self._ring_sizes: deque[int] = deque()  # one per revision kept, oldest first
        self._ring_bytes = 0
        #: open watches by the key they watch, and by the prefix they watch: a write
        #: looks at each prefix once, not at each watcher (10,000 nodes watching one
        #: job's prefix made every write cost 10,000 checks: BENCHMARKS-HISTORY.md, "Scale")
        self._exact_watchers: dict[str, set[_Watcher]] = {}
        self._prefix_watchers: dict[str, set[_Watcher]] = {}
        self._leases: dict[int, _Lease] = {}
        #: keys and bytes of each job's worker namespace (no entry when empty), and in all
        self._usage: dict[str, _Usage] = {}
        self._all_usage = _Usage()
        self._expiry_heap: list[tuple[float, int]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._closed = False

    # --- reads ---------------------------------------------------------------------

    @property
    def revision(self) -> int:
        """The store revision: that of the latest write, 0 before any."""
        return self._revision

    def __len__(self) -> int:
        return len(self._kvs)

    def load(self) -> StoreLoad:
        """What the engine holds now, for metrics.

        O(1), and safe to call from another thread (it reads sizes only), so a scrape
        never waits on the event loop."""
        return StoreLoad(
            keys=len(self._kvs),
            key_bytes=self._key_bytes,
            value_bytes=self._value_bytes,
            leases=len(self._leases),
            history_revisions=len(self._ring_sizes),
            history_bytes=self._ring_bytes,
            revision=self._revision,
        )

    async def get(self, key: str) -> KeyValue | None:
        self._check_open()
        _check_not_empty(key)
        return self._kvs.get(key)

    def entries(self, keys: Sequence[str]) -> list[KeyValue | None]:
        """Each key's entry (None where there is none), read in one pass that never suspends.

        A consistent snapshot, at C speed (a microsecond per 16 keys or so)."""
        self._check_open()
        if "" in keys:
            _check_not_empty("")
        return list(map(self._kvs.get, keys))

    async def get_prefix(self, prefix: str) -> RangeResult:
        """A snapshot: the keys are immutable, so it stays as read while the store moves on.

        Costs a few microseconds per 100 keys (two binary searches, then C loops): the
        server takes the snapshot of a large prefix at once and sends it in pages.
        """
        self._check_open()
        return RangeResult(tuple(map(self._kvs.__getitem__, self._keys_with_prefix(prefix))), self._revision)

    def worker_keys(self, job: str) -> int:
        """How many keys job `job`'s worker namespace holds."""
        usage = self._usage.get(job)
        return usage.keys if usage is not None else 0

    # --- writes --------------------------------------------------------------------

    async def put(self, key: str, value: bytes, *, lease: int = 0, quota: SpaceQuota | None = None) -> int:
        """Write the key; with `quota` (the server's, for a worker credential) only within it."""
        self._check_open()
        self._put(key, value, lease, quota)
        return self._revision

    async def put_all(self, items: Sequence[tuple[str, bytes]], *, quota: SpaceQuota | None = None) -> int:
        """Put every (key, value) without a lease, or none if one of them would break a bound.

        etcd's transactions are all or nothing too; `quota` is a bound. A key given
        twice takes its last value, written once. Returns the store revision."""
        self._check_open()
        batch = dict(items)
        for key, value in batch.items():
            self._check_key(key)
            self._check_value(key, value)
        created = [key for key in batch if key not in self._kvs]
        if created and len(self._kvs) + len(created) > self.max_keys:
            raise self._too_many_keys(created[0])
        total = self._total_bytes
        for key, value in batch.items():
            total += self._growth(key, value)
        if total > self.max_total_bytes:
            key = next(iter(batch))
            raise self._too_many_bytes(key, sum(len(v) for v in batch.values()))
        if quota is not None:
            self._check_quota(batch, quota)
        for key, value in batch.items():
            self._write(key, value, 0, None)
        return self._revision

    async def compare_and_put(
        self, key: str, value: bytes, *, expected_mod_revision: int, lease: int = 0
    ) -> bool:
        self._check_open()
        _check_not_empty(key)  # before the compare: a failed one must not hide the refusal (etcd's order)
        current = self._kvs.get(key)
        if (current.mod_revision if current else 0) != expected_mod_revision:
            return False
        self._put(key, value, lease)
        return True

    async def delete(self, key: str) -> bool:
        self._check_open()
        _check_not_empty(key)
        return self._delete([key]) == 1

    async def compare_and_delete(self, key: str, *, expected_mod_revision: int) -> bool:
        self._check_open()
        _check_not_empty(key)
        current = self._kvs.get(key)
        if current is None or current.mod_revision != expected_mod_revision:
            return False
        return self._delete([key]) == 1

    async def delete_prefix(self, prefix: str) -> int:
        self._check_open()
        return self._delete(self._keys_with_prefix(prefix))

    # --- leases --------------------------------------------------------------------

    async def grant_lease(self, ttl: float) -> int:
        self._check_open()
        check_lease_ttl(ttl)
        if len(self._leases) >= self.max_leases:
            raise StoreLimitError(
                f"the store holds its maximum of {self.max_leases} leases (max_leases); "
                "revoke unused ones or let them expire"
            )
        lease_id = 0
        while lease_id == 0 or lease_id in self._leases:
            lease_id = secrets.randbits(63)  # random: an old id never names a new lease
        lease = _Lease(lease_id, ttl, asyncio.get_running_loop().time() + ttl)
        self._leases[lease_id] = lease
        self._push_deadline(lease)
        return lease_id

    async def keep_alive(self, lease: int) -> None:
        self._check_open()
        held = self._live_lease(lease)
        held.deadline = asyncio.get_running_loop().time() + held.ttl
        self._push_deadline(held)

    async def revoke_lease(self, lease: int) -> None:
        self._check_open()
        held = self._leases.get(lease)
        if held is not None:
            self._end_lease(held)

    def lease_ttl(self, lease: int) -> float:
        """The lease's TTL in seconds (for keep-alive replies); LeaseExpiredError if gone."""
        return self._live_lease(lease).ttl

    # --- watch ---------------------------------------------------------------------

    async def watch(
        self, key: str, *, start_revision: int, prefix: bool = False
    ) -> AsyncGenerator[WatchEvent, None]:
        async with contextlib.aclosing(self.watch_batches(key, start_revision, prefix)) as it:
            async for batch in it:
                for event in batch:
                    yield event

    async def watch_batches(
        self, key: str, start_revision: int, prefix: bool
    ) -> AsyncGenerator[list[WatchEvent], None]:
        """Like `watch`, one non-empty list per revision: what the server sends as a reply."""
        self._check_open()
        if not prefix:
            _check_not_empty(key)
        watcher = _Watcher(key, prefix)
        self._add_watcher(watcher)
        cursor = max(start_revision, 1)
        work = 0  # since the loop last ran other tasks
        try:
            while True:
                if self._closed:
                    raise StoreUnavailableError(self.endpoint, "the store was closed")
                if cursor > self._revision:
                    watcher.drop_plan()
                    watcher.wake.clear()
                    await watcher.wake.wait()
                    cursor, work = max(cursor, watcher.woken_at), 0
                    continue
                if work >= _WORK_PER_TURN:
                    await asyncio.sleep(0)  # catching up: let the other tasks run
                    work = 0
                    continue
                cursor, mine, read = self._catch_up_step(watcher, cursor)
                work += 1 + read
                if mine:
                    yield mine
        finally:
            self._remove_watcher(watcher)

    def _catch_up_step(
        self, watcher: _Watcher, cursor: int
    ) -> tuple[int, list[WatchEvent], int]:
        """One bounded step from `cursor` (at most the store revision).

        Skip to the next revision that may touch the watcher's keys, or read the batch
        of `cursor` if it may. Returns the new cursor, the watcher's events, and the
        events read."""
        oldest = self._oldest()
        if cursor < oldest:
            raise CompactedError(cursor, oldest)
        segment = self._segments[(cursor - self._segments[0].first) // _SEGMENT_REVISIONS]
        candidate = watcher.next_candidate(segment, cursor)
        if candidate > cursor:
            return candidate, [], 0  # the revisions in between hold none of its keys
        batch = segment.batches[cursor - segment.first]
        return cursor + 1, watcher.events_in(batch), len(batch)

    async def close(self) -> None:
        """Stop the expiry timer and end every open watch with StoreUnavailableError."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for watchers in [*self._prefix_watchers.values(), *self._exact_watchers.values()]:
            for watcher in watchers:
                watcher.wake.set()

    # --- internals -----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailableError(self.endpoint, "the store was closed")

    def _keys_with_prefix(self, prefix: str) -> list[str]:
        """The keys that start with `prefix`, sorted: two binary searches and a slice."""
        keys = self._sorted_keys
        lo = bisect.bisect_left(keys, prefix)
        end = _prefix_end(prefix)
        return keys[lo : len(keys) if end is None else bisect.bisect_left(keys, end, lo)]

    def _live_lease(self, lease: int) -> _Lease:
        held = self._leases.get(lease)
        if held is not None and held.deadline <= asyncio.get_running_loop().time():
            self._end_lease(held)  # due, though a busy loop has not run the timer yet
            held = None
        if held is None:
            raise LeaseExpiredError(lease)
        return held

    def _put(self, key: str, value: bytes, lease: int, quota: SpaceQuota | None = None) -> None:
        self._check_key(key)
        self._check_value(key, value)
        held = self._live_lease(lease) if lease else None
        current = self._kvs.get(key)
        if current is None and len(self._kvs) >= self.max_keys:
            raise self._too_many_keys(key)
        if self._total_bytes + self._growth(key, value) > self.max_total_bytes:
            raise self._too_many_bytes(key, len(value))
        if quota is not None:
            self._check_quota({key: value}, quota)
        self._write(key, value, lease, held)

    def _growth(self, key: str, value: bytes) -> int:
        """How many bytes writing `value` at `key` adds to the store (negative: frees)."""
        current = self._kvs.get(key)
        return len(value) - len(current.value) if current else len(key) + len(value)

    def _check_quota(self, batch: dict[str, bytes], quota: SpaceQuota) -> None:
        """Refuse the batch if it would take a worker namespace, or all of them, past `quota`."""
        growth: dict[str, _Usage] = {}
        for key, value in batch.items():
            job = worker_job_of(key)
            if job is None:
                continue
            grown = growth.setdefault(job, _Usage())
            grown.keys += key not in self._kvs
            grown.bytes += self._growth(key, value)
        all_keys = self._all_usage.keys + sum(g.keys for g in growth.values())
        all_bytes = self._all_usage.bytes + sum(g.bytes for g in growth.values())
        for job, grown in growth.items():
            held = self._usage.get(job, _Usage())
            if (grown.keys > 0 and held.keys + grown.keys > quota.keys) or (
                grown.bytes > 0 and held.bytes + grown.bytes > quota.bytes
            ):
                raise StoreLimitError(
                    f"the workers of job {job!r} hold {held.keys} keys, {held.bytes} bytes: the most a "
                    f"worker credential may hold is {quota.keys} keys, {quota.bytes} bytes (its fair share)"
                )
            if (grown.keys > 0 and all_keys > quota.all_keys) or (grown.bytes > 0 and all_bytes > quota.all_bytes):
                raise StoreLimitError(
                    f"the workers of all jobs hold {self._all_usage.keys} keys, {self._all_usage.bytes} bytes: "
                    f"the most workers may hold together is {quota.all_keys} keys, {quota.all_bytes} bytes "
                    "(the rest is kept for the agents)"
                )

    def _count(self, key: str, keys: int, size: int) -> None:
        """Add to the usage of `key`'s worker namespace, if it is in one."""
        job = worker_job_of(key)
        if job is None:
            return
        usage = self._usage.get(job)
        if usage is None:
            usage = self._usage[job] = _Usage()
        usage.keys += keys
        usage.bytes += size
        self._all_usage.keys += keys
        self._all_usage.bytes += size
        if not usage.keys:
            del self._usage[job]

    def _write(self, key: str, value: bytes, lease: int, held: _Lease | None) -> None:
        """Store `value` at a new revision: the bounds are checked, `held` is `lease`'s."""
        current = self._kvs.get(key)
        growth = self._growth(key, value)
        self._total_bytes += growth
        self._count(key, current is None, growth)
        self._value_bytes += len(value) - (len(current.value) if current else 0)
        if current is None:
            self._key_bytes += len(key.encode())
        self._revision += 1
        rev = self._revision
        if current is None:
            kv = KeyValue(key, value, rev, rev, 1, lease)
            bisect.insort(self._sorted_keys, key)
        else:
            kv = KeyValue(key, value, current.create_revision, rev, current.version + 1, lease)
            if current.lease and current.lease != lease:
                self._unbind(key, current.lease)
        if held is not None:
            held.keys.add(key)
        self._kvs[key] = kv
        self._record((WatchEvent(EventType.PUT, key, value, rev),))

    def _check_value(self, key: str, value: bytes) -> None:
        if len(value) > self.max_value_bytes:
            raise StoreLimitError(
                f"value of {len(value)} bytes for key {key!r} is over the store's "
                f"limit of {self.max_value_bytes} bytes (max_value_bytes)"
            )

    def _too_many_keys(self, key: str) -> StoreLimitError:
        return StoreLimitError(
            f"the store holds its maximum of {self.max_keys} keys (max_keys); "
            f"cannot create {key!r}"
        )

    def _too_many_bytes(self, key: str, size: int) -> StoreLimitError:
        return StoreLimitError(
            f"the store holds {self._total_bytes} bytes of keys and values, near its "
            f"limit of {self.max_total_bytes} (max_total_bytes); cannot store "
            f"{size} bytes for key {key[:64]!r}"
        )

    def _check_key(self, key: str) -> None:
        _check_not_empty(key)
        # A str of n characters encodes to at most 4n bytes: skip encoding short keys.
        if len(key) * 4 > self.max_key_bytes and len(key.encode()) > self.max_key_bytes:
            raise StoreLimitError(
                f"key {key[:64]!r}... is over the store's limit of "
                f"{self.max_key_bytes} bytes (max_key_bytes)"
            )

    def _delete(self, keys: list[str]) -> int:
        """Delete the existing ones among `keys` at one new revision."""
        keys = [k for k in keys if k in self._kvs]
        if not keys:
            return 0
        self._revision += 1
        rev = self._revision
        for key in keys:
            kv = self._kvs.pop(key)
            self._total_bytes -= len(key) + len(kv.value)
            self._count(key, -1, -(len(key) + len(kv.value)))
            self._key_bytes -= len(key.encode())
            self._value_bytes -= len(kv.value)
            del self._sorted_keys[bisect.bisect_left(self._sorted_keys, key)]
            if kv.lease:
                self._unbind(key, kv.lease)
        self._record(tuple(WatchEvent(EventType.DELETE, k, b"", rev) for k in keys))
        return len(keys)

    def _unbind(self, key: str, lease: int) -> None:
        held = self._leases.get(lease)
        if held is not None:
            held.keys.discard(key)

    def _record(self, batch: tuple[WatchEvent, ...]) -> None:
        """Append the batch of the new revision to the ring and wake its watchers."""
        self._append(batch)
        size = sum(len(e.key) + len(e.value) + _EVENT_OVERHEAD_BYTES for e in batch)
        self._ring_sizes.append(size)
        self._ring_bytes += size
        while self._ring_bytes > self.history_bytes and len(self._ring_sizes) > 1:
            self._evict_oldest()
        rev = self._revision
        for event in batch:
            for watcher in self._exact_watchers.get(event.key, ()):
                self._wake(watcher, rev)
        for prefix, watchers in self._prefix_watchers.items():
            if any(e.key.startswith(prefix) for e in batch):
                for watcher in watchers:
                    self._wake(watcher, rev)

    def _append(self, batch: tuple[WatchEvent, ...]) -> None:
        """Put the batch of the new revision in the newest segment; index it once full."""
        segments = self._segments
        if not segments or segments[-1].indexed:
            segments.append(_Segment(self._revision))
        tail = segments[-1]
        tail.batches.append(batch)
        if len(tail.batches) == _SEGMENT_REVISIONS:
            tail.index()

    def _evict_oldest(self) -> None:
        oldest = self._oldest()
        self._ring_bytes -= self._ring_sizes.popleft()
        front = self._segments[0]
        front.batches[oldest - front.first] = ()
        if oldest + 1 == front.end:
            self._segments.popleft()

    def _oldest(self) -> int:
        """The oldest revision kept in the ring (the store revision + 1 when empty)."""
        return self._revision - len(self._ring_sizes) + 1

    @staticmethod
    def _wake(watcher: _Watcher, revision: int) -> None:
        if not watcher.wake.is_set():
            watcher.woken_at = revision
            watcher.wake.set()

    def _watchers_of(self, watcher: _Watcher) -> dict[str, set[_Watcher]]:
        return self._prefix_watchers if watcher.prefix else self._exact_watchers

    def _add_watcher(self, watcher: _Watcher) -> None:
        self._watchers_of(watcher).setdefault(watcher.key, set()).add(watcher)

    def _remove_watcher(self, watcher: _Watcher) -> None:
        by_key = self._watchers_of(watcher)
        watchers = by_key.get(watcher.key)
        if watchers is not None:
            watchers.discard(watcher)
            if not watchers:
                del by_key[watcher.key]

    def _end_lease(self, lease: _Lease) -> None:
        del self._leases[lease.id]
        self._delete(sorted(lease.keys))

    def _push_deadline(self, lease: _Lease) -> None:
        heap = self._expiry_heap
        heapq.heappush(heap, (lease.deadline, lease.id))
        # Keep-alives leave stale entries behind; rebuild before they dominate.
        if len(heap) > 2 * len(self._leases) + 64:
            heap[:] = [(held.deadline, held.id) for held in self._leases.values()]
            heapq.heapify(heap)
        self._arm_timer()

    def _arm_timer(self) -> None:
        if self._closed or not self._expiry_heap:
            return
        at = self._expiry_heap[0][0]
        if self._timer is not None:
            if self._timer_at <= at:
                return  # an earlier wake-up re-arms for the rest
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_at(at, self._expire_due)
        self._timer_at = at

    def _expire_due(self) -> None:
        self._timer = None
        now = asyncio.get_running_loop().time()
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            held = self._leases.get(lease_id)
            if held is not None and held.deadline <= now:
                self._end_lease(held)
        self._arm_timer()


def _prefix_end(prefix: str) -> str | None:
    """The first string after every string that starts with `prefix`.

    None when there is none (an empty prefix, or one of only the last code point)."""
    stripped = prefix.rstrip(chr(0x10FFFF))
    if not stripped:
        return None
    return stripped[:-1] + chr(ord(stripped[-1]) + 1)


def _check_not_empty(key: str) -> None:
    if not key:
        raise StoreRequestError("a key must not be empty")
