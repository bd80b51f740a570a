"""The elastic rendezvous: leader-driven rounds over any `Store`.

Every node holds a lease and registers under it; one node (whoever holds the
lease-bound `job/leader` key) watches the registrations and writes rounds, deciding with
the pure `decide_round()`. Every node watches `job/` and runs the rounds it is in. A node that
dies vanishes when its lease expires; one that leaves on purpose revokes its lease, so
the leader sees it go at once.

The same class serves the built-in store, etcd, and `--standalone` (an in-memory store):
the store is the only thing that differs. The leader's loop is in `leader.py`, the
reports for job control in `reports.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace

from elasticrun.errors import (
    ElasticrunError,
    JobEndedError,
    LeaseExpiredError,
    RendezvousClosedError,
    RendezvousTimeoutError,
    SpecMismatchError,
    StoreError,
    StoreGoneError,
    StoreUnavailableError,
)
from elasticrun.loglines import HEADLINE
from elasticrun.rendezvous.codec import decode, encode
from elasticrun.rendezvous.handler import Assignment, RendezvousHandler
from elasticrun.rendezvous.job_control import ElasticJobControl
from elasticrun.rendezvous.job_records import JobRecords
from elasticrun.rendezvous.keys import Keys
from elasticrun.rendezvous.leader import DETAIL_LIMIT, Leader, close_job
from elasticrun.rendezvous.liveness import LivenessPort, Verdict, probe
from elasticrun.rendezvous.ports import PortReservation
from elasticrun.rendezvous.records import (
    Departure,
    JobLaunch,
    JobSpec,
    Master,
    NodeInfo,
    Ping,
    QuarantineEntry,
    RestartRequest,
)
from elasticrun.rendezvous.reports import Reporter
from elasticrun.rendezvous.rounds import Placed, RankShard, RoundHead, shard_of
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.rendezvous.stragglers import Judgement
from elasticrun.store.interface import EventType, RangeResult, Store

log = logging.getLogger("elasticrun.rendezvous")


#: seconds between the lines that say what a waiting node waits for, while nothing changes
WAIT_REPORT_INTERVAL = 5.0
#: a node waiting this long alone at the store its agent hosts says the endpoint may be wrong
LONE_HOST_AFTER = 30.0
#: seconds between tries to register while the store an agent hosted refuses us. A try
#: on a refused connection fails at once, without a packet: the client's channel dials
#: again on its own backoff (at most a second), so a short pause adds little to that.
REFUSED_RETRY = 0.2
#: while no round runs, the first LEADER_WATCHERS waiting nodes that the leader's state
#: names look at its liveness port every LEADER_LOOK_INTERVAL seconds: no collective
#: breaks then to make a node look, and a few are enough to notice, where every waiting
#: node looking would make the leader's port take the whole job's connections
LEADER_WATCHERS = 2
LEADER_LOOK_INTERVAL = 1.0


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
        spec: JobSpec,
        launch_flags: tuple[str, ...] = (),
        clock: Callable[[], float] = time.monotonic,
        reserve_port: Callable[[], PortReservation] = PortReservation,
        hosting: str = "",
    ) -> None:
        self.run_id = settings.run_id
        #: the endpoint of the store this node's agent hosts ("": none), for the lone
        #: host's warning (`_alone_at_own_store`)
        self._hosting = hosting
        self._said_alone = False
        #: the job ended while this node took part (its last reports outlive it)
        self._ended = False
        self._store = store
        self._settings = settings
        self._me = me
        self._spec = spec
        self._launch_flags = launch_flags
        self._clock = clock
        self._reserve_port = reserve_port
        self._port: PortReservation | None = None  # the round's MASTER_PORT, while node rank 0
        self._keys = Keys(settings.run_id)
        self._pulse = _Pulse()
        self._lease: int | None = None
        self._lost: str = ""
        #: the revision of this node's registration, and of its last request to the
        #: leader with what it asked (restart or end): what the leader has yet to answer
        self._registered = 0
        self._asked: tuple[int, str] = (0, "")
        self._tasks: set[asyncio.Task[None]] = set()
        self._leader_task: asyncio.Task[None] | None = None
        #: the leader this node runs (or ran last), for the straggler scores' metrics
        self._leader: Leader | None = None
        self._job = JobRecords(self._keys)  # what this node knows of job/
        self._last_round = 0
        self._ran: RoundHead | None = None  # the round this node last ran
        #: this node's place in a round (None: not in it), by the round's shard folder
        self._placed: tuple[str, Placed | None] = ("", None)
        #: this node's hold (its latest quarantine), as read for the round and leader
        #: state it is keyed by
        self._hold: tuple[tuple[int, float], QuarantineEntry | None] = ((0, 0.0), None)
        self._reports = Reporter(store, self._keys, me, steps_interval=settings.straggler_interval)
        #: open from the first registration until the node is done with the job
        self._liveness: LivenessPort | None = None
        #: the leader, once its liveness port accepted our connection (see _suspect_leader)
        self._leader_seen: NodeInfo | None = None
        #: this node's look at the leader while no round runs (see _mind_leader)
        self._leader_look: asyncio.Task[None] | None = None
        #: the store an agent hosted refused us (its agent is gone), or, with successors
        #: named, did not answer within its timeout, and when it first did (self._clock):
        #: until a store answers there again or at a successor (see _register_or_wait)
        self._refused: tuple[StoreUnavailableError, float] | None = None
        #: this node's reports and the job's stacks, over its membership
        self.control: ElasticJobControl = ElasticJobControl(
            self, store, self._keys, me.node_id, self._reports, addr=me.addr, clock=clock
        )

    # --- RendezvousHandler -----------------------------------------------------------

    @property
    def waiting_status(self) -> str | None:
        """What this node waits for now, from what it knows to be true now.

        The leader's published reason is quoted only when it was published after
        everything this node knows of (the round, its registration, its own request):
        an older one describes a job that has moved on (a round that already ended,
        a job without this node). A store an agent hosted that refused us means a wait
        for a new one there (store_host_grace). None when next_round() would not wait.
        """
        if self._refused is not None:
            error, since = self._refused
            grace = self._settings.store_host_grace
            until = time.strftime("%H:%M:%S", time.localtime(time.time() + since + grace - self._clock()))
            host = error.endpoint.rpartition(":")[0]
            successors = self._job.successors
            what = "refused a connection" if isinstance(error, StoreGoneError) else "does not answer"
            if successors is not None:
                return (
                    f"the store at {error.endpoint} (hosted by the agent on {host}) {what}: turning "
                    f"to its successors ({', '.join(s.endpoint for s in successors.nodes)}) until {until} "
                    f"(store_host_grace={grace:g}s)"
                )
            return (
                f"the store at {error.endpoint} (hosted by the agent on {host}) refused a connection: "
                f"waiting until {until} (store_host_grace={grace:g}s) for a new store there"
            )
        if self._lost:  # what we knew of the job is stale until we register again
            return f"registering again (this node lost its membership: {self._lost})"
        if self._lease is None:
            return f"joining job '{self.run_id}'"
        current = self._job.head
        if current is not None and current.closed:
            return None
        said = self._leader_says()
        quoted = f"; the leader: {said}" if said else ""
        held = self._quarantined()
        if held is not None:
            until = time.strftime("%H:%M:%S", time.localtime(held.until))
            return f"quarantined until {until} ({held.reason}){quoted}"
        revision, asked = self._asked
        if asked and revision > self._job.round_revision:
            return asked + quoted
        if current is None:
            return said or "registered; waiting for the leader's first decision"
        if current.number == self._last_round:
            return f"round {current.number} ended for this node; waiting for the leader's next round{quoted}"
        folder, place = self._placed
        if folder != current.ranks:
            return f"round {current.number} opened: reading this node's place in it"
        if place is not None:
            return f"round {current.number}: node rank {place.rank}; waiting for the master address"
        if not current.nodes:  # too few nodes: the round that stopped everyone's workers
            return f"round {current.number} runs no node ({current.reason}){quoted}"
        return self._outside(current) + quoted

    def _leader_says(self) -> str:
        """The leader's reason when it decided after all this node knows of, else ""."""
        state, known = self._job.state, max(self._job.round_revision, self._registered, self._asked[0])
        return state.reason if state and self._job.state_revision > known else ""

    def _outside(self, current: RoundHead) -> str:
        """Why this node, registered, is not in the running round `current`."""
        s, running = self._settings, f"{current.nodes} of max {self._settings.max_nodes} nodes"
        if current.nodes + s.node_unit > s.max_nodes:
            return f"spare: round {current.number} runs {running}; takes the place of a participant that goes"
        if s.node_unit > 1:
            return (
                f"spare: round {current.number} runs {running}; joins with a whole unit of {s.node_unit} "
                "nodes, or takes the place of a participant that goes"
            )
        return f"not in round {current.number} ({running}): the leader adds it after the last call"

    def quarantined_nodes(self) -> int:
        state = self._job.state
        return state.quarantined if state else 0

    def _quarantined(self) -> QuarantineEntry | None:
        """This node's quarantine, while the leader keeps it out."""
        entry = self._hold[1]
        return entry if entry is not None and entry.active(time.time()) else None

    async def _read_hold(self, current: RoundHead | None) -> None:
        """Read this node's hold (r/holds/<node>) while it waits without a place.

        Once per round that went on without it, and once per leader state that says some
        node is kept out. A placed node never reads it, a waiting one once per change."""
        state = self._job.state
        kept_out = bool(state and state.quarantined)
        passed_over = current is not None and current.number > self._last_round
        seen = (current.number if current else 0, state.at if state and kept_out else 0.0)
        if not (kept_out or passed_over) or self._hold[0] == seen:
            return
        kv = await self._store.get(self._keys.hold(self._me.node_id))
        self._hold = (seen, decode(QuarantineEntry, kv.value) if kv is not None else None)

    async def drained(self) -> str:
        while (drain := self._job.drains.get(self._me.node_id)) is None:
            await self._pulse.wait()
        return f"drained: {drain.reason}"

    # --- what its job control reads (job_control.Membership) ------------------------

    @property
    def job(self) -> JobRecords:
        """What this node knows of the job's records (its watch of job/)."""
        return self._job

    @property
    def ran(self) -> RoundHead | None:
        """The round this node last ran."""
        return self._ran

    @property
    def last_round(self) -> int:
        """The number of the round this node last ran (0: none yet)."""
        return self._last_round

    def live_lease(self) -> int | None:
        """This node's lease while its membership holds; None before it registers or once lost."""
        return None if self._lost else self._lease

    async def changed(self, timeout: float | None = None) -> None:
        """Wait until what this node knows of the job changes, or `timeout` passes."""
        await self._pulse.wait(timeout)

    def judgement(self) -> Judgement | None:
        """The straggler verdict of the leader this node runs; None when it does not lead."""
        leader, task = self._leader, self._leader_task
        if leader is None or task is None or task.done():
            return None
        return leader.judgement

    # --- RendezvousHandler, continued --------------------------------------------------

    async def next_round(self) -> Assignment:
        self._release_port()  # the round it was for is over
        started = self._clock()
        deadline = started + self._settings.join_timeout
        logged, said_at = "", -math.inf
        while True:
            if self._lease is None or self._lost:
                await self._register_or_wait()
            current = self._job.head
            if current is not None and current.closed:
                self._ended = True
                raise RendezvousClosedError(self.run_id, current.closed, current.detail)
            try:
                place = await self._place(current) if current and current.number > self._last_round else None
                if self._job.head is not current:  # a newer round came while we read
                    continue
                if current is not None and place is not None:
                    master = await self._master_of(current, place.rank)
                    if master is not None:
                        self._last_round = current.number
                        self._ran = current
                        return self._assignment(current, place, master)
                    continue
                await self._read_hold(current)
            except StoreGoneError as e:
                self._store_refused(e)
                continue
            status = self.waiting_status or ""  # not None: the job is open, the store there
            now = self._clock()
            runs = self._job.head is not None and self._job.head.nodes > 0
            if runs and self._settings.spares_wait:
                # A spare waits as long as the job runs, for the failover it is there for:
                # join_timeout counts only while no round runs.
                deadline = max(deadline, now + self._settings.join_timeout)
            if status != logged or now - said_at >= WAIT_REPORT_INTERVAL:
                # on each change, and every few seconds while nothing changes; shown by
                # default once the wait lasts (a round that forms at once is no news)
                timeout = self._settings.join_timeout
                waited = (
                    "waits as long as the job runs" if runs and self._settings.spares_wait
                    else f"{timeout - (deadline - now):.0f} s of join_timeout {timeout:g} s"
                )
                lasts = now - started >= WAIT_REPORT_INTERVAL
                log.info("node %s waiting: %s; %s", self._me.node_id, status, waited, extra=HEADLINE if lasts else None)
                logged, said_at = status, now
            wake = said_at + WAIT_REPORT_INTERVAL
            if self._hosting and not self._said_alone:
                if now - started >= self._lone_after():
                    await self._alone_at_own_store()
                else:
                    wake = min(wake, started + self._lone_after())
            held = self._quarantined()
            if held is not None:  # a quarantined node waits it out, then join_timeout runs
                deadline = max(deadline, self._clock() + held.until - time.time() + self._settings.join_timeout)
            remaining = deadline - self._clock()
            if remaining <= 0:
                advice = (
                    "the job runs without it" if runs else "start more nodes, or raise join_timeout with --rdzv-conf"
                )
                raise RendezvousTimeoutError(
                    f"no round of job '{self.run_id}' took node {self._me.node_id} within "
                    f"join_timeout={self._settings.join_timeout:g}s; last state: {status} ({advice})"
                )
            await self._pulse.wait(min(remaining, wake - self._clock()))

    def _lone_after(self) -> float:
        """How long a lone host waits before it says so: before join_timeout ends it."""
        return min(LONE_HOST_AFTER, self._settings.join_timeout / 2)

    async def _alone_at_own_store(self) -> None:
        """Say once when nobody else registered at the store this agent hosts.

        Agents given another endpoint (a mistyped port) each host a store and wait
        alone."""
        nodes = await self._store.get_prefix(self._keys.nodes)
        self._said_alone = True
        if all(kv.key == self._keys.node(self._me.node_id) for kv in nodes.kvs):
            log.warning(
                "node %s: nobody else registered in %.0fs at the store this agent hosts on %s; if the other nodes "
                "were given another --rdzv-endpoint (a mistyped port), each hosts a store of its own and waits alone",
                self._me.node_id, self._lone_after(), self._hosting,
            )

    async def round_ended(self) -> str:
        while True:
            if self._lost:
                return f"node {self._me.node_id} lost its membership: {self._lost}"
            current = self._job.head
            if current is None:
                return "the round record vanished from the store"
            if current.number != self._last_round:
                return f"round {current.number}: {current.reason}"
            if current.closed and current.closed != "succeeded":
                self._ended = True
                raise RendezvousClosedError(self.run_id, current.closed, current.detail)
            await self._pulse.wait()

    def closed_by_success(self, round_number: int) -> bool:
        current = self._job.head
        return current is not None and current.closed == "succeeded" and current.number == round_number

    def peers_lost(self) -> bool:
        ran, current = self._ran, self._job.head
        if self._lost or ran is None or current is None or current.closed:
            return True
        if current.restart_count != ran.restart_count:
            return True
        return current.kept_since > ran.number  # a round since ours went on without one of us

    async def request_restart(self, reason: str, *, forgiven: bool = False) -> None:
        revision = await self._request(
            RestartRequest(round=self._last_round, node_id=self._me.node_id, reason=reason, forgiven=forgiven)
        )
        if revision is not None:
            asked = f"asked the leader to restart round {self._last_round} after a worker failure here"
            self._asked = (revision, asked)

    async def fail(self, report: str) -> None:
        """Ask the leader to end the job with `report`.

        It does, once every member shows it is alive; a member that died instead is
        what broke our workers, and the leader opens a new round without it.
        """
        head = self._job.head
        if head is not None and head.closed == "succeeded":
            # No leader left to ask, no round to follow: the others have finished. A
            # failure is never covered by their success: the job failed.
            with contextlib.suppress(StoreError):  # gone with them: this node's exit code says it
                await self._close("failed", report)
            return
        first_line = next((ln.strip() for ln in report.splitlines() if any(c.isalnum() for c in ln)), "workers failed")
        request = RestartRequest(
            round=self._last_round,
            node_id=self._me.node_id,
            reason=first_line,
            final=True,
            report=report[-DETAIL_LIMIT:],
        )
        revision = await self._request(request)
        if revision is not None:
            self._asked = (
                revision,
                "asked the leader to end the job (a worker failed here, no restarts left), "
                "unless it finds a node died meanwhile",
            )

    async def _request(self, request: RestartRequest) -> int | None:
        """Hand the leader a restart (or final) request, and check that it lives.

        The request's revision, None when it went nowhere.

        A store an agent hosted that refuses us took the round with it: the request goes
        nowhere, and the node registers again once a new store answers (next_round).
        """
        try:
            revision = await self._store.put(self._keys.restart, encode(request))
        except StoreGoneError as e:
            self._store_refused(e)
            return None
        self._spawn(self._suspect_leader(), "leader check")
        return revision

    async def finish(self) -> None:
        await self._close("succeeded", f"workers of {self._me.node_id} succeeded")
        self._ended = True
        await self.aclose()

    async def leave(self, reason: str, *, keep_out: bool = False) -> None:
        log.info("node %s leaving job '%s': %s", self._me.node_id, self.run_id, reason)
        self._reports.event("left", reason)
        if self._lease is not None and not self._lost:
            # Not bound to the lease: a leader that takes over once we (its leader) are
            # gone still finds it; the leader deletes it once it let us go.
            with contextlib.suppress(StoreError):
                departure = encode(Departure(reason=reason, keep_out=keep_out))
                await self._store.put(self._keys.departure(self._me.node_id), departure)
        with contextlib.suppress(StoreError):
            await self._reports.flush(self._lease or 0)
        # Our keys go now, so that the others re-form without us at once; a drain
        # request stays until `aclose`, once our workers have stopped: `elasticrun
        # drain` waits for it to go.
        await self._end_membership()

    async def aclose(self) -> None:
        """Give up the membership, then the liveness port, then a drain request.

        The node is done with the job. Its last status and output outlive it by
        closed_ttl when the job has ended (`Reporter.keep`): the background publisher
        stops first, or a flush of its own could put a window back on the old lease
        just before that lease's revocation deletes it."""
        await self._stop_tasks()
        if self._ended and self._lease is not None and not self._lost:
            with contextlib.suppress(StoreError):
                await self._reports.keep(self._settings.closed_ttl)
        await self._end_membership()
        liveness, self._liveness = self._liveness, None
        if liveness is not None:
            await liveness.close()
        if self._job.drains.pop(self._me.node_id, None) is not None:
            with contextlib.suppress(StoreError):
                await self._store.delete(self._keys.drain(self._me.node_id))

    async def _end_membership(self) -> None:
        """Stop the background tasks, give up the lease (deleting our keys now) and the port."""
        self._release_port()
        await self._stop_tasks()
        lease, self._lease = self._lease, None
        if lease is not None and not self._lost:
            with contextlib.suppress(StoreError):
                await self._store.revoke_lease(lease)

    async def _stop_tasks(self) -> None:
        # A task's own failure was handled as it ended (`_task_ended`); the caller's
        # cancellation still propagates out of the gather.
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    # --- membership -------------------------------------------------------------------

    async def _register_or_wait(self) -> None:
        """Register; while the store an agent hosted refuses us, try again, up to store_host_grace.

        The grace counts from the first refusal; past it, give up with its error.

        A refused store hosted by an agent means that agent is gone, and its records
        with it; a scheduler that restarts it (a pod replaced behind the same Service, a
        requeued first task) brings a new, empty store to the same endpoint. This node
        then registers there like any node that finds a new store (`ran_round` and
        `ran_restarts` in its record), and the job goes on in a new round.
        """
        said_at = -math.inf
        while True:
            try:
                await self._register()
            except StoreUnavailableError as e:
                # a store that does not answer may be cut off from us with its agent, and
                # serve the others: with successors named, they may serve this side
                if not isinstance(e, StoreGoneError) and self._job.successors is None:
                    raise
                self._note_refused(e)  # not registered: no membership to lose
            else:
                if self._refused is not None:
                    error, since = self._refused
                    log.info(
                        "node %s: a store answers at %s, %.1f s after the one at %s %s: registered again",
                        self._me.node_id, self._store.endpoint, self._clock() - since, error.endpoint,
                        "refused" if isinstance(error, StoreGoneError) else "stopped answering", extra=HEADLINE,
                    )
                    # what this node read of the gone store's rounds means nothing here
                    self._refused, self._placed, self._hold = None, ("", None), ((0, 0.0), None)
                return
            assert self._refused is not None
            error, since = self._refused
            grace = self._settings.store_host_grace
            now = self._clock()
            left = since + grace - now
            if left <= 0:
                raise StoreGoneError(
                    error.endpoint,
                    f"{error.cause}, and no new store answered there within store_host_grace={grace:g}s",
                )
            if now - said_at >= WAIT_REPORT_INTERVAL:
                log.warning("node %s waiting: %s; %.0f s left", self._me.node_id, self.waiting_status, left)
                said_at = now
            if await self._turn_to_successor():
                continue
            await asyncio.sleep(min(REFUSED_RETRY, left))

    async def _turn_to_successor(self) -> bool:
        """Whether the store moved to one of the successors its serving agent named (docs/concepts.md)."""
        successors = self._job.successors
        if successors is None:
            return False
        turned = await self._store.turn_to([s.endpoint for s in successors.nodes])
        if turned:
            log.info("node %s: the store's successor serves at %s", self._me.node_id, turned)
        return bool(turned)

    def _store_refused(self, error: StoreGoneError) -> None:
        """The store an agent hosted refused us.

        This membership is over (the workers stop), and store_host_grace runs from the
        first refusal."""
        self._note_refused(error)
        self._lose(str(error))

    def _note_refused(self, error: StoreUnavailableError) -> None:
        if self._refused is None:
            self._refused = (error, self._clock())

    def _ended_before_start(self, head: RoundHead) -> JobEndedError:
        """The one line for a node that came to an ended job.

        When it ended, how, and what to do (the closed record keeps the id taken for
        closed_ttl)."""
        now = time.time()
        ttl = self._settings.closed_ttl
        free_at = time.strftime("%H:%M:%S", time.localtime(head.closed_at + ttl))
        how = f"{head.closed}: {head.detail}" if head.detail else head.closed
        return JobEndedError(
            self.run_id, head.closed, head.detail,
            f"job '{self.run_id}' ended {max(now - head.closed_at, 0.0):.0f}s ago ({how}), before this node "
            f"started: this node ran nothing. The id stays taken for closed_ttl={ttl:g}s after a job ends "
            f"(until {free_at}): give a new --rdzv-id to start another job"
        )

    async def _register(self) -> None:
        """Take a lease, check the job spec, register, and start watching."""
        await self._end_membership()
        self._lost = ""
        keys = self._keys
        snapshot = await self._reread_job()
        current = self._job.head
        if current is not None and current.closed:
            if 0 < current.closed_at <= self._me.started_at:
                raise self._ended_before_start(current)
            raise RendezvousClosedError(self.run_id, current.closed, current.detail)
        await self._check_spec()
        if self._liveness is None:
            self._liveness = await LivenessPort.open(self._me.addr)
        # Renewed from the moment it exists: under load the node key's put may take
        # longer than the TTL (docs/architecture.md, Design notes, "Leases under load").
        self._lease = await self._store.grant_lease(self._settings.heartbeat_ttl)
        self._spawn(self._keep_alive(self._lease), "keep-alive")
        ran = self._ran
        me = replace(
            self._me,
            liveness_port=self._liveness.port if self._liveness is not None else 0,
            ran_round=self._last_round,
            ran_restarts=ran.restart_count if ran else 0,
            ran_forgiven=ran.forgiven if ran else 0,
        )
        self._registered = await self._store.put(keys.node(self._me.node_id), encode(me), lease=self._lease)
        self._spawn(self._watch_job(snapshot.revision + 1), "job watch")
        self._spawn(self._reports.publish(self._lease), "reporter")
        if self._job.leader:
            self._spawn(self._see_leader(self._job.leader), "leader check")
        self._mind_leader()
        await self._try_lead()

    async def _check_spec(self) -> None:
        """Refuse a job whose spec differs; store ours if the job is new.

        The spec is usually in the `r/job/` snapshot just read: then no store call at
        all."""
        if self._job.spec is not None:
            self._refuse_other(self._job.spec)
            return
        raw = encode(self._spec)
        if await self._store.compare_and_put(self._keys.spec, raw, expected_mod_revision=0):
            # A new job: the events of an earlier job with this id go.
            await self._store.delete_prefix(self._keys.events)
            launch = JobLaunch(
                cwd=os.getcwd(), created_at=time.time(), created_by=self._me.node_id, flags=self._launch_flags,
                run=secrets.token_hex(8),
            )
            await self._store.put(self._keys.launch, encode(launch))
            return
        stored = await self._store.get(self._keys.spec)
        if stored is None:  # closed and cleared in between: ours is the new spec
            await self._store.put(self._keys.spec, raw)
            return
        self._refuse_other(decode(JobSpec, stored.value))

    def _refuse_other(self, job: JobSpec) -> None:
        differ = job.differences(self._spec)
        if differ:
            raise SpecMismatchError(
                f"this node's job spec differs from the running job '{self.run_id}' ({'; '.join(differ)}); "
                "start it with the same arguments, or use another --rdzv-id"
            )
        differs = job.content_differs(self._spec)
        if differs:
            log.warning("node %s: %s", self._me.node_id, differs)
            self._reports.event("script", differs)

    async def _keep_alive(self, lease: int) -> None:
        """Renew the lease; give the membership up as soon as the lease may have lapsed.

        The store lets the lease lapse `heartbeat_ttl` after the last renewal it got, so
        this node stops counting itself in at the same moment: a renewal that cannot
        finish by then is a loss. A node cut off from the store thus stops its workers
        while the others move on without it, and two groups never train as one job.
        """
        ttl, interval = self._settings.heartbeat_ttl, self._settings.keep_alive_interval
        renewed = self._clock()  # when the last successful renewal was sent
        due = renewed + interval
        while True:
            await asyncio.sleep(max(due - self._clock(), 0.0))
            sent = self._clock()
            if due < renewed + ttl <= sent and sent - due >= interval:
                # Due before the lease's end, woken well past it: this process did not
                # run (stopped, frozen, starved of CPU), which no store could help. (A
                # renewal retried after failures may be due past the lease's end itself.)
                return self._lose(
                    f"this agent did not run for {sent - due:.1f}s (stopped, frozen or starved of CPU), past its "
                    f"lease of {ttl:g}s"
                )
            try:
                async with asyncio.timeout(max(renewed + ttl - sent, 0.0)):
                    await self._store.keep_alive(lease)
                # The next one is due an interval after this was sent, as the TTL counts,
                # not after its answer came: a store answering in L seconds then holds
                # the lease while L <= TTL/2, not only while L <= (TTL - interval)/2.
                renewed, due = sent, sent + interval
            except LeaseExpiredError:
                return self._lose("its lease expired")
            except StoreGoneError:
                raise  # its host is gone: the membership ends (the supervisor), next_round waits for a new store
            except (StoreError, TimeoutError) as e:
                now = self._clock()
                if now - (renewed + ttl) >= interval:
                    # The renewal's deadline passed an interval or more before this ran:
                    # the process was stopped while it waited for the answer, not the store
                    return self._lose(
                        f"this agent did not run for up to {now - sent:.1f}s (stopped, frozen or starved of CPU) while "
                        f"it renewed its lease of {ttl:g}s"
                    )
                if now >= renewed + ttl:
                    cause = str(e) or "no answer in time"
                    return self._lose(f"the store did not renew its lease for {ttl:g}s: {cause}")
                log.warning("keep-alive failed (%s); retrying", e)
                due = self._clock() + interval

    def _lose(self, why: str) -> None:
        if self._lost:
            return
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
                    self._job.apply(event.key, event.value if event.type is EventType.PUT else None, event.revision)
                    if event.key == self._keys.stacks:
                        self.control.saw_stacks_request()
                    if event.key == self._keys.leader and event.type is EventType.DELETE:
                        self._leader_seen = None
                        await self._try_lead()
                    elif event.key == self._keys.leader:
                        self._leader_seen = None
                        self._spawn(self._see_leader(self._job.leader), "leader check")
                    elif event.key == self._keys.ping and self._job.ping is not None:
                        await self._answer_ping(self._job.ping)
                    elif event.key == self._keys.state:
                        self._mind_leader()
                    self._pulse.fire()
            except StoreGoneError:
                raise  # its host is gone: the membership ends (the supervisor), next_round waits for a new store
            except StoreError as e:
                log.warning("watch on job '%s' broke (%s); re-reading", self.run_id, e)
                await asyncio.sleep(self._settings.keep_alive_interval)
                start_revision = (await self._reread_job()).revision + 1
                self._pulse.fire()

    async def _see_leader(self, leader: str) -> None:
        """Connect once to a new leader's liveness port.

        Only a leader whose port accepted our connection may later be found gone by a
        refusal."""
        if leader == self._me.node_id:
            return
        try:
            kv = await self._store.get(self._keys.node(leader))
        except StoreError as e:
            log.debug("could not read the leader's registration: %s", e)
            return
        if kv is None:
            return
        info = decode(NodeInfo, kv.value)
        if info.liveness_port and await probe(info.addr, info.liveness_port) is Verdict.LISTENING:
            if self._job.leader == leader:
                self._leader_seen = info

    async def _suspect_leader(self) -> None:
        """Check that the leader still lives: our workers failed (the dead peer may be it), or we watch it.

        Only the leader checks the members, so look at it here (and, while no round
        runs, from _look_at_leader). Its port refusing (where it accepted before) means
        its agent is gone: end its lease, so another node leads now and finds it lost,
        rather than a lease TTL later. A stopped or unreachable leader is left to its
        TTL."""
        seen = self._leader_seen
        if seen is None or await probe(seen.addr, seen.liveness_port) is not Verdict.GONE:
            return
        try:
            kv = await self._store.get(self._keys.leader)
            if kv is None or kv.value.decode() != seen.node_id or not kv.lease:
                return
            log.warning("leader %s: its liveness port refused a connection: its agent is gone", seen.node_id)
            await self._store.revoke_lease(kv.lease)
        except StoreError as e:
            log.debug("could not end the gone leader's lease: %s", e)

    def _mind_leader(self) -> None:
        """Start looking at the leader, once this node is one of its watchers (`LEADER_WATCHERS`).

        Before the first round (or in a round that runs no node) no worker fails when
        the leader's agent dies, so no node would check it (_suspect_leader): the job
        waited a lease TTL for a new leader (25 s at 10,000 nodes). Started from the
        leader's state, not a timer of every node's: the other waiting nodes pay nothing."""
        if self._leader_look is None and self._watches_leader():
            self._leader_look = self._spawn(self._look_at_leader(), "leader look")

    def _watches_leader(self) -> bool:
        """Whether no round runs and the leader's state names this node among its first watchers."""
        head, state = self._job.head, self._job.state
        if state is None or (head is not None and (head.nodes or head.closed)):
            return False
        others = [n for n in state.waiting if n != state.leader]
        return self._me.node_id in others[:LEADER_WATCHERS]

    async def _look_at_leader(self) -> None:
        try:
            while self._watches_leader():
                await self._suspect_leader()
                await asyncio.sleep(LEADER_LOOK_INTERVAL)
        finally:
            self._leader_look = None

    async def _answer_ping(self, ping: Ping) -> None:
        """Show the leader we are alive, so a failure is told apart from a death."""
        if self._lease is not None and not self._lost:
            await self._store.put(self._keys.ack(self._me.node_id), encode(ping), lease=self._lease)

    async def _reread_job(self) -> RangeResult:
        snapshot = await self._store.get_prefix(self._keys.job)
        self._job = JobRecords(self._keys)
        for kv in snapshot.kvs:
            self._job.apply(kv.key, kv.value, kv.mod_revision)
        return snapshot

    async def _place(self, current: RoundHead) -> Placed | None:
        """This node's place in `current` (None: not in it), read from the one shard its id hashes to.

        Read once per round: what a node reads of a round does not grow with the job."""
        folder, place = self._placed
        if folder == current.ranks:
            return place
        place = None
        if current.shards:
            key = self._keys.shard(current.ranks, shard_of(self._me.node_id, current.shards))
            kv = await self._store.get(key)
            # None: a newer round replaced it already; its head is on its way
            shard = decode(RankShard, kv.value) if kv is not None else None
            place = next((p for p in shard.placed if p.node_id == self._me.node_id), None) if shard else None
        self._placed = (current.ranks, place)
        return place

    async def _master_of(self, current: RoundHead, rank: int) -> Master | None:
        """The round's master address; node rank 0 reserves a port and publishes it.

        The port stays reserved until the agent asks for the next round or leaves: its
        rank-0 worker binds it seconds later, and a port merely found free now could
        be taken by anyone in between (see `PortReservation`).
        """
        if rank == 0:
            self._port = self._reserve_port()
            master = Master(round=current.number, addr=self._me.addr, port=self._port.port)
            await self._store.put(self._keys.master, encode(master), lease=self._lease or 0)
            self._job.master = master
            return master
        while True:
            known = self._job.master
            if known is not None and known.round == current.number:
                return known
            if self._lost or self._job.head is not current:
                return None
            await self._pulse.wait()

    def _release_port(self) -> None:
        port, self._port = self._port, None
        if port is not None:
            port.close()

    def _assignment(self, current: RoundHead, place: Placed, master: Master) -> Assignment:
        return Assignment(
            round=current.number,
            node_rank=place.rank,
            node_count=current.nodes,
            rank_offset=place.offset,
            world_size=current.world_size,
            master_addr=master.addr,
            master_port=master.port,
            restart_count=current.restart_count,
            forgiven=current.forgiven,
            run=self._job.launch.run if self._job.launch is not None else "",
            settle=self._settings.heartbeat_ttl,
        )

    async def _close(self, outcome: str, detail: str) -> None:
        await close_job(self._store, self._keys, outcome, detail, self._settings.closed_ttl)

    def _spawn(self, coro: Coroutine[object, object, None], what: str) -> asyncio.Task[None]:
        """Run `coro` for as long as we are registered; its failure is a lost membership.

        The node then stops its workers and registers again, rather than looking alive
        while its heartbeat, job watch, reporter or leader is dead.
        """
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._task_ended, what))
        return task

    def _task_ended(self, what: str, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.debug("the %s failed", what, exc_info=error)
            if isinstance(error, StoreGoneError):
                self._note_refused(error)
            self._lose(f"its {what} failed: {error if isinstance(error, ElasticrunError) else repr(error)}")

    # --- leadership -------------------------------------------------------------------

    async def _try_lead(self) -> None:
        if self._lease is None or self._lost or self._job.leader:
            return  # a leader's key held: its deletion (watched) brings us back here
        if self._job.head is not None and self._job.head.closed:
            return  # the job has ended: nothing left to lead
        me = self._me.node_id.encode()
        if await self._store.compare_and_put(self._keys.leader, me, expected_mod_revision=0, lease=self._lease):
            log.info("node %s leads job '%s'", self._me.node_id, self.run_id)
            leader = self._leader = Leader(self._store, self._settings, self._me.node_id, self._lease, self._clock)
            self._leader_task = self._spawn(leader.run(), "leader")
