"""Every rank's last commit on two nodes: its own, and its buddy's (the next node of the round).

In restart mode each worker commits its state into a file its agent owns
(elasticrun.agent.state_files). This agent also:

- **sends** each of its files' newest whole commit, when a newer one appears (it looks
  every LOOK_INTERVAL: the records only), to its buddy, the node after it in the
  round's node-rank order (a ring; none in a round of one node). Where the worker pinned
  a candidate (a ShardedState: elasticrun.worker.elastic.buddy_pins), it sends that
  commit first, and once the buddy holds it, says so in the file (the ack): every rank
  sends the same commits and keeps them until every buddy holds them, so a lost node's
  ranks always have a commit in common with the others, however far the copies lag; the
  newest then goes too (NEWER), for when the commits pause or come slower than the
  copies, and the buddy keeps it while it is the newest. It sends at most
  BANDWIDTH bytes a second, so the copy never takes the network from the training's
  collectives; it reads the commit where the worker wrote it, and a commit whose slot
  the worker wrote again while it was read is not kept by the buddy (next look, the
  newer one goes).
- **keeps** what its predecessor sends, in a replica file per global rank on /dev/shm
  with the same layout (the last two candidates received, pinned, and the newest), made as the state
  files are (O_EXCL, 0600, removed when the agent ends, by its warden if it is killed).
  Only its predecessor's ranks of the current round are taken and kept.
- **restores**, at a round's start and before its workers start: a local rank whose file
  holds no commit of its new global rank at the round's world size (a newcomer that took
  a lost node's place: elasticrun.rendezvous.round_policy keeps node ranks where it can)
  is given the commits the node after it holds of that rank, written into its file; the
  worker's own restore then takes them (`state.restored_from` "buddy", from
  STATE_BUDDY_VAR, in that round only). In its file they are the node's own: the next
  look sends them to this node's buddy, with no new commit needed. A rank whose commit
  is nowhere (a node lost with its buddy) is said in one line; its worker finds no
  commit and the script's own checkpoint path runs.

Nodes find each other through one record per node rank in the store (`ReplicaPost`,
c/replicas/<node rank>, on the node's lease): its address, its replica port, and the
ranks whose copies it holds. Who may talk on the port, and the format, is
elasticrun.agent.replica_wire's.

Memory: a node holds its own files and one replica file per rank of its predecessor,
each of `--state-memory` and taken only as commits fill it: with nodes of the same size,
up to twice `--state-memory` per local rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elasticrun.agent.commit_files import CommitFile, payload_bytes
from elasticrun.agent.replica_wire import (
    BUFFER,
    CHUNK,
    GET,
    NEWER,
    PUT,
    TORN,
    WHICH,
    WHOLE,
    ReplicaProtocolError,
    accept,
    connect,
    read,
)
from elasticrun.agent.state_files import StateFiles
from elasticrun.errors import StateMemoryError, StoreError
from elasticrun.rendezvous.handler import Assignment, JobControl
from elasticrun.rendezvous.records import ReplicaPost
from elasticrun.state_layout import (
    RECORD_BYTES,
    SLOTS,
    STATE_BUDDY_VAR,
    STATE_REPLICAS_VAR,
    Record,
    parsed_record,
    slot_bytes_of,
)

logger = logging.getLogger("elasticrun.agent")

#: seconds between looks at the state files' records
LOOK_INTERVAL = 0.5
#: bytes a second an agent sends its buddy at most: 200 MiB/s (1.7 Gbit/s), a few per
#: cent of a training node's network; a 1 GiB commit per rank of 8 takes 40 s to copy,
#: and a commit made in the meantime waits for the next look (docs/in-process.md)
BANDWIDTH = 200 << 20
#: how long a node waits at a round's start for the post of the node it needs
FIND_TIMEOUT = 30.0
_NOT_A_COMMIT = "not a commit record, or a commit too big for this node's --state-memory"


@dataclass(frozen=True, slots=True)
class _Ring:
    """This node's neighbours in one round."""

    round: int
    #: the node after it, which keeps its commits (None: a round of one node)
    buddy: ReplicaPost | None
    #: the node before it, whose commits it keeps (None: a round of one node)
    predecessor: ReplicaPost | None


class StateReplicas:
    """This agent's side of the replication: its port, its sends, its replicas, its restores."""

    def __init__(
        self,
        files: StateFiles,
        replicas: StateFiles,
        control: JobControl,
        node_id: str,
        key: bytes,
        on_change: Callable[[], None],
    ) -> None:
        """`files`: the workers' state files; `replicas`: where the predecessor's commits go (kind "replica")."""
        self._files = files
        self._control = control
        self._node_id = node_id
        self._key = key
        self._replicas = replicas
        self._slot_bytes = slot_bytes_of(replicas.size)
        self._on_change = on_change
        self._server: asyncio.Server | None = None
        #: the connections being served
        self._handlers: set[asyncio.Task[object]] = set()
        self.port = 0
        self._task: asyncio.Task[None] | None = None
        self._assignment: Assignment | None = None
        self._ring: _Ring | None = None
        self._opened: dict[Path, CommitFile] = {}
        #: per global rank, a lock over its replica file: one request at a time
        self._locks: dict[int, asyncio.Lock] = {}
        #: per global rank and request (PUT, NEWER), what the buddy holds of it: (buddy node id,
        #: commits, round made in)
        self._sent: dict[tuple[int, bytes], tuple[str, int, int]] = {}
        #: per global rank, the generation of its newest commit at the last look
        self._seen: dict[int, int] = {}
        #: the buddy a copy to failed last, said once
        self._said: str = ""
        #: per local rank, the generations of the commits fetched from a buddy into its file
        #: at this round's start (a later round's restore of them is from this node's memory)
        self._fetched: dict[int, str] = {}
        self.held = -1
        self.replicated = -1

    # --- life -------------------------------------------------------------------------

    async def start(self) -> bool:
        """Open the replica port on the node's address and start the sending; False (said) if no port can be had."""
        try:
            self._server = await asyncio.start_server(self._serve, host=self._control.addr, port=0, limit=BUFFER)
        except OSError as e:
            logger.warning(
                "no state replicas: cannot listen on %s (%s); this node's commits are kept on this node only",
                self._control.addr, e,
            )
            self._replicas.close()
            return False
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("state replicas: this node takes its predecessor's commits on %s:%d", self._control.addr, self.port)
        self._task = asyncio.create_task(self._send_loop())
        self._task.add_done_callback(self._ended)
        return True

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The sending stopped on an error nobody foresaw: said once, the node trains on without copies."""
        if not task.cancelled() and task.exception() is not None:
            logger.error(
                "the state replication stopped: %r; this node's commits are no longer copied to its buddy",
                task.exception(),
            )
            self.replicated = -1
            self._on_change()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(OSError):
                await self._server.wait_closed()
        for handler in list(self._handlers):  # the connections in progress: their files go next
            handler.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        for opened in self._opened.values():
            opened.close()
        self._opened.clear()
        self._replicas.close()

    def _file(self, path: Path) -> CommitFile:
        opened = self._opened.get(path)
        if opened is None:
            opened = self._opened[path] = CommitFile(path)
        return opened

    def _forget(self, path: Path) -> None:
        opened = self._opened.pop(path, None)
        if opened is not None:
            opened.close()

    # --- a round starts -----------------------------------------------------------------

    async def round_starts(self, assignment: Assignment, nproc: int) -> dict[int, dict[str, str]]:
        """Post where this node takes its predecessor's commits; fetch what its ranks lack.

        Returns what to add to each local rank's environment (STATE_BUDDY_VAR)."""
        self._assignment, self._ring, self._fetched = assignment, None, {}
        own = [self._file(self._files.path(r)) for r in range(nproc)]
        newest = max((c for f in own for c in f.held()), key=lambda c: (c.round, c.commits), default=None)
        post = ReplicaPost(
            round=assignment.round, node_id=self._node_id, addr=self._control.addr, port=self.port,
            first_rank=assignment.rank_offset, nproc=nproc, held=tuple(sorted(self._replicas.made())),
            committed=newest.commits if newest else -1, committed_world=newest.world if newest else 0,
        )
        with contextlib.suppress(StoreError):
            await self._control.post_replicas(assignment.node_rank, post)
        world = assignment.world_size
        lacking = [
            r for r, f in enumerate(own)
            if not any(c.rank == assignment.rank_offset + r and c.world == world for c in f.held())
        ]
        if lacking and assignment.node_count > 1:
            await self._fetch(assignment, own, lacking)
        self._report()
        env = {r: {STATE_BUDDY_VAR: gens} for r, gens in self._fetched.items()}
        held = ",".join(str(path) for path in self._replicas.made().values())
        if held:  # a ShardedState at a new world size offers them to re-shard from
            env.setdefault(0, {})[STATE_REPLICAS_VAR] = held
        return env

    async def _fetch(self, a: Assignment, own: list[CommitFile], lacking: list[int]) -> None:
        after = (a.node_rank + 1) % a.node_count
        try:
            holder = await self._control.replica_post(after, a.round, FIND_TIMEOUT)
        except StoreError as e:
            logger.warning("could not look for the state of this node's ranks: %s", e)
            return
        if holder is None:  # no post in time, or the round is over already: nothing known
            logger.debug("node rank %d posted nothing in round %d", after, a.round)
            return
        missing = []
        for local_rank in lacking:
            rank = a.rank_offset + local_rank
            got = []
            if rank in holder.held:
                try:
                    got = await self._get(holder, rank, a.world_size, own[local_rank])
                except (OSError, TimeoutError, ReplicaProtocolError, StateMemoryError) as e:
                    logger.warning("could not fetch rank %d's state from node %s: %s", rank, holder.node_id, e)
            if got:
                self._fetched[local_rank] = ",".join(str(r.generation) for r in got)
                logger.info(
                    "rank %d's state comes from its buddy node %s: commit %d", rank, holder.node_id,
                    got[-1].commits,
                )
            else:
                missing.append(rank)
        if missing and await self._job_had_state(a, holder):
            logger.warning(
                "the state of ranks %s (node rank %d) is nowhere: neither this node nor its buddy node %s "
                "(node rank %d) holds a commit of them, lost with the node that ran them before; their workers "
                "start without it (state.restored False: the script's own checkpoint)",
                ",".join(map(str, missing)), a.node_rank, holder.node_id, after,
            )

    async def _job_had_state(self, a: Assignment, holder: ReplicaPost) -> bool:
        """Whether the node after this one or the one before holds commits made at this world size: state was lost.

        (A job's first round has none anywhere, and where the world size changed the
        shards are the script's to re-shard (`ShardedState.earlier`): nothing to say
        then. A job that lost every node of a round at once has no one left who knows.)"""
        before = (a.node_rank - 1) % a.node_count
        posts: list[ReplicaPost | None] = [holder]
        if before != (a.node_rank + 1) % a.node_count:
            with contextlib.suppress(StoreError):
                posts.append(await self._control.replica_post(before, a.round, FIND_TIMEOUT))
        return any(p is not None and p.committed >= 0 and p.committed_world == a.world_size for p in posts)

    async def _get(self, holder: ReplicaPost, rank: int, world: int, into: CommitFile) -> list[Record]:
        """The commits `holder` keeps of `rank` at world size `world`, written into `into`, oldest first."""
        reader, writer = await connect(holder.addr, holder.port, self._key)
        written: list[Record] = []
        try:
            writer.write(GET + WHICH.pack(rank, world))
            await writer.drain()
            count = (await read(reader, 1))[0]
            if count > SLOTS:
                raise ReplicaProtocolError(f"{count} commits announced (at most {SLOTS})")
            into.pin(0, 0)  # a worker's pins from another rank's commits: none of them is kept now
            for _ in range(count):
                raw = await read(reader, RECORD_BYTES)
                record = into.fits(raw)
                if record is None:
                    raise ReplicaProtocolError(_NOT_A_COMMIT)
                if record.rank != rank or record.world != world:
                    raise ReplicaProtocolError(
                        f"sent a commit of rank {record.rank} at world size {record.world}: not asked for"
                    )
                slot, at = into.begin(record, frozenset(r.slot for r in written))
                await _receive(reader, into, at, payload_bytes(record))
                done = into.finish(slot, raw)
                if done is not None:
                    written.append(done)
        finally:
            writer.close()
        return written

    # --- sending ------------------------------------------------------------------------

    async def _send_loop(self) -> None:
        while True:
            await asyncio.sleep(LOOK_INTERVAL)
            a = self._assignment
            if a is None or a.node_count < 2:
                self._report()
                continue
            ring = self._ring
            if ring is None or ring.round != a.round:
                ring = self._ring = await self._find_ring(a)
            if ring.predecessor is not None and self._moved_on(a.round):
                self._keep_only(ring.predecessor)
            for path in self._files.made().values():
                if ring.buddy is not None:
                    await self._send(ring.buddy, self._file(path))
            self._report()

    async def _send(self, buddy: ReplicaPost, source: CommitFile) -> None:
        """Send `source`'s candidate (else its newest) if the buddy lacks it, and ack it once the buddy holds it.

        Then the newest commit, if it is the one the last look saw too: the commits paused,
        or come slower than the looks (a newest sent while commits come faster would be
        overwritten on the other ranks before it arrived: it would only slow the candidates)."""
        held = source.held()
        candidate = source.candidate()
        pinned = [r for r in held if r.generation == candidate]
        if not held or (candidate and not pinned):  # none, or being written: next look
            return
        seen = self._seen.get(held[-1].rank)
        first = pinned[0] if pinned else held[-1]
        if not await self._holds(buddy, source, first, PUT):
            return
        source.acknowledge(first.generation)
        newest, self._seen[first.rank] = held[-1], held[-1].generation
        if newest != first and seen == newest.generation:
            await self._holds(buddy, source, newest, NEWER)

    async def _holds(self, buddy: ReplicaPost, source: CommitFile, record: Record, op: bytes) -> bool:
        """Whether `buddy` holds `record` (sent now with `op` if it did not)."""
        sent = (buddy.node_id, record.commits, record.round)
        if self._sent.get((record.rank, op)) != sent:
            await self._put(buddy, source, record, op)
        return self._sent.get((record.rank, op)) == sent

    async def _find_ring(self, a: Assignment) -> _Ring:
        after = (a.node_rank + 1) % a.node_count
        before = (a.node_rank - 1) % a.node_count
        try:
            buddy = await self._control.replica_post(after, a.round, FIND_TIMEOUT)
            predecessor = await self._control.replica_post(before, a.round, FIND_TIMEOUT)
        except StoreError as e:
            logger.debug("could not read the replica posts: %s", e)
            buddy = predecessor = None
        return _Ring(a.round, buddy, predecessor)

    def _moved_on(self, round_number: int) -> bool:
        """Whether every worker here committed in round `round_number`: past their start.

        Until then a ShardedState at a new world size may re-shard from the replicas
        (STATE_REPLICAS_VAR), so they are kept."""
        newest = [self._file(p).newest() for p in self._files.made().values()]
        return bool(newest) and all(c is not None and c.round == round_number for c in newest)

    def _keep_only(self, predecessor: ReplicaPost) -> None:
        """Drop the replicas of ranks that are not the predecessor's now: nobody will ask for them.

        (A node that took a lost member's place has its ranks, and fetched them from
        here before its workers started; the predecessor posts before it fetches.)"""
        keep = range(predecessor.first_rank, predecessor.first_rank + predecessor.nproc)
        for rank, path in self._replicas.made().items():
            if rank not in keep:
                self._forget(path)
                self._replicas.remove(rank)

    async def _put(self, buddy: ReplicaPost, source: CommitFile, record: Record, op: bytes) -> None:
        """Send one commit to `buddy` (request `op`: PUT or NEWER), at most BANDWIDTH bytes a second."""
        try:
            reader, writer = await connect(buddy.addr, buddy.port, self._key)
            try:
                writer.write(op + source.raw_record(record))
                await writer.drain()
                if await read(reader, 1) != WHOLE:
                    return  # the buddy does not know this node is its predecessor yet: next look
                await _write_commit(writer, source, record, BANDWIDTH)
                writer.write(WHOLE if source.still(record) else TORN)
                await writer.drain()
                kept = await read(reader, 1) == WHOLE
            finally:
                writer.close()
        except (OSError, TimeoutError, ReplicaProtocolError) as e:
            if buddy.node_id != self._said:  # once per buddy: a dead one fails in several ways until the round ends
                self._said = buddy.node_id
                logger.warning(
                    "could not copy rank %d's commit to its buddy node %s: %s", record.rank, buddy.node_id, e
                )
            return
        self._said = ""  # through again: a later failure is news
        if kept:
            self._sent[(record.rank, op)] = (buddy.node_id, record.commits, record.round)

    def _report(self) -> None:
        """The least commit count held, and held by the buddy too, over this node's ranks; said when it changed."""
        a = self._assignment
        newest = [self._file(p).newest() for p in self._files.made().values()]
        held = min((r.commits if r is not None else -1 for r in newest), default=-1)
        buddy = self._ring.buddy if self._ring is not None else None
        replicated = -1
        if a is not None and buddy is not None and newest and all(r is not None for r in newest):
            kept = [
                [s[1] for s in (self._sent.get((r.rank, op)) for op in (PUT, NEWER)) if s and s[0] == buddy.node_id]
                for r in newest if r is not None
            ]
            if all(kept):
                replicated = min(max(commits) for commits in kept)
        if (held, replicated) != (self.held, self.replicated):
            self.held, self.replicated = held, replicated
            self._on_change()

    # --- serving ------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        me = asyncio.current_task()
        if me is not None:
            self._handlers.add(me)
        try:
            await accept(reader, writer, self._key)
            op = await read(reader, 1)
            if op in (PUT, NEWER):
                await self._take(reader, writer, op == PUT)
            elif op == GET:
                await self._give(reader, writer)
            else:
                raise ReplicaProtocolError(f"unknown request {op!r}")
        except ReplicaProtocolError as e:
            logger.warning("refused a connection to the replica port from %s: %s", peer, e)
        except (OSError, StateMemoryError) as e:
            logger.warning("a replica request from %s failed: %s", peer, e)
        finally:
            writer.close()
            self._handlers.discard(me)

    async def _take(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, candidate: bool) -> None:
        """Keep a commit the predecessor sends; a `candidate` (a PUT) is pinned with the one before it."""
        raw = await read(reader, RECORD_BYTES)
        record = parsed_record(raw, 0, self._slot_bytes)
        if record is None:
            raise ReplicaProtocolError(_NOT_A_COMMIT)
        ring = self._ring
        mine = ring.predecessor if ring is not None else None
        if mine is None:  # this node does not know its predecessor yet: the sender tries again
            writer.write(TORN)
            await writer.drain()
            return
        if not mine.first_rank <= record.rank < mine.first_rank + mine.nproc:
            raise ReplicaProtocolError(f"rank {record.rank} is not its predecessor's (node {mine.node_id})")
        writer.write(WHOLE)
        async with self._locks.setdefault(record.rank, asyncio.Lock()):
            replica = self._file(self._replicas.path(record.rank))
            slot, at = replica.begin(record)
            await _receive(reader, replica, at, payload_bytes(record))
            whole = await read(reader, 1) == WHOLE
            done = replica.finish(slot, raw) if whole else None
            if done is not None and candidate:
                replica.pin(done.generation, replica.candidate())
        writer.write(WHOLE if done is not None else TORN)
        await writer.drain()

    async def _give(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rank, world = WHICH.unpack(await read(reader, WHICH.size))
        path = self._replicas.made().get(rank)
        async with self._locks.setdefault(rank, asyncio.Lock()):
            held = [r for r in self._file(path).held() if (r.rank, r.world) == (rank, world)] if path else []
            writer.write(bytes([len(held)]))
            for record in held:
                replica = self._file(path)  # type: ignore[arg-type]  # held: it is there
                writer.write(replica.raw_record(record))
                await _write_commit(writer, replica, record)
            await writer.drain()


async def _write_commit(
    writer: asyncio.StreamWriter, source: CommitFile, record: Record, bandwidth: float | None = None
) -> None:
    """`record`'s bytes from `source` to `writer`, a chunk at a time (at most `bandwidth` bytes a second).

    Each chunk goes as bytes of its own, and the view of the file is released before
    this returns, cancelled or not: a mapping with a view left on it cannot be closed,
    and the agent closes its files when it ends, sends in flight or not."""
    started = time.monotonic()
    with source.payload(record) as data:
        for at in range(0, len(data), CHUNK):
            writer.write(bytes(data[at : at + CHUNK]))
            await writer.drain()
            ahead = (at + CHUNK) / bandwidth - (time.monotonic() - started) if bandwidth else 0.0
            if ahead > 0:
                await asyncio.sleep(ahead)


async def _receive(reader: asyncio.StreamReader, into: CommitFile, at: int, size: int) -> None:
    """`size` bytes from `reader` into `into` at `at`, a chunk at a time."""
    end = at + size
    while at < end:
        chunk = await read(reader, min(CHUNK, end - at))
        into.write(at, chunk)
        at += len(chunk)
