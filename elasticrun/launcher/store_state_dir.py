"""The closed-job journal of `elasticrun store serve --state-dir`.

A finished job stays finished when the store restarts.

A job's end is its closed round record (`r/job/round` with `closed` set), which lives
`closed_ttl` in the store: an agent that comes late (a requeued Slurm step, a pod
restarted) reads it and exits instead of starting the job again. The built-in store
keeps everything in memory, so without the journal a restart of `store serve` forgets
the end, and the late agent runs the finished job again. The journal keeps exactly those
records, one small file each, with the wall-clock time its lease runs out; on start the
server puts back those not yet expired, each under a lease for the time it had left.
A closed record thus outlives a restart exactly as long as it would have lived without
one, and after that the same id starts a fresh job, as a job's end promises.

Only closed round records are kept: a job still running when its store restarts is
re-formed by its agents, which tell the store's lives apart; its records are theirs to
write again. The journal follows the store by a watch on the jobs' prefix, in the
server's own loop, and touches a job's file only when its end changes (the job ends, its
record expires, or the id starts afresh), in a thread so that the disk never holds the
server's loop. A record is written to a new file renamed over the old (fsynced), so a
crash leaves one or the other.

The store an agent hosts has no journal: it lives and dies with that agent, which stops
it only once the job's other nodes are gone, so it has no restart to survive: a new
hosting agent starts a new store, and so a new job, whatever the journal said. etcd
keeps its records and leases across its own restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import stat
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from elasticrun.errors import CompactedError, LeaseExpiredError, RendezvousError, UsageError
from elasticrun.rendezvous.codec import decode
from elasticrun.rendezvous.keys import JOBS_PREFIX, Keys
from elasticrun.rendezvous.rounds import RoundHead
from elasticrun.store.interface import MAX_LEASE_TTL, EventType
from elasticrun.store.server.memory import MemoryStore

#: the largest journal file read back: a round record is at most a store value (1 MiB),
#: JSON-escaped within the file
MAX_RECORD_FILE_BYTES = 8 << 20

log = logging.getLogger("elasticrun")

#: a journal file: one per ended job, named by its round key's hash
_FILE_PREFIX, _FILE_SUFFIX = "closed-", ".json"
JOURNAL_VERSION = 1


@dataclass(frozen=True, slots=True)
class ClosedRecord:
    """One job's closed round record, as the store held it, and when it expires."""

    record: str
    #: wall-clock time (time.time()) its lease runs out
    expires_at: float


def round_key(key: str) -> bool:
    """Whether `key` is a job's round record (`/elasticrun/<id>/r/job/round`)."""
    if not key.startswith(JOBS_PREFIX):
        return False
    run_id = key[len(JOBS_PREFIX):].split("/", 1)[0]
    return bool(run_id) and key == Keys(run_id).round


def closed_round(raw: bytes) -> bool:
    """Whether a round record says the job has ended (an unreadable one does not)."""
    try:
        return bool(decode(RoundHead, raw).closed)
    except RendezvousError:
        return False


class ClosedJournal:
    """The closed round records of the store `store serve` runs, kept in `folder`.

    One small file per ended job, so that a job's end writes one file, whatever the
    number of ended jobs (a file per job also bounds what one change costs: its own
    record, written off the server's loop)."""

    def __init__(self, folder: Path, clock: Callable[[], float] = time.time) -> None:
        self.folder = folder
        self._clock = clock
        #: round key -> its closed record
        self.records: dict[str, ClosedRecord] = {}

    @classmethod
    def open(cls, folder: Path, clock: Callable[[], float] = time.time) -> ClosedJournal:
        """The journal in `folder` (made, private, when missing), its unexpired records read."""
        _private_folder(folder)
        journal = cls(folder, clock)
        now = clock()
        for path in sorted(folder.glob(f"{_FILE_PREFIX}*{_FILE_SUFFIX}")):
            key, record = _read_record(path)
            if not record.expires_at - now <= MAX_LEASE_TTL:  # NaN too: a lease the store cannot grant
                raise UsageError(
                    f"--state-dir: {path} says its job's end is kept until {record.expires_at!r}, past the "
                    f"longest lease ({MAX_LEASE_TTL:g} s from now): move it away to start without it"
                )
            if record.expires_at > now and path == journal.file_of(key):
                journal.records[key] = record
            else:
                journal._remove(key, path)
        return journal

    def file_of(self, key: str) -> Path:
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        return self.folder / f"{_FILE_PREFIX}{digest}{_FILE_SUFFIX}"

    def _store(self, key: str, record: ClosedRecord) -> None:
        """Write one job's file anew, then rename it into place (both fsynced)."""
        body = {"version": JOURNAL_VERSION, "key": key, "record": record.record, "expires_at": record.expires_at}
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(body, f, separators=(",", ":"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.file_of(key))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._sync_folder()

    def _remove(self, key: str, path: Path | None = None) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path or self.file_of(key))
        self._sync_folder()

    def _sync_folder(self) -> None:
        fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    async def restore(self, engine: MemoryStore) -> int:
        """Put the unexpired records back into a new store, each for the time it has left; return how many."""
        restored = 0
        for key, r in self.records.items():
            left = r.expires_at - self._clock()
            if left > 0:
                lease = await engine.grant_lease(left)
                await engine.put(key, r.record.encode(), lease=lease)
                restored += 1
        return restored

    async def note(self, engine: MemoryStore, key: str, value: bytes | None) -> None:
        """A round record changed (None: deleted): keep it while closed, else drop it."""
        kept = self.records.get(key)
        if value is not None and closed_round(value):
            if kept is not None and kept.record == value.decode():
                return
            closed = await self._closed_record(engine, key, value)
            if closed is None:
                return
            self.records[key] = closed
            write = functools.partial(self._store, key, closed)
        elif kept is not None:
            del self.records[key]
            write = functools.partial(self._remove, key)
        else:
            return
        try:
            await asyncio.to_thread(write)
        except OSError as e:
            log.error("cannot keep the end of job %s in %s: %s (a store restart forgets it)", key, self.folder, e)

    async def _closed_record(self, engine: MemoryStore, key: str, value: bytes) -> ClosedRecord | None:
        """The record with its expiry, from the lease it is bound to.

        None when it is gone already, or bound to none (no record of ours is)."""
        kv = await engine.get(key)
        if kv is None or kv.value != value or not kv.lease:
            return None
        try:
            ttl = engine.lease_ttl(kv.lease)
        except LeaseExpiredError:
            return None
        return ClosedRecord(value.decode(), self._clock() + ttl)

    async def follow(self, engine: MemoryStore, revision: int) -> None:
        """Keep the journal in step with the store's round records after `revision`, until cancelled.

        A watch that fell behind the store's history (a flood of writes while a file
        was written) reads the store as it is, and follows on from there.
        """
        while True:
            try:
                async for event in engine.watch(JOBS_PREFIX, start_revision=revision + 1, prefix=True):
                    revision = event.revision
                    if round_key(event.key):
                        await self.note(engine, event.key, event.value if event.type is EventType.PUT else None)
            except CompactedError:
                revision = await self.settle(engine)

    async def settle(self, engine: MemoryStore) -> int:
        """Bring the journal in step with the store as it is now; return the revision read."""
        snapshot = await engine.get_prefix(JOBS_PREFIX)
        rounds = {kv.key: kv.value for kv in snapshot.kvs if round_key(kv.key)}
        for key in [k for k in self.records if k not in rounds]:
            await self.note(engine, key, None)
        for key, value in rounds.items():
            await self.note(engine, key, value)
        return snapshot.revision


@contextlib.asynccontextmanager
async def journaled(folder: Path, engine: MemoryStore) -> AsyncIterator[ClosedJournal]:
    """Keep `engine`'s closed round records in `folder` while the block runs.

    Restored into it first, followed throughout, and settled as the block ends (the
    engine is still open then)."""
    journal = ClosedJournal.open(folder)
    restored = await journal.restore(engine)
    if restored:
        log.info("restored the end of %d job(s) from %s", restored, folder)
    task = asyncio.ensure_future(journal.follow(engine, engine.revision))
    task.add_done_callback(functools.partial(_report_failure, folder))
    try:
        yield journal
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # a failure was told as it happened
        await journal.settle(engine)


def _report_failure(folder: Path, task: asyncio.Task[None]) -> None:
    """Say at once that the journal stopped following the store.

    The store serves on: its jobs run as before, only a restart would now forget the
    ends that follow."""
    if not task.cancelled() and task.exception() is not None:
        log.error(
            "the closed-job journal in %s stopped: %r; a restart of the store forgets the jobs that end from now on",
            folder, task.exception(),
        )


def _read_record(path: Path) -> tuple[str, ClosedRecord]:
    """One journal file: the round key and its record.

    Refused (a usage error naming the file) when it is not one: what else could be in
    our private folder is for its owner to look at."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_RECORD_FILE_BYTES + 1)
    except OSError as e:
        raise UsageError(f"--state-dir: cannot read {path}: {e.strerror}") from None
    try:
        if len(raw) > MAX_RECORD_FILE_BYTES:
            raise ValueError(f"over {MAX_RECORD_FILE_BYTES} bytes")
        body = json.loads(raw)
        if body.get("version") != JOURNAL_VERSION:
            raise ValueError(f"version {body.get('version')!r}, not {JOURNAL_VERSION}")
        key, record = str(body["key"]), ClosedRecord(str(body["record"]), float(body["expires_at"]))
        if not round_key(key):
            raise ValueError(f"{key!r} is no job's round record")
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise UsageError(
            f"--state-dir: {path} is not a closed-job record of this version ({e}); "
            "move it away to start without it"
        ) from None
    return key, record


def _private_folder(folder: Path) -> None:
    """Make `folder` (0700) or check that only this user can write in it.

    Whoever can put a file there could end any job, or keep one from ending."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(folder)
    except OSError as e:
        raise UsageError(f"--state-dir: cannot create {folder}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"--state-dir: {folder} is not a folder (a link is not taken either)")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise UsageError(
            f"--state-dir: {folder} must belong to this user and be writable by no one else (chmod 700)"
        )
