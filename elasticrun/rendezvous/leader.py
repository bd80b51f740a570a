"""The leader of an elastic job: one watch on the rendezvous records, `decide_round()`, writes.

Whoever holds the lease-bound `job/leader` key runs this. It keeps a `View` of the
registered nodes, the current round, restart requests and liveness answers up to date
from a single watch, asks the pure `decide_round()` what to do, and does it: write a round,
ping the members, or end the job. It never sleeps on a poll: it waits for the next
event, or for the time `decide_round()` said to look again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace

from elasticrun.errors import RendezvousError, StoreError, StoreGoneError
from elasticrun.rendezvous.codec import decode, encode
from elasticrun.rendezvous.job_records import JobRecords
from elasticrun.rendezvous.keys import Keys
from elasticrun.rendezvous.liveness import Verdict, probe
from elasticrun.rendezvous.records import (
    Event,
    LeaderState,
    NodeInfo,
    Ping,
    QuarantineTable,
    RestartRequest,
    StepReport,
)
from elasticrun.rendezvous.round_policy import decide_round, earliest
from elasticrun.rendezvous.rounds import Round, RoundHead, split_round
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.rendezvous.stragglers import Judgement, judge
from elasticrun.rendezvous.view import Decision, SeenNode, View
from elasticrun.rendezvous.wording import plural
from elasticrun.store.interface import EventType, RangeResult, Store, WatchEvent

log = logging.getLogger("elasticrun.rendezvous")

#: a failure report kept in the closed round record is cut to this many characters
DETAIL_LIMIT = 16_000
#: the leader publishes its waiting reason at most this often, and at most once per
#: second per _STATE_FANOUT registered nodes: every node's watch gets it, so a large
#: job's nodes get ~_STATE_FANOUT state events a second in all, not one each
_STATE_MIN_INTERVAL = 1.0
_STATE_FANOUT = 200
#: newcomers' liveness ports the leader connects to at once (liveness.py)
_CHECKS_AT_ONCE = 64
#: the leader looks at the liveness ports of the nodes outside the round (the spares, or
#: every node before the first round) about this often, and connects to at most
#: _OUTSIDE_LOOKS_PER_S ports in any second: a job with many such nodes looks at each
#: less often
_OUTSIDE_LOOK_INTERVAL = 1.0
_OUTSIDE_LOOKS_PER_S = 200
#: events kept in the store (the leader prunes older ones)
EVENTS_KEPT = 200
#: after a decision that took t seconds, the leader folds events in for _DECIDE_REST * t
#: before it decides again: at most 1 / (1 + _DECIDE_REST) of its loop goes to decide_round().
#: A decision costs O(registered nodes), and nodes registering one by one wake the
#: leader once each: 1,000 nodes on 2 cores cost 939 decisions and 5.9 s of the leader's
#: CPU before round 1 (bench_rendezvous_scale.py, --profile-leader); a decision that
#: waits out its rest takes all the events meanwhile at once. A small job's decision
#: takes well under a millisecond, and so does its rest.
_DECIDE_REST = 4.0


@dataclass(frozen=True, slots=True)
class _Probed:
    """What a connection to a node's liveness port showed.

    `suspect`: the round whose restart request made the leader look (0: the check when
    the node registered)."""

    info: NodeInfo
    suspect: int
    verdict: Verdict


@dataclass(frozen=True, slots=True)
class _Judged:
    """The straggler verdict changed (--straggler=replace): decide again."""


#: what the leader's loop wakes for: a change under r/, how the watch ended, a liveness
#: probe's verdict, a new straggler verdict
_Wake = WatchEvent | Exception | _Probed | _Judged


class Leader:
    """The leader's loop: keep a `View` up to date from one watch, decide, write rounds."""

    def __init__(
        self,
        store: Store,
        settings: RendezvousSettings,
        node_id: str,
        lease: int,
        clock: Callable[[], float],
    ) -> None:
        self._store = store
        self._keys = Keys(settings.run_id)
        self._settings = settings
        self._node_id = node_id
        self._lease = lease
        self._clock = clock
        #: r/ as the watch last showed it; what follows is what the leader makes of it
        self._records = JobRecords(self._keys)
        self._nodes: dict[str, SeenNode] = {}
        #: the first restart request of the current round (the later ones echo it)
        self._restart: RestartRequest | None = None
        self._restart_seen_at = 0.0
        self._pinged = 0
        #: failure records and quarantines, on this leader's clock (stored on the wall clock)
        self._quarantine = QuarantineTable()
        #: nodes an operator drained, and nodes that said they leave on purpose (each
        #: kept while the node is registered or in the round)
        self._draining: set[str] = set()
        self._departed: set[str] = set()
        #: the waiting reason and number of quarantined nodes last published
        self._published: tuple[str, int] = ("", 0)
        self._published_at = -1e9
        #: liveness (liveness.py): nodes whose port accepted the leader's connection
        #: once, nodes still to check, and the members found gone, by suspect round
        self._reachable: set[str] = set()
        self._unchecked: set[str] = set()
        self._refused: dict[str, int] = {}
        self._probes: set[asyncio.Task[None]] = set()
        #: newcomers' checks under way at once: 10,000 nodes registering meant 10,000
        #: connections opened together, and checks that timed out behind the others
        self._checks = asyncio.Semaphore(_CHECKS_AT_ONCE)
        self._events: asyncio.Queue[_Wake] = asyncio.Queue()
        #: the leader's clock time before which it does not decide again (_DECIDE_REST)
        self._rest_until = -math.inf
        #: the latest straggler verdict (elasticrun.rendezvous.stragglers), also read by
        #: the metrics thread: replaced whole, never changed in place
        self.judgement = Judgement()

    async def run(self) -> None:
        """Lead until the job ends, or until cancelled (this node left or lost its lease).

        A store failure (a watch that broke, a write that timed out) does not end the
        leadership: the leader re-reads the job and goes on. Dying silently would leave
        the leader key held by a live lease, and no round would ever be decided again.
        Once the job has ended the leader stops for good: when the closed record
        expires, a leader still watching would form round 1 of a job nobody runs.
        """
        while True:
            try:
                await self._lead()
                return
            except StoreGoneError:
                raise  # no store, no job: the node's supervisor ends its membership
            except StoreError as e:
                log.warning("leader of job '%s': store call failed (%s); re-reading", self._settings.run_id, e)
                await asyncio.sleep(self._settings.keep_alive_interval)

    async def _lead(self) -> None:
        snapshot = await self._store.get_prefix(self._keys.rdzv)
        self._resync(snapshot)
        events = self._events = asyncio.Queue()
        pump = asyncio.ensure_future(self._pump(snapshot.revision + 1, events))
        judging = asyncio.ensure_future(self._judge(events)) if self._settings.straggler != "off" else None
        looking = asyncio.ensure_future(self._look_outside_round(events))
        try:
            # `stale`: what decide_round() sees may have changed since it last ran. Only then,
            # or at the time it asked to look again, does it run again, and not before
            # its rest (_DECIDE_REST) is over: at 10,000 nodes a decision takes ~10 ms,
            # and each newcomer's liveness check answering (10,000 answers, none of
            # which change a decision) had cost one.
            awaiting_write, stale = False, True
            recheck: float | None = None
            while True:
                self._check_new_nodes()
                if awaiting_write:
                    recheck = None
                elif stale and self._clock() >= self._rest_until:
                    stale = False
                    decision = self._decide()
                    if decision.ended:
                        log.info("leader of job '%s': %s; leading no more", self._settings.run_id, decision.reason)
                        return
                    awaiting_write = await self._act(decision)
                    recheck = decision.recheck_at
                    held = len(self._quarantine.active(self._clock()))  # nodes kept out now
                    if self._published != (decision.reason, held):
                        recheck = earliest(recheck, await self._publish(decision, held))
                wake = self._rest_until if stale and not awaiting_write else recheck
                try:
                    async with asyncio.timeout(None if wake is None else max(wake - self._clock(), 0.0)):
                        event = await events.get()
                except TimeoutError:
                    stale = True  # the time to look again, or the rest is over
                    continue
                awaiting_write, changed = self._apply_event(event, awaiting_write)
                stale |= changed
                while not events.empty():
                    awaiting_write, changed = self._apply_event(events.get_nowait(), awaiting_write)
                    stale |= changed
        finally:
            tasks = [pump, looking, *([judging] if judging else []), *self._probes]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._probes.clear()

    def _decide(self) -> Decision:
        """decide_round() on the view now; the leader rests in proportion to what it took.

        Taken as the thread's CPU time, not the wall clock's: a decision is pure
        computation, and a process stopped or starved while it ran (a loaded host, a
        paused VM) must not rest for four times the stall."""
        started = time.thread_time()
        decision = decide_round(self._view(), self._settings, self._clock())
        self._rest_until = self._clock() + (time.thread_time() - started) * _DECIDE_REST
        return decision

    async def _pump(self, start: int, events: asyncio.Queue[_Wake]) -> None:
        """Feed the job's changes to the leader's loop.

        How the watch ended goes there too (a store error: the loop re-reads; anything
        else: the leader fails, and its node's supervisor notices), so the loop never
        waits on a pump that is gone."""
        try:
            async for event in self._store.watch(self._keys.rdzv, start_revision=start, prefix=True):
                events.put_nowait(event)
            events.put_nowait(StoreError("the watch of the job's keys ended"))
        except Exception as e:
            events.put_nowait(e)

    def _resync(self, snapshot: RangeResult) -> None:
        """Fold a fresh snapshot in: what vanished meanwhile goes, the rest is updated."""
        self._records = JobRecords(self._keys)
        self._quarantine = QuarantineTable()
        for kv in snapshot.kvs:
            self._apply(kv.key, kv.value, kv.mod_revision)
        for node_id in self._nodes.keys() - self._records.nodes.keys():
            del self._nodes[node_id]
            self._forget(node_id)
        if self._records.restart is None:
            self._restart = None

    def _view(self) -> View:
        current = self._records.round
        number = current.number if current else 0
        # the leader deciding is alive: it is never among the nodes that have not answered yet
        acks = frozenset(n for n, ping in self._records.acks.items() if ping.round == number) | {self._node_id}
        in_round = {p.node_id for p in current.participants} if current else set()
        self._draining &= set(self._nodes) | in_round
        self._departed &= set(self._nodes) | in_round
        successors = self._records.successors
        return View(
            nodes=self._nodes,
            round=current,
            restart=self._restart,
            restart_seen_at=self._restart_seen_at,
            acks=acks,
            quarantine=self._quarantine,
            draining=frozenset(self._draining),
            departed=frozenset(self._departed),
            keep_out={n: d.reason for n, d in self._records.departures.items() if d.keep_out},
            refused=frozenset(n for n, suspect in self._refused.items() if suspect == number),
            slow=self._slow(number),
            successors=successors,
            named_members=frozenset(
                p.node_id for shard in self._records.shards.get(successors.ranks, {}).values() for p in shard.placed
            ) if successors is not None else frozenset(),
        )

    def _slow(self, number: int) -> tuple[tuple[str, str], ...]:
        """The stragglers to replace (--straggler=replace), named in round `number`.

        A verdict of an earlier round is no reason to take another node out."""
        if self._settings.straggler != "replace" or self.judgement.round != number:
            return ()
        return self.judgement.worst_first()

    # --- stragglers: the nodes' step times judged every straggler_interval ------------------

    async def _judge(self, events: asyncio.Queue[_Wake]) -> None:
        """Read the nodes' step reports (c/, which the leader does not watch), judge, and say what changed.

        The loop decides again when a straggler is to go. A store error waits for the
        next evaluation; anything else ends the leadership, through the loop, as the
        pump's would."""
        try:
            while True:
                await asyncio.sleep(self._settings.straggler_interval)
                try:
                    await self._evaluate(events)
                except StoreError as e:
                    log.debug("leader: could not judge the step times: %s", e)
        except Exception as e:
            events.put_nowait(e)

    async def _evaluate(self, events: asyncio.Queue[_Wake]) -> None:
        """One straggler evaluation: the reports read and judged, the verdict written.

        The stragglers are written when any is or was named, logged and recorded as
        events once per change."""
        listed = await self._store.get_prefix(self._keys.steps)
        reports = {}
        for kv in listed.kvs:
            with contextlib.suppress(RendezvousError):  # another version's node: not judged
                report = decode(StepReport, kv.value)
                reports[report.node_id] = report
        before, now = self.judgement, time.time()
        to_replace = [n for n, _ in self._slow(before.round)]
        after = self.judgement = judge(before, self._records.round, reports, self._settings, now)
        if [n for n, _ in self._slow(after.round)] != to_replace:
            events.put_nowait(_Judged())
        for node_id in after.doubted.keys() - before.doubted.keys():
            log.warning("node %s's step report is not believed: %s", node_id, after.doubted[node_id])
        if not after.named and not before.named:
            return
        await self._store.put(self._keys.stragglers, encode(after.report(now)), lease=self._lease)
        writes = []
        for node_id in after.named.keys() - before.named.keys():
            straggler = after.named[node_id]
            log.warning("node %s is a straggler: %s", node_id, straggler.reason)
            writes.append(self._event(node_id, "straggler", f"named a straggler: {straggler.reason}"))
        for node_id in before.named.keys() - after.named.keys():
            if after.round == before.round and node_id in after.scores:
                log.info("node %s is no longer a straggler", node_id)
                writes.append(self._event(node_id, "straggler", "no longer a straggler"))
        await asyncio.gather(*writes)

    async def _event(self, node_id: str, kind: str, detail: str) -> None:
        now = time.time()
        event = Event(at=now, node=node_id, kind=kind, detail=detail)
        await self._store.put(self._keys.event(now, node_id), encode(event))

    async def _act(self, decision: Decision) -> bool:
        """Write the decided round; True while we wait to see our own write come back."""
        if decision.ping and decision.ping != self._pinged:
            await self._store.put(self._keys.ping, encode(Ping(round=decision.ping)))
            self._pinged = decision.ping
            self._check_members(decision.ping)
        if decision.quarantine is not None:
            # Before the round: a new leader that finds a quarantined member still in the
            # round takes it out; one that found the round without the record would not.
            await self._store_quarantine(decision.quarantine)
        await self._clear_settled(decision.settled)
        if decision.fail:
            await close_job(self._store, self._keys, "failed", decision.fail, self._settings.closed_ttl)
            return True
        if decision.round is None:
            return False
        for node_id in decision.dead:
            refused = node_id in self._refused  # said once already, when its port refused
            await self._end_registration(
                self._nodes[node_id].info,
                logging.INFO if refused else logging.WARNING,
                "node %s: ending its registration" if refused
                else "node %s did not show it is alive for a lease TTL: ending its registration",
            )
        new_round = replace(decision.round, opened_at=time.time())
        head, shards = split_round(new_round, self._node_id, self._records.head, self._records.round)
        # The members first, in shards of their own (no node watches them), then the
        # head, which every node sees: each then reads only its own shard.
        await asyncio.gather(
            *(self._store.put(self._keys.shard(head.ranks, i), encode(s)) for i, s in enumerate(shards))
        )
        written = await self._store.compare_and_put(
            self._keys.round, encode(head), expected_mod_revision=self._records.round_revision
        )
        if written:
            log.info("round %d: %s", new_round.number, new_round.reason)
            # earlier rounds' members, but those the majority rule counts (decide._no_majority)
            named = self._records.successors.ranks if self._records.successors is not None else ""
            for folder in self._records.shards.keys() - {head.ranks, named}:
                await self._store.delete_prefix(f"{self._keys.ranks}{folder}/")
            await self._clear_departed(new_round)
            await self._record_round(new_round)
        else:  # another leader's round stands: ours was never seen
            await self._store.delete_prefix(f"{self._keys.ranks}{head.ranks}/")
        # Either way the watch brings the round record that now stands.
        return True

    async def _end_registration(self, info: NodeInfo, level: int, line: str) -> bool:
        """Revoke the lease of a node declared dead: its key goes now, not when the store gets to expire it.

        Only the registration `info`: the node may have registered again since the
        leader judged it (a new agent, with a new port), and that one is not judged.
        Were it alive after all, its next renewal fails, and it registers again as a
        newcomer (with its workers stopped). Logs `line` (the node id for %s) when it
        revokes; whether it did."""
        kv = await self._store.get(self._keys.node(info.node_id))
        if kv is None or not kv.lease or _registration(kv.value) != info:
            return False
        log.log(level, line, info.node_id)
        await self._store.revoke_lease(kv.lease)
        return True

    async def _clear_departed(self, new_round: Round) -> None:
        """Delete the departure records of nodes that are gone and out of the round.

        The leader, not the node that left, deletes them, once it has let the node go: a
        leader that takes over meanwhile (the node that left may have led) still finds
        them, and says the node left, not lost. A drain record is the drained node's to
        delete, once its workers have stopped (`elasticrun drain` waits for that); the
        leader remembers the drain from the record's arrival (`_draining`).
        """
        kept = set(self._nodes) | {p.node_id for p in new_round.participants}
        for node_id in sorted(self._records.departures.keys() - kept):
            await self._store.delete(self._keys.departure(node_id))

    async def _clear_settled(self, settled: tuple[str, ...]) -> None:
        """Delete the departure records that asked to keep their node out, once the node is held.

        Held: `Decision.settled`. Not a record of a node in the round: a member's goes
        with the round that lets it go (`_clear_departed`), so a leader taking over
        before that round still says the node left. Kept, a record would hold its node
        again each time its quarantine ended."""
        current = self._records.round
        members = {p.node_id for p in current.participants} if current else set()
        for node_id in settled:
            if node_id not in members and node_id in self._records.departures:
                await self._store.delete(self._keys.departure(node_id))

    def _forget(self, node_id: str) -> None:
        """What the leader knew of a node's liveness: it is gone, or a new registration."""
        self._reachable.discard(node_id)
        self._refused.pop(node_id, None)

    async def _store_quarantine(self, table: QuarantineTable) -> None:
        """Store the failure records (on the wall clock).

        Give each newly quarantined node its hold, and log it; a node the table forgot
        loses its hold."""
        before, now = self._quarantine, time.time()
        stored = table.shifted(now - self._clock())
        await self._store.put(self._keys.quarantine, encode(stored))
        self._quarantine = table
        forgotten = {e.node_id for e in before.entries if e.times} - {e.node_id for e in table.entries}
        writes: list[Coroutine[object, object, object]] = [self._store.delete(self._keys.hold(n)) for n in forgotten]
        for entry in stored.entries:
            old = before.get(entry.node_id)
            if entry.times > (old.times if old else 0):
                detail = (
                    f"quarantined until {time.strftime('%H:%M:%S', time.localtime(entry.until))} "
                    f"({_ordinal(entry.times)} time): {entry.reason}"
                )
                log.warning("node %s %s", entry.node_id, detail)
                event = Event(at=now, node=entry.node_id, kind="quarantine", detail=detail)
                writes += [
                    self._store.put(self._keys.hold(entry.node_id), encode(entry)),
                    self._store.put(self._keys.event(now, entry.node_id), encode(event)),
                ]
        await asyncio.gather(*writes)

    async def _record_round(self, new_round: Round) -> None:
        """Log the round in the job's events, and prune the oldest events."""
        keys, at = self._keys, new_round.opened_at
        world = f"{plural(len(new_round.participants), 'node')}, world size {new_round.world_size}"
        detail = f"round {new_round.number} ({world}): {new_round.reason}"
        event = Event(at=at, node=self._node_id, kind="round", detail=detail)
        await self._store.put(keys.event(at, event.node), encode(event))
        events = await self._store.get_prefix(keys.events)
        for kv in events.kvs[: max(len(events.kvs) - EVENTS_KEPT, 0)]:
            await self._store.delete(kv.key)

    async def _publish(self, decision: Decision, held: int) -> float | None:
        """Publish the waiting reason, at most every _STATE_MIN_INTERVAL (longer with many nodes, above).

        Else say when."""
        now = self._clock()
        due = self._published_at + _STATE_MIN_INTERVAL * max(1.0, len(self._nodes) / _STATE_FANOUT)
        if now < due:
            return due
        current = self._records.round
        placed = current.node_ranks() if current else {}
        waiting = tuple(sorted(n for n in self._nodes if n not in placed))
        state = LeaderState(
            leader=self._node_id,
            reason=decision.reason,
            registered=len(self._nodes),
            at=time.time(),
            waiting=waiting[:16],
            quarantined=held,
        )
        await self._store.put(self._keys.state, encode(state), lease=self._lease)
        if decision.round is None:
            log.info("leader: %s", decision.reason)
        self._published, self._published_at = (decision.reason, held), now
        return None

    # --- liveness: a dead agent told from a slow one in about a second ---------------------

    def _check_new_nodes(self) -> None:
        """Connect once to each new node's liveness port.

        Only a node whose port accepted the leader's connection may later be found gone
        by a refusal."""
        for node_id in self._unchecked & self._nodes.keys():
            self._probe(self._nodes[node_id].info, 0)
        self._unchecked.clear()

    def _check_members(self, number: int) -> None:
        """A restart request: look at every member but this one now.

        A dead peer breaks the survivors' collectives at once, so this is when a death
        shows first."""
        current = self._records.round
        for p in current.participants if current and current.number == number else ():
            seen = self._nodes.get(p.node_id)
            if p.node_id != self._node_id and p.node_id in self._reachable and seen is not None:
                self._probe(seen.info, number)

    def _probe(self, info: NodeInfo, suspect: int) -> None:
        if not info.liveness_port or info.node_id == self._node_id:
            return
        task = asyncio.ensure_future(self._connect(info, suspect))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _connect(self, info: NodeInfo, suspect: int) -> None:
        if suspect:  # a member suspected now: at once
            verdict = await probe(info.addr, info.liveness_port)
        else:  # a newcomer's check: a few at a time, each with the whole probe timeout
            verdict = await self._look(info)
        self._events.put_nowait(_Probed(info, suspect, verdict))

    def _apply_probe(self, probed: _Probed) -> None:
        node_id = probed.info.node_id
        seen = self._nodes.get(node_id)
        if seen is None or seen.info != probed.info:
            return  # gone, or registered again since: the answer is about an old agent
        if probed.verdict is Verdict.LISTENING:
            new = node_id not in self._reachable
            self._reachable.add(node_id)
            current = self._records.round
            if new and not probed.suspect and current is not None and self._pinged == current.number:
                # found reachable while a check is on (a leader that just took over):
                # it is a suspect like the others
                answered = self._records.acks.get(node_id) == Ping(round=current.number)
                if any(p.node_id == node_id for p in current.participants) and not answered:
                    self._probe(probed.info, current.number)
        elif probed.verdict is Verdict.GONE and probed.suspect and node_id in self._reachable:
            log.warning("node %s: its liveness port refused a connection: its agent is gone", node_id)
            self._refused[node_id] = probed.suspect

    async def _look_outside_round(self, events: asyncio.Queue[_Wake]) -> None:
        """Connect to the liveness ports of the nodes outside the round about once a second.

        The spares while a round runs, every node waiting before the first. Their deaths
        break no collective, so no restart request makes the leader look, as it does at
        its members: a dead spare stayed registered for a lease TTL (25 s at 10,000
        nodes), listed by `status` as a standby that is not there, and the first picked
        to replace the next member lost; a node dead while it waited for the first round
        was placed in it, and every member's workers started for a round that could not
        run. Only a refusal from a node whose port once accepted counts, as for members.
        A store error waits for the next look; anything else ends the leadership,
        through the loop, as the pump's would."""
        try:
            while True:
                outside = self._outside_round()
                # a slice a second: never more than _OUTSIDE_LOOKS_PER_S connections in
                # one second, so many waiting nodes are a steady trickle, not a burst
                for first in range(0, max(len(outside), 1), _OUTSIDE_LOOKS_PER_S):
                    await asyncio.sleep(_OUTSIDE_LOOK_INTERVAL)
                    await self._look_at(outside[first:first + _OUTSIDE_LOOKS_PER_S])
        except Exception as e:
            events.put_nowait(e)

    async def _look_at(self, nodes: list[NodeInfo]) -> None:
        """Look at these nodes' ports; end the registration of each that refused and is still outside the round."""
        verdicts = await asyncio.gather(*(self._look(info) for info in nodes))
        for info, verdict in zip(nodes, verdicts, strict=True):
            if verdict is Verdict.GONE and info in self._outside_round():
                try:
                    await self._end_outsider(info)
                except StoreError as e:
                    log.debug("leader: could not end node %s's registration: %s", info.node_id, e)

    def _outside_round(self) -> list[NodeInfo]:
        """The registered nodes outside the running round (all, before one runs) whose liveness ports once accepted."""
        current = self._records.round
        members = current.node_ranks() if current is not None and current.participants else {}
        return [
            seen.info
            for node_id, seen in self._nodes.items()
            if node_id not in members and node_id in self._reachable and node_id != self._node_id
        ]

    def _running(self) -> bool:
        """Whether a round with members runs (else the registered nodes wait for one)."""
        current = self._records.round
        return current is not None and bool(current.participants)

    async def _look(self, info: NodeInfo) -> Verdict:
        """One connection to `info`'s port, among _CHECKS_AT_ONCE at most.

        Newcomers' checks and the looks outside the round share them."""
        async with self._checks:
            return await probe(info.addr, info.liveness_port)

    async def _end_outsider(self, info: NodeInfo) -> None:
        """End a dead spare's or waiting node's registration: a warning line and a `lost` event say so."""
        role = "spare" if self._running() else "waiting"
        gone = "its liveness port refused a connection: its agent is gone"
        if await self._end_registration(info, logging.WARNING, f"{role} node %s: {gone}; ending its registration"):
            await self._event(info.node_id, "lost", f"{role}: {gone}")

    def _apply_event(self, event: _Wake, awaiting_write: bool) -> tuple[bool, bool]:
        """Fold one event in; whether the leader still awaits its write, and whether it may change a decision.

        A newcomer's liveness check cannot: it only marks the node as one whose port may
        later count as refused."""
        if isinstance(event, Exception):
            raise event
        if isinstance(event, _Probed):
            self._apply_probe(event)
            return awaiting_write, bool(event.suspect)
        if isinstance(event, _Judged):
            return awaiting_write, True
        if event.key == self._keys.round:
            awaiting_write = False
        self._apply(event.key, event.value if event.type is EventType.PUT else None, event.revision)
        return awaiting_write, True

    def _apply(self, key: str, value: bytes | None, revision: int) -> None:
        """Fold one key (value None: deleted) in, and what the leader makes of it."""
        records, keys = self._records, self._keys
        records.apply(key, value, revision)
        if key.startswith(keys.nodes):
            node_id = key[len(keys.nodes):]
            info, seen = records.nodes.get(node_id), self._nodes.get(node_id)
            if info is None:
                self._nodes.pop(node_id, None)
                self._forget(node_id)
            elif seen is None or seen.info != info:  # new, or registered again
                self._nodes[node_id] = SeenNode(info=info, seen_at=self._clock())
                self._forget(node_id)
                self._unchecked.add(node_id)
        elif key == keys.restart:
            restart = records.restart
            if restart is not None and self._restart is not None and self._restart.round == restart.round:
                # Peers whose collectives broke ask too, after the node that failed
                # first: the first request of a round names the failure (and its node).
                return
            if restart is not None:
                self._restart_seen_at = self._clock()
            self._restart = restart
        elif key == keys.quarantine:
            self._quarantine = records.quarantine.shifted(self._clock() - time.time())
        elif key.startswith(keys.drains) and value is not None:
            self._draining.add(key[len(keys.drains):])
        elif key.startswith(keys.departures) and value is not None:
            self._departed.add(key[len(keys.departures):])


async def close_job(store: Store, keys: Keys, outcome: str, detail: str, closed_ttl: float) -> bool:
    """Mark the job ended in its round record, which then lives `closed_ttl` more.

    Returns False when the job was closed already. The job's spec and control records
    go, so a new job with the same id starts clean once the record expires.
    """
    if not await close_round(store, keys, outcome, detail, closed_ttl):
        return False
    await clear_job_records(store, keys)
    return True


async def close_round(store: Store, keys: Keys, outcome: str, detail: str, closed_ttl: float) -> bool:
    """The part of `close_job` that ends the job: every agent sees it and exits.

    A job closed as succeeded may still be closed as failed: a node whose workers fail
    after another node's succeeded makes the job a failure (docs/concepts.md, "How a job
    ends"); nothing else changes a closed job's outcome."""
    while True:
        kv = await store.get(keys.round)
        current = decode(RoundHead, kv.value) if kv else None
        if current is not None and current.closed and (current.closed, outcome) != ("succeeded", "failed"):
            return False
        closed = replace(
            current or RoundHead(0, 0, "", 0.0),
            closed=outcome,
            detail=detail[-DETAIL_LIMIT:],
            closed_at=time.time(),
        )
        lease = await store.grant_lease(closed_ttl)
        if await store.compare_and_put(
            keys.round, encode(closed), expected_mod_revision=kv.mod_revision if kv else 0, lease=lease
        ):
            break
        await store.revoke_lease(lease)
    log.info("job '%s' closed (%s)", keys.run_id, outcome)
    return True


async def clear_job_records(store: Store, keys: Keys) -> None:
    """The part of `close_job` that clears the ended job's spec and control records.

    And its workers' keys: a job's run takes them with it."""
    for key in (keys.spec, keys.restart, keys.master, keys.state, keys.ping, keys.quarantine, keys.stacks):
        await store.delete(key)
    for folder in (keys.drains, keys.departures, keys.ranks, keys.holds, keys.workers):
        await store.delete_prefix(folder)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _registration(value: bytes) -> NodeInfo | None:
    """A node key's registration; None for another version's."""
    with contextlib.suppress(RendezvousError):
        return decode(NodeInfo, value)
    return None
