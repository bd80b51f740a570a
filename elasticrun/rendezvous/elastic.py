"""The elastic rendezvous: leader-driven rounds over any `Store`.

Every node holds a lease and registers under it; one node (whoever holds the
lease-bound `job/leader` key) watches the registrations and writes rounds, deciding with
the pure `decide()`. Every node watches `job/` and runs the rounds it is in. A node that
dies vanishes when its lease expires; one that leaves on purpose revokes its lease, so
the leader sees it go at once.

The same class serves the built-in store, etcd, and `--standalone` (an in-memory store):
the store is the only thing that differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import replace

from elasticrun.errors import (
    LeaseExpiredError,
    RendezvousClosedError,
    RendezvousTimeoutError,
    SpecMismatchError,
    StoreError,
)
from elasticrun.rendezvous.api import AgentStatus, Assignment, RendezvousHandler
from elasticrun.rendezvous.decide import Decision, RendezvousSettings, SeenNode, View, decide
from elasticrun.rendezvous.state import (
    DrainRequest,
    Event,
    JobLaunch,
    Keys,
    LogLine,
    LogWindow,
    NodeStatus,
    LeaderState,
    Master,
    NodeInfo,
    Ping,
    RestartRequest,
    Round,
    decode_drain,
    decode_master,
    decode_node,
    decode_ping,
    decode_restart,
    decode_round,
    decode_spec,
    decode_state,
    encode,
    encode_spec,
)
from elasticrun.rendezvous.store import EventType, KeyValue, RangeResult, Store, WatchEvent

log = logging.getLogger("elasticrun.rendezvous")

#: a failure report kept in the closed round record is cut to this many characters
_DETAIL_LIMIT = 16_000
#: the leader publishes its waiting reason at most this often
_STATE_MIN_INTERVAL = 1.0
#: a node publishes its status, output windows and events at most this often
_REPORT_INTERVAL = 0.5
#: lines of each rank's output kept in the store, and the longest line kept whole
LOG_WINDOW_LINES = 100
_LOG_LINE_CHARS = 1000
#: events kept in the store (the leader prunes older ones)
EVENTS_KEPT = 200


def free_port(addr: str) -> int:
    """A TCP port that is free on `addr` now, for the workers' MASTER_PORT."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


class _Pulse:
    """Wakes every waiter when something they may care about changed."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float | None = None) -> None:
        # asyncio.timeout, not wait_for: wait_for can swallow a cancellation (gh-86296).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._event.wait()


class ElasticRendezvous(RendezvousHandler):
    """One node's membership in an elastic job."""

    def __init__(
        self,
        store: Store,
        settings: RendezvousSettings,
        me: NodeInfo,
        *,
        spec: Mapping[str, object],
        clock: Callable[[], float] = time.monotonic,
        pick_port: Callable[[str], int] = free_port,
    ) -> None:
        self.run_id = settings.run_id
        self._store = store
        self._settings = settings
        self._me = me
        self._spec = dict(spec)
        self._clock = clock
        self._pick_port = pick_port
        self._keys = Keys(settings.run_id)
        self._pulse = _Pulse()
        self._lease: int | None = None
        self._lost: str = ""
        self._tasks: set[asyncio.Task[None]] = set()
        self._leader_task: asyncio.Task[None] | None = None
        # what this node knows of job/
        self._round: Round | None = None
        self._master: Master | None = None
        self._state: LeaderState | None = None
        self._drain: DrainRequest | None = None
        self._last_round = 0
        # reports for job control, published in the background
        self._report_due = asyncio.Event()
        self._status: AgentStatus | None = None
        self._status_dirty = False
        self._windows: dict[int, deque[LogLine]] = {}
        self._line_seq: dict[int, int] = {}
        self._dirty_logs: set[int] = set()
        self._events: list[Event] = []

    # --- RendezvousHandler -----------------------------------------------------------

    @property
    def waiting_status(self) -> str:
        return self._state.reason if self._state else "waiting for the leader's first decision"

    async def drained(self) -> str:
        while self._drain is None:
            await self._pulse.wait()
        return f"drained: {self._drain.reason}"

    def report_status(self, status: AgentStatus) -> None:
        self._status, self._status_dirty = status, True
        self._report_due.set()

    def report_output(self, rank: int, stream: str, lines: list[str]) -> None:
        window = self._windows.setdefault(rank, deque(maxlen=LOG_WINDOW_LINES))
        seq = self._line_seq.get(rank, 0)
        for text in lines[-LOG_WINDOW_LINES:]:
            seq += 1
            window.append(LogLine(seq=seq, stream=stream, text=text[:_LOG_LINE_CHARS]))
        self._line_seq[rank] = seq + max(len(lines) - LOG_WINDOW_LINES, 0)
        self._dirty_logs.add(rank)
        self._report_due.set()

    def report_event(self, kind: str, detail: str) -> None:
        self._events.append(Event(at=time.time(), node=self._me.node_id, kind=kind, detail=detail))
        self._report_due.set()

    async def next_round(self) -> Assignment:
        deadline = self._clock() + self._settings.join_timeout
        logged = ""
        while True:
            if self._lease is None or self._lost:
                await self._register()
            current = self._round
            if current is not None and current.closed:
                raise RendezvousClosedError(self.run_id, current.closed, current.detail)
            rank = current.rank_of(self._me.node_id) if current else None
            if current is not None and rank is not None and current.number > self._last_round:
                master = await self._master_of(current, rank)
                if master is not None:
                    self._last_round = current.number
                    return self._assignment(current, rank, master)
                continue
            status = self.waiting_status
            if status != logged:
                log.info("node %s waiting: %s", self._me.node_id, status)
                logged = status
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise RendezvousTimeoutError(
                    f"no round of job '{self.run_id}' took node {self._me.node_id} within "
                    f"join_timeout={self._settings.join_timeout:g}s; last state: {status} "
                    "(start more nodes, or raise join_timeout with --rdzv-conf)"
                )
            await self._pulse.wait(remaining)

    async def round_ended(self) -> str:
        while True:
            if self._lost:
                return f"node {self._me.node_id} lost its membership: {self._lost}"
            current = self._round
            if current is None:
                return "the round record vanished from the store"
            if current.number != self._last_round:
                return f"round {current.number}: {current.reason}"
            if current.closed and current.closed != "succeeded":
                return f"job {current.closed}"
            await self._pulse.wait()

    async def request_restart(self, reason: str) -> None:
        request = RestartRequest(round=self._last_round, node_id=self._me.node_id, reason=reason)
        await self._store.put(self._keys.restart, encode(request))

    async def fail(self, report: str) -> None:
        """Ask the leader to end the job with `report`.

        It does, once every member shows it is alive; a member that died instead is
        what broke our workers, and the leader opens a new round without it.
        """
        first_line = next((ln.strip() for ln in report.splitlines() if any(c.isalnum() for c in ln)), "workers failed")
        request = RestartRequest(
            round=self._last_round,
            node_id=self._me.node_id,
            reason=first_line,
            final=True,
            report=report[-_DETAIL_LIMIT:],
        )
        await self._store.put(self._keys.restart, encode(request))

    async def finish(self) -> None:
        await self._close("succeeded", f"workers of {self._me.node_id} succeeded")
        await self.aclose()

    async def leave(self, reason: str) -> None:
        log.info("node %s leaving job '%s': %s", self._me.node_id, self.run_id, reason)
        self.report_event("left", reason)
        await self._flush_reports()
        await self.aclose()
        if self._drain is not None:
            with contextlib.suppress(StoreError):
                await self._store.delete(self._keys.drain(self._me.node_id))

    async def stop_job(self, reason: str) -> None:
        """End the job for every node: workers are stopped, agents exit 0."""
        await self._close("stopped", reason)

    async def aclose(self) -> None:
        """Stop the background tasks and give up the lease (deleting our keys now)."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, StoreError):
                await task
        self._tasks.clear()
        lease, self._lease = self._lease, None
        if lease is not None and not self._lost:
            with contextlib.suppress(StoreError):
                await self._store.revoke_lease(lease)

    # --- membership -------------------------------------------------------------------

    async def _register(self) -> None:
        """Take a lease, check the job spec, register, and start watching."""
        await self.aclose()
        self._lost = ""
        keys = self._keys
        snapshot = await self._reread_job()
        if self._round is not None and self._round.closed:
            raise RendezvousClosedError(self.run_id, self._round.closed, self._round.detail)
        await self._check_spec()
        self._lease = await self._store.grant_lease(self._settings.heartbeat_ttl)
        await self._store.put(keys.node(self._me.node_id), encode(self._me), lease=self._lease)
        self._spawn(self._keep_alive(self._lease))
        self._spawn(self._watch_job(snapshot.revision + 1))
        self._spawn(self._publish_reports())
        await self._try_lead()

    async def _check_spec(self) -> None:
        raw = encode_spec(self._spec)
        if await self._store.compare_and_put(self._keys.spec, raw, expected_mod_revision=0):
            # A new job: the events of an earlier job with this id go.
            await self._store.delete_prefix(self._keys.events)
            launch = JobLaunch(cwd=os.getcwd(), created_at=time.time(), created_by=self._me.node_id)
            await self._store.put(self._keys.launch, encode(launch))
            return
        stored = await self._store.get(self._keys.spec)
        if stored is None:  # closed and cleared in between: ours is the new spec
            await self._store.put(self._keys.spec, raw)
            return
        theirs = decode_spec(stored.value)
        differ = sorted(k for k in set(theirs) | set(self._spec) if theirs.get(k) != self._spec.get(k))
        if differ:
            detail = "; ".join(f"{k}: job has {theirs.get(k)!r}, this node {self._spec.get(k)!r}" for k in differ)
            raise SpecMismatchError(
                f"this node's job spec differs from the running job '{self.run_id}' ({detail}); "
                "start it with the same arguments, or use another --rdzv-id"
            )

    async def _keep_alive(self, lease: int) -> None:
        interval = self._settings.keep_alive_interval
        last_ok = self._clock()
        while True:
            await asyncio.sleep(interval)
            try:
                await self._store.keep_alive(lease)
                last_ok = self._clock()
            except LeaseExpiredError:
                return self._lose("its lease expired")
            except StoreError as e:
                silent = self._clock() - last_ok
                if silent >= self._settings.heartbeat_ttl:
                    return self._lose(f"the store was unreachable for {silent:.1f}s: {e}")
                log.warning("keep-alive failed (%s); retrying", e)

    def _lose(self, why: str) -> None:
        log.warning("node %s lost its membership: %s", self._me.node_id, why)
        self._lost = why
        if self._leader_task is not None:
            self._leader_task.cancel()
        self._pulse.fire()

    async def _watch_job(self, start_revision: int) -> None:
        """Follow job/ (round, master, leader, state) for as long as we are registered."""
        while True:
            try:
                async for event in self._store.watch(self._keys.job, start_revision=start_revision, prefix=True):
                    start_revision = event.revision + 1
                    self._apply_job(event.key, event.value if event.type is EventType.PUT else None)
                    if event.key == self._keys.leader and event.type is EventType.DELETE:
                        await self._try_lead()
                    elif event.key == self._keys.ping and event.type is EventType.PUT:
                        await self._answer_ping(decode_ping(event.value))
                    self._pulse.fire()
            except StoreError as e:
                log.warning("watch on job '%s' broke (%s); re-reading", self.run_id, e)
                await asyncio.sleep(self._settings.keep_alive_interval)
                start_revision = (await self._reread_job()).revision + 1
                self._pulse.fire()

    async def _answer_ping(self, ping: Ping) -> None:
        """Show the leader we are alive, so a failure is told apart from a death."""
        if self._lease is not None and not self._lost:
            await self._store.put(self._keys.ack(self._me.node_id), encode(ping), lease=self._lease)

    async def _reread_job(self) -> RangeResult:
        snapshot = await self._store.get_prefix(self._keys.job)
        self._round = self._master = self._state = self._drain = None
        for kv in snapshot.kvs:
            self._apply_job(kv.key, kv.value)
        return snapshot

    def _apply_job(self, key: str, value: bytes | None) -> None:
        keys = self._keys
        if key == keys.round:
            self._round = decode_round(value) if value else None
        elif key == keys.master:
            self._master = decode_master(value) if value else None
        elif key == keys.state:
            self._state = decode_state(value) if value else None
        elif key == keys.drain(self._me.node_id):
            self._drain = decode_drain(value) if value else None

    async def _master_of(self, current: Round, rank: int) -> Master | None:
        """The round's master address; node rank 0 picks a port and publishes it."""
        if rank == 0:
            master = Master(round=current.number, addr=self._me.addr, port=self._pick_port(self._me.addr))
            await self._store.put(self._keys.master, encode(master), lease=self._lease or 0)
            self._master = master
            return master
        while True:
            if self._master is not None and self._master.round == current.number:
                return self._master
            if self._lost or self._round is not current:
                return None
            await self._pulse.wait()

    def _assignment(self, current: Round, rank: int, master: Master) -> Assignment:
        offset = sum(p.nproc for p in current.participants[:rank])
        return Assignment(
            round=current.number,
            node_rank=rank,
            node_count=len(current.participants),
            rank_offset=offset,
            world_size=current.world_size,
            master_addr=master.addr,
            master_port=master.port,
            restart_count=current.restart_count,
        )

    async def _close(self, outcome: str, detail: str) -> None:
        await close_job(self._store, self._keys, outcome, detail, self._settings.closed_ttl)

    async def _publish_reports(self) -> None:
        """Publish what the agent reported, batched: at most one batch per interval."""
        while True:
            await self._report_due.wait()
            try:
                await self._flush_reports()
            except StoreError as e:
                log.debug("could not publish this node's status: %s", e)
            await asyncio.sleep(_REPORT_INTERVAL)

    async def _flush_reports(self) -> None:
        self._report_due.clear()
        keys, lease = self._keys, self._lease or 0
        if lease and self._status_dirty and self._status is not None:
            self._status_dirty = False
            await self._store.put(keys.status(self._me.node_id), encode(self._node_status(self._status)), lease=lease)
        while lease and self._dirty_logs:
            rank = self._dirty_logs.pop()
            window = LogWindow(rank=rank, node_id=self._me.node_id, lines=tuple(self._windows[rank]))
            await self._store.put(keys.log(rank), encode(window), lease=lease)
        while self._events:
            event = self._events.pop(0)
            await self._store.put(keys.event(event.at, event.node), encode(event))

    def _node_status(self, status: AgentStatus) -> NodeStatus:
        a, me = status.assignment, self._me
        return NodeStatus(
            node_id=me.node_id,
            host=me.host,
            addr=me.addr,
            state=status.state,
            reason=status.reason,
            round=a.round if a else 0,
            node_rank=a.node_rank if a else -1,
            ranks=f"{a.rank_offset}-{a.rank_offset + me.nproc - 1}" if a else "",
            world_size=a.world_size if a else 0,
            restarts=a.restart_count if a else 0,
            attempt=status.attempt,
            pids=status.pids,
            gpus=me.gpus,
            started_at=me.started_at,
            updated_at=time.time(),
        )

    def _spawn(self, coro: object) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- leadership -------------------------------------------------------------------

    async def _try_lead(self) -> None:
        if self._lease is None or self._lost:
            return
        me = self._me.node_id.encode()
        if await self._store.compare_and_put(self._keys.leader, me, expected_mod_revision=0, lease=self._lease):
            log.info("node %s leads job '%s'", self._me.node_id, self.run_id)
            self._leader_task = self._spawn(_Leader(self).run())


class _Leader:
    """The leader's loop: keep a `View` up to date from one watch, decide, write rounds."""

    def __init__(self, rdzv: ElasticRendezvous) -> None:
        self._rdzv = rdzv
        self._store = rdzv._store
        self._keys = rdzv._keys
        self._settings = rdzv._settings
        self._clock = rdzv._clock
        self._nodes: dict[str, SeenNode] = {}
        self._round: Round | None = None
        self._round_rev = 0
        self._restart: RestartRequest | None = None
        self._restart_seen_at = 0.0
        self._acks: dict[str, int] = {}  # node -> the round its last ack answered
        self._pinged = 0
        self._published = ""
        self._published_at = -1e9

    async def run(self) -> None:
        """Lead until cancelled (this node left or lost its lease).

        A store failure (a watch that broke, a write that timed out) does not end the
        leadership: the leader re-reads the job and goes on. Dying silently would leave
        the leader key held by a live lease, and no round would ever be decided again.
        """
        while True:
            try:
                await self._lead()
            except StoreError as e:
                log.warning("leader of job '%s': store call failed (%s); re-reading", self._settings.run_id, e)
                await asyncio.sleep(self._settings.keep_alive_interval)

    async def _lead(self) -> None:
        snapshot = await self._store.get_prefix(self._keys.rdzv)
        self._resync(snapshot)
        events: asyncio.Queue[WatchEvent | StoreError] = asyncio.Queue()
        pump = asyncio.ensure_future(self._pump(snapshot.revision + 1, events))
        try:
            awaiting_write = False
            while True:
                recheck: float | None = None
                if not awaiting_write:
                    decision = decide(self._view(), self._settings, self._clock())
                    awaiting_write = await self._act(decision)
                    recheck = decision.recheck_at
                    if self._published != decision.reason:
                        recheck = _earliest(recheck, await self._publish(decision))
                timeout = None if recheck is None else max(recheck - self._clock(), 0.0)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        event = await events.get()
                    awaiting_write = self._apply_event(event, awaiting_write)
                    while not events.empty():
                        awaiting_write = self._apply_event(events.get_nowait(), awaiting_write)
        finally:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump

    async def _pump(self, start: int, events: asyncio.Queue[WatchEvent | StoreError]) -> None:
        try:
            async for event in self._store.watch(self._keys.rdzv, start_revision=start, prefix=True):
                events.put_nowait(event)
        except StoreError as e:  # handed to the leader's loop, which re-reads
            events.put_nowait(e)

    def _resync(self, snapshot: RangeResult) -> None:
        """Fold a fresh snapshot in: what vanished meanwhile goes, the rest is updated."""
        present = {kv.key for kv in snapshot.kvs}
        for node_id in [n for n in self._nodes if self._keys.node(n) not in present]:
            del self._nodes[node_id]
        if self._keys.round not in present:
            self._round, self._round_rev = None, 0
        if self._keys.restart not in present:
            self._restart = None
        for node_id in [n for n in self._acks if self._keys.ack(n) not in present]:
            del self._acks[node_id]
        for kv in snapshot.kvs:
            self._apply(kv, None)

    def _view(self) -> View:
        number = self._round.number if self._round else 0
        acks = frozenset(n for n, r in self._acks.items() if r == number)
        return View(
            nodes=self._nodes,
            round=self._round,
            restart=self._restart,
            restart_seen_at=self._restart_seen_at,
            acks=acks,
        )

    async def _act(self, decision: Decision) -> bool:
        """Write the decided round; True while we wait to see our own write come back."""
        if decision.ping and decision.ping != self._pinged:
            await self._store.put(self._keys.ping, encode(Ping(round=decision.ping)))
            self._pinged = decision.ping
        if decision.fail:
            await close_job(self._store, self._keys, "failed", decision.fail, self._settings.closed_ttl)
            return True
        if decision.round is None:
            return False
        new_round = replace(decision.round, opened_at=time.time())
        written = await self._store.compare_and_put(
            self._keys.round, encode(new_round), expected_mod_revision=self._round_rev
        )
        if written:
            log.info("round %d: %s", new_round.number, new_round.reason)
            await self._record_round(new_round)
        # Either way the watch brings the round record that now stands.
        return True

    async def _record_round(self, new_round: Round) -> None:
        """Log the round in the job's events, and prune the oldest events."""
        keys, at = self._keys, new_round.opened_at
        world = f"{_plural(len(new_round.participants), 'node')}, world size {new_round.world_size}"
        event = Event(at=at, node=self._rdzv._me.node_id, kind="round", detail=f"round {new_round.number} ({world}): {new_round.reason}")
        await self._store.put(keys.event(at, event.node), encode(event))
        events = await self._store.get_prefix(keys.events)
        for kv in events.kvs[: max(len(events.kvs) - EVENTS_KEPT, 0)]:
            await self._store.delete(kv.key)

    async def _publish(self, decision: Decision) -> float | None:
        """Publish the waiting reason, at most every _STATE_MIN_INTERVAL; else say when."""
        now = self._clock()
        due = self._published_at + _STATE_MIN_INTERVAL
        if now < due:
            return due
        waiting = tuple(sorted(n for n in self._nodes if not (self._round and self._round.rank_of(n) is not None)))
        state = LeaderState(
            leader=self._rdzv._me.node_id,
            reason=decision.reason,
            registered=len(self._nodes),
            at=time.time(),
            waiting=waiting[:16],
        )
        await self._store.put(self._keys.state, encode(state), lease=self._rdzv._lease or 0)
        if decision.round is None:
            log.info("leader: %s", decision.reason)
        self._published, self._published_at = decision.reason, now
        return None

    def _apply_event(self, event: WatchEvent | StoreError, awaiting_write: bool) -> bool:
        if isinstance(event, StoreError):
            raise event
        if event.key == self._keys.round:
            awaiting_write = False
        kv = None
        if event.type is EventType.PUT:
            kv = KeyValue(event.key, event.value, 0, event.revision, 0, 0)
        self._apply(kv, event.key)
        return awaiting_write

    def _apply(self, kv: KeyValue | None, deleted_key: str | None) -> None:
        """Fold one key (or its deletion, when kv is None) into the leader's view."""
        key = kv.key if kv else deleted_key
        keys = self._keys
        if key is None:
            return
        if key.startswith(keys.nodes):
            node_id = key[len(keys.nodes):]
            if kv is None:
                self._nodes.pop(node_id, None)
            elif node_id not in self._nodes:
                self._nodes[node_id] = SeenNode(info=decode_node(kv.value), seen_at=self._clock())
        elif key == keys.round:
            self._round = decode_round(kv.value) if kv else None
            self._round_rev = kv.mod_revision if kv else 0
        elif key == keys.restart:
            restart = decode_restart(kv.value) if kv else None
            if restart is not None and (self._restart is None or self._restart.round != restart.round):
                self._restart_seen_at = self._clock()
            self._restart = restart
        elif key.startswith(keys.acks):
            node_id = key[len(keys.acks):]
            if kv is None:
                self._acks.pop(node_id, None)
            else:
                self._acks[node_id] = decode_ping(kv.value).round


async def close_job(store: Store, keys: Keys, outcome: str, detail: str, closed_ttl: float) -> bool:
    """Mark the job ended in its round record, which then lives `closed_ttl` more.

    Returns False when the job was closed already. The job's spec and control records
    go, so a new job with the same id starts clean once the record expires.
    """
    while True:
        kv = await store.get(keys.round)
        current = decode_round(kv.value) if kv else None
        if current is not None and current.closed:
            return False
        closed = replace(
            current or Round(0, (), 0, "", 0.0),
            closed=outcome,
            detail=detail[-_DETAIL_LIMIT:],
        )
        lease = await store.grant_lease(closed_ttl)
        if await store.compare_and_put(
            keys.round, encode(closed), expected_mod_revision=kv.mod_revision if kv else 0, lease=lease
        ):
            break
        await store.revoke_lease(lease)
    log.info("job '%s' closed (%s)", keys.run_id, outcome)
    for key in (keys.spec, keys.restart, keys.master, keys.state, keys.ping):
        await store.delete(key)
    await store.delete_prefix(keys.drains)
    return True


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)
