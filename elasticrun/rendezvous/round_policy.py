"""The leader's round decision: a pure function of what it sees, the settings and now.

No I/O, no clock of its own: `decide_round(view, settings, now)` returns the round to open, or
nothing with the reason it waits and the time to look again. That keeps the whole
membership policy in one readable place, tested without sleeping.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from elasticrun.rendezvous.quarantine import QuarantineBook
from elasticrun.rendezvous.records import RestartRequest
from elasticrun.rendezvous.rounds import Participant, Round
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.rendezvous.view import Decision, SeenNode, View
from elasticrun.rendezvous.wording import duration, names, plural


def _lost_reason(missing: list[str], back: list[str], view: View, dead: tuple[str, ...] = ()) -> str:
    """Why members left the round.

    Drained by an operator, left on purpose (a signal, a sick GPU), gone without a word
    (dead, frozen, cut off), or back with a new registration. Calling a node that left
    on purpose lost would send whoever reads the survivors' logs looking for a crash.
    A node lost without a word either failed the liveness check (`dead`, said by the
    caller) or its lease lapsed, which is said here: a bare `lost` names no cause."""
    drained = [n for n in missing if n in view.draining]
    left = [n for n in missing if n in view.departed and n not in view.draining]
    lost = [n for n in missing if n not in view.draining and n not in view.departed]
    parts = [f"drained {names(drained)}"] if drained else []
    if left:
        parts.append(f"{names(left)} left")
    if lost:
        lapsed = [n for n in lost if n not in dead]
        cause = "its lease lapsed, no heartbeat: dead, frozen or cut off from the store"
        if lapsed == lost:
            parts.append(f"lost {names(lost)} ({cause})")
        elif lapsed:
            parts.append(f"lost {names(lost)} ({names(lapsed)}: {cause})")
        else:
            parts.append(f"lost {names(lost)}")
    if back:
        parts.append(f"{names(back)} registered again")
    return "; ".join(parts)


def decide_round(view: View, settings: RendezvousSettings, now: float) -> Decision:
    """The next round, or why there is none yet.

    Survivors keep their order; newcomers, in the order the leader saw them, first take
    the places of members that left, then go last: where as many nodes run as before,
    every node rank stays where it was. A lost node ends the round at once; a newcomer is
    admitted after the last call; a worker failure restarts the same members.

    Quarantine: worker failures attributed to a node and its drops out of a round are
    counted; after `quarantine_after` of them the node is kept out of rounds for a
    cooldown that doubles with each repeat. A quarantined node is still taken when the
    job could not run without it (fewer than `min_nodes` otherwise): a flapping node
    costs restarts, a job that stops costs more. A node that left asking to be kept
    out (sick, or too slow) is quarantined at once, with the reason it gave. Changes to
    the table come back in `Decision.quarantine`, for the leader to store.
    """
    current = view.round
    if current is not None and current.closed:
        return Decision(reason=f"job {current.closed}", ended=True)
    book = QuarantineBook(view.quarantine, settings, now)
    settled = _hold_kept_out(view, book)
    decision = _decide(view, settings, now, book)
    if settled:
        decision = replace(decision, settled=settled)
    if decision.round is None:
        decision = replace(decision, recheck_at=earliest(decision.recheck_at, book.release_at(view.nodes)))
    table = book.table()
    if table != view.quarantine:
        decision = replace(decision, quarantine=table)
    return decision


def _hold_kept_out(view: View, book: QuarantineBook) -> tuple[str, ...]:
    """Quarantine the nodes that left asking to be kept out, once their registration is gone.

    A node writes its departure, then gives up its lease. Returns the ones that are.

    A node held already is not held again: a new leader finds the records its
    predecessor acted on, and a member's record stays until the round without it."""
    gone = tuple(sorted(n for n in view.keep_out if n not in view.nodes))
    for node_id in gone:
        if not book.blocked(node_id):
            book.hold(node_id, view.keep_out[node_id])
    return gone


def _decide(view: View, settings: RendezvousSettings, now: float, book: QuarantineBook) -> Decision:
    """The policy in order: a member lost, a worker failure, else who joins or leaves."""
    case = _assess(view, settings, now, book)
    short = _no_majority(view, case)
    if short:
        # Members that still run the round stop their workers (an empty round); where
        # none does (every member here registered again: a successor's store), the
        # round stays, and with it the members that count towards the majority.
        return case.open_round([], short) if case.survivors else Decision(reason=short)
    if case.lost:
        return _after_loss(case)
    restart = _pending_restart(view)
    if restart is not None:
        return _after_failure(case, restart)
    pick = _pick(case.members, case.survivors, case.newcomers, book, settings)
    slow_note = ""
    if view.slow and case.members and not pick.kept_out:
        slow_note = _keep_out_slow(view.slow, case.members, case.survivors, case.newcomers, book, settings)
        if not slow_note:
            pick = _pick(case.members, case.survivors, case.newcomers, book, settings)
    held = book.held_note(view.nodes, [p.node_id for p in pick.group]) + slow_note
    if case.members and pick.kept_out and len(pick.group) >= settings.min_nodes:
        return _replace_quarantined(case, pick, held)
    if case.current is not None and case.members:
        return _running(case, case.current, pick, held)
    return _forming(case, pick, held)


def _no_majority(view: View, case: _Case) -> str:
    """Why no round may open: another store may serve the job; "" when one may.

    When a node that may serve the job's store elsewhere (the agent that named the
    successors, or a successor) is neither registered here nor seen to go (it left,
    was drained, or its liveness port refused), this side may be one of a partition's
    two: it goes on only with a majority of the round the successors were named for,
    its members registered here (the leader keeps that round's members). The two sides of a
    partition never both have one (docs/concepts.md, "Never two jobs")."""
    named = view.successors
    if named is None:
        return ""
    accounted = view.nodes.keys() | view.departed | view.draining | view.refused
    unaccounted = [n for n in (named.serving, *(s.node_id for s in named.nodes)) if n not in accounted]
    if not unaccounted:
        return ""
    if view.named_members:
        here = set(view.named_members & view.nodes.keys())
    else:  # that round's members are not at hand: those of the current one, and who ran it
        here = {p.node_id for p in case.members if p.node_id in view.nodes}
        here |= {n for n, seen in view.nodes.items() if seen.info.ran_round >= named.round}
    if len(here) >= named.quorum:
        return ""
    return (
        f"waiting for a majority of round {named.round}'s nodes ({len(here)} of {named.quorum} here): "
        f"{names(unaccounted)} may serve the job's store elsewhere (a partition)"
    )


@dataclass(slots=True)
class _Case:
    """What became of the current round's members, and the next round's number and budget."""

    view: View
    settings: RendezvousSettings
    now: float
    book: QuarantineBook
    current: Round | None
    members: tuple[Participant, ...]
    #: members still registered and alive, in their order
    survivors: list[Participant]
    #: members gone: their registration vanished, or found dead (`dead`)
    missing: list[str]
    #: members registered again since they ran the round: they left it
    back: list[str]
    #: registered nodes that are not members
    newcomers: list[SeenNode]
    number: int
    restarts: int
    forgiven: int
    #: members found dead by the liveness check
    dead: tuple[str, ...]

    @property
    def lost(self) -> list[str]:
        return self.missing + self.back

    def open_round(
        self, group: list[Participant], reason: str, restart_count: int | None = None, forgiven_count: int | None = None
    ) -> Decision:
        return Decision(
            reason=reason,
            dead=self.dead,
            round=Round(
                number=self.number,
                participants=tuple(group),
                restart_count=self.restarts if restart_count is None else restart_count,
                reason=reason,
                opened_at=0.0,  # stamped with wall time by the writer
                forgiven=self.forgiven if forgiven_count is None else forgiven_count,
            ),
        )


def _pending_restart(view: View) -> RestartRequest | None:
    """The restart request of the current round, if a member asked for one."""
    current, restart = view.round, view.restart
    if current is not None and current.participants and restart is not None and restart.round == current.number:
        return restart
    return None


def _assess(view: View, settings: RendezvousSettings, now: float, book: QuarantineBook) -> _Case:
    """Who of the current round is still there, who is lost, who is new."""
    current = view.round
    members = current.participants if current else ()
    # A member registered with a round at or past the current one has run it and
    # registered again since (its membership lapsed, or the store restarted): it
    # stopped its workers, so it left the round, and comes back as a newcomer.
    number_now = current.number if current else 0
    back = [
        p.node_id for p in members if p.node_id in view.nodes and view.nodes[p.node_id].info.ran_round >= number_now
    ]
    survivors = [p for p in members if p.node_id in view.nodes and p.node_id not in back]
    missing = [p.node_id for p in members if p.node_id not in view.nodes]
    # Above every round a registered node ran, with the highest budget spent: a store
    # that restarted empty has no round record, and its rounds must not start over.
    ran = [n.info for n in view.nodes.values()]
    number = max([number_now, *(i.ran_round for i in ran)]) + 1
    restarts = max([current.restart_count if current else 0, *(i.ran_restarts for i in ran)])
    forgiven = max([current.forgiven if current else 0, *(i.ran_forgiven for i in ran)])
    dead: tuple[str, ...] = ()
    if _pending_restart(view) is not None:
        # A member that has not answered the liveness ping within a lease TTL is dead,
        # whether or not the store has expired its lease yet (etcd expires leases late):
        # failing the job, or restarting with it, would blame the living for its death.
        # A member whose liveness port refused a connection is gone now: its kernel
        # closed the port as the agent died (a stopped or slow one still accepts).
        silent = {p.node_id for p in survivors if p.node_id not in view.acks}
        gone = silent if now >= view.restart_seen_at + settings.heartbeat_ttl else silent & view.refused
        if gone:
            survivors = [p for p in survivors if p.node_id not in gone]
            missing += sorted(gone)
            dead = tuple(sorted(gone))
    not_new = set(missing) | {p.node_id for p in survivors}
    newcomers = [n for n in view.nodes.values() if n.info.node_id not in not_new]
    return _Case(
        view=view, settings=settings, now=now, book=book, current=current, members=members, survivors=survivors,
        missing=missing, back=back, newcomers=newcomers, number=number, restarts=restarts, forgiven=forgiven,
        dead=dead,
    )


def _after_loss(case: _Case) -> Decision:
    """Members left: the next round at once, with whoever can take part, or an empty one."""
    view, settings, book, current = case.view, case.settings, case.book, case.current
    assert current is not None
    # A node that drops out of rounds while the others stay is flapping (one that
    # said it leaves, drained or not, is not: it was preempted or asked). When no
    # member stayed, the store stalled or restarted (or the whole job went down):
    # that is nobody's fault, and counting it would quarantine every node.
    if case.survivors and book.counts(current.number):
        for node_id in case.missing:
            if node_id not in view.draining and node_id not in view.departed:
                book.count(node_id, f"dropped out of round {current.number}")
    pick = _pick(case.members, case.survivors, case.newcomers, book, settings)
    reason = _lost_reason(case.missing, case.back, view, case.dead)
    if set(case.dead) & view.refused:
        reason += f" (agent gone: {names(sorted(set(case.dead) & view.refused))} refused the liveness check)"
    if len(pick.group) >= settings.min_nodes:
        return case.open_round(pick.group, reason + pick.joined + pick.notes(book, settings))
    # Too few to continue: an empty round stops the survivors' workers now.
    registered = _waiting(list(view.nodes), settings)
    return case.open_round([], f"{reason}{pick.notes(book, settings)}; {registered}{book.held_note(view.nodes, ())}")


def _after_failure(case: _Case, restart: RestartRequest) -> Decision:
    """A member's workers failed: once every member showed it is alive, restart them all."""
    view, settings, book = case.view, case.settings, case.book
    # A peer that died breaks the others' collectives too, and their workers fail
    # before its lease expires. Only when every member shows it is alive is this a
    # worker failure (spending the budget); a dead one's lease expires first.
    unanswered = [p.node_id for p in case.members if p.node_id not in view.acks]
    deadline = view.restart_seen_at + settings.heartbeat_ttl
    if unanswered and case.now < deadline:
        return Decision(
            reason=f"worker failure on {restart.node_id}: checking that every node is "
            f"alive (no answer yet from {names(unanswered)})",
            recheck_at=deadline,
            ping=restart.round,
        )
    if restart.final:
        return Decision(
            reason=f"job failed on {restart.node_id}: {restart.reason}", fail=restart.report or restart.reason
        )
    if book.counts(restart.round):
        book.count(restart.node_id, f"worker failure: {restart.reason}")
    pick = _pick(case.members, case.survivors, case.newcomers, book, settings)
    free = " (forgiven: the workers had made progress)" if restart.forgiven else ""
    return case.open_round(
        pick.group,
        f"restart after a worker failure on {restart.node_id}: {restart.reason}{free}"
        f"{pick.joined}{pick.notes(book, settings)}",
        restart_count=case.restarts + 1,
        forgiven_count=case.forgiven + restart.forgiven,
    )


def _replace_quarantined(case: _Case, pick: _Pick, held: str) -> Decision:
    """A member under quarantine goes, free: at once, or after a last call for its stand-in.

    At once when the others are enough; else the newcomers that take its place get the
    last call. A new leader found it quarantined, or it was only kept while the job
    needed it."""
    settings, group, admitted = case.settings, pick.group, pick.admitted
    reason = f"quarantined {names(pick.kept_out)}{pick.joined}{pick.notes(case.book, settings)}"
    if len(group) - len(admitted) >= settings.min_nodes or len(group) >= settings.max_nodes:
        return case.open_round(group, reason)
    deadline = case.book.arrival(admitted[0]) + settings.last_call
    if case.now >= deadline:
        return case.open_round(group, reason)
    return Decision(
        reason=f"last call for more nodes: {len(admitted)} waiting to replace quarantined "
        f"{names(pick.kept_out)}{held}",
        recheck_at=deadline,
    )


def _running(case: _Case, current: Round, pick: _Pick, held: str) -> Decision:
    """A round runs: it goes on, or scales up after the last call for the newcomers."""
    settings, members, group, admitted = case.settings, case.members, pick.group, pick.admitted
    if not admitted:
        blocked = case.book.held()
        waiting = [n for n in case.newcomers if n.info.node_id not in blocked]
        full = f" ({_spares(len(waiting), len(members), settings)})" if waiting else ""
        return Decision(reason=f"round {current.number} running with {plural(len(members), 'node')}{full}{held}")
    # the last call runs from the arrival that completed the first new unit
    deadline = case.book.arrival(admitted[min(settings.node_unit, len(admitted)) - 1]) + settings.last_call
    if len(group) >= settings.max_nodes or case.now >= deadline:
        notes = pick.notes(case.book, settings)
        return case.open_round(group, f"scale up to {plural(len(group), 'node')}{pick.joined}{notes}")
    return Decision(
        reason=f"last call for more nodes: {len(admitted)} waiting to join "
        f"{len(members)} running (max {settings.max_nodes}){held}",
        recheck_at=deadline,
    )


def _forming(case: _Case, pick: _Pick, held: str) -> Decision:
    """No round runs: wait for min nodes, then the last call, then form the first."""
    settings, group, admitted = case.settings, pick.group, pick.admitted
    if len(group) < settings.min_nodes:
        return Decision(reason=_waiting([n.info.node_id for n in case.newcomers], settings) + held)
    deadline = case.book.arrival(admitted[settings.min_nodes - 1]) + settings.last_call
    if len(admitted) >= settings.max_nodes or case.now >= deadline:
        formed = f"{plural(len(group), 'node')}: {names([p.node_id for p in group])}"
        return case.open_round(group, f"formed with {formed}{pick.notes(case.book, settings)}")
    return Decision(
        reason=f"last call for more nodes: {len(admitted)} registered "
        f"(min {settings.min_nodes}, max {settings.max_nodes}){held}",
        recheck_at=deadline,
    )


def _keep_out_slow(
    slow: tuple[tuple[str, str], ...],
    members: tuple[Participant, ...],
    survivors: list[Participant],
    newcomers: list[SeenNode],
    book: QuarantineBook,
    settings: RendezvousSettings,
) -> str:
    """Quarantine the slowest straggler whose going leaves a whole round of at least min nodes.

    A spare or a newcomer takes its place, or the job shrinks within its range. Returns
    "" when one is; else a note on why none was taken out. One at a time."""
    running = {p.node_id for p in survivors}
    for node_id, why in slow:
        if node_id not in running:
            continue
        before = book.entries.get(node_id)
        book.hold(node_id, f"straggler: {why}")
        trial = _pick(members, survivors, newcomers, book, settings)
        if node_id not in {p.node_id for p in trial.group} and len(trial.group) >= settings.min_nodes:
            return ""
        book.undo_hold(node_id, before)
    still = [n for n, _ in slow if n in running]
    if not still:
        return ""
    return (
        f"; straggler {names(still)} kept: no spare, and the job runs at its minimum of "
        f"{plural(settings.min_nodes, 'node')}"
    )


@dataclass(slots=True)
class _Pick:
    """Who takes part in the next round, and who is left out or kept in, and why."""

    group: list[Participant]
    admitted: list[SeenNode]
    #: members under quarantine left out
    kept_out: list[str]
    #: nodes under quarantine taken all the same: without them the job could not run
    last_resort: list[str]

    @property
    def joined(self) -> str:
        joined = [n.info.node_id for n in self.admitted]
        return f"; joined: {names(joined)}" if joined else ""

    def notes(self, book: QuarantineBook, settings: RendezvousSettings) -> str:
        """Who this decision quarantined, and who was kept all the same."""
        text = "".join(
            f"; quarantined {n} for {duration(book.entries[n].until - book.now)} ({book.entries[n].reason})"
            for n in book.new
        )
        if self.last_resort:
            them = "it" if len(self.last_resort) == 1 else "them"
            without = len(self.group) - len(self.last_resort)
            text += (
                f"; kept {names(self.last_resort)} despite the quarantine: without {them} only "
                f"{without} of min {settings.min_nodes} nodes"
            )
        return text


def _pick(
    members: tuple[Participant, ...],
    survivors: list[Participant],
    newcomers: list[SeenNode],
    book: QuarantineBook,
    settings: RendezvousSettings,
) -> _Pick:
    """Survivors in their order, newcomers by arrival in the places members left, up to max.

    No quarantined node unless the job needs it to reach min (then the fewest, members
    first); then placed, and cut to whole node units (`_in_units`)."""
    held = book.held()
    waiting = sorted(newcomers, key=lambda n: (book.arrival(n), n.info.node_id))
    fine_new = [n for n in waiting if n.info.node_id not in held]
    fine_survivors = [p for p in survivors if p.node_id not in held]
    admitted = list(fine_new[: max(settings.max_nodes - len(fine_survivors), 0)])
    taken: set[str] = set()
    short = settings.min_nodes - len(fine_survivors) - len(admitted)
    if short > 0:
        spare = [p.node_id for p in survivors if p.node_id in held]
        spare += [n.info.node_id for n in waiting if n.info.node_id in held]
        if len(spare) >= short:
            taken = set(spare[:short])
    group = [p for p in survivors if p.node_id not in held or p.node_id in taken]
    admitted += [n for n in waiting if n.info.node_id in held and n.info.node_id in taken]
    kept_out = [p.node_id for p in survivors if p.node_id in held and p.node_id not in taken]
    group, admitted = _in_units(members, group, admitted, settings)
    chosen = {p.node_id for p in group}
    return _Pick(group=group, admitted=admitted, kept_out=kept_out, last_resort=sorted(taken & chosen))


def _in_units(
    members: tuple[Participant, ...], kept: list[Participant], admitted: list[SeenNode], settings: RendezvousSettings
) -> tuple[list[Participant], list[SeenNode]]:
    """The group cut to a multiple of the node unit, with node ranks kept where they can be.

    The round's members keep their places; a newcomer (a spare first: spares are the
    earliest arrivals) takes the place of a member that left, so that where as many
    nodes run as before every survivor keeps its node rank and the newcomer takes the
    lost one's (its workers resume the lost ranks' state from a buddy,
    elasticrun.agent.state_replicas), and a unit a member left stays one unit at the
    same node ranks; the newcomers left over go last. With fewer nodes than before
    the survivors close up, in their order. When the nodes are
    not a whole number of units, the ones that go (and wait as spares) are the
    survivors of units that lost a member, the last such unit first, then the last
    nodes: intact units stay together.
    """
    unit = settings.node_unit
    kept_ids = {p.node_id for p in kept}
    slots: list[Participant | None] = [m if m.node_id in kept_ids else None for m in members]
    queue = [n.participant for n in admitted]
    for i, slot in enumerate(slots):
        if slot is None and queue:
            slots[i] = queue.pop(0)
    slots += queue
    filled = [i for i, slot in enumerate(slots) if slot is not None]
    excess = len(filled) - min(settings.max_nodes, len(filled) // unit * unit)
    broken = [i for i in filled if any(s is None for s in slots[i - i % unit : i - i % unit + unit])]
    for i in [*reversed(broken), *reversed(filled)]:
        if excess <= 0:
            break
        if slots[i] is not None:
            slots[i] = None
            excess -= 1
    group = [slot for slot in slots if slot is not None]
    chosen = {p.node_id for p in group}
    return group, [n for n in admitted if n.info.node_id in chosen]


def _spares(waiting: int, running: int, settings: RendezvousSettings) -> str:
    """What the registered nodes outside a running round wait for, as spares."""
    spares = plural(waiting, "spare")
    if running >= settings.max_nodes:
        return f"{spares}, max {settings.max_nodes} reached"
    return f"{spares}, node unit {settings.node_unit}"


def earliest(a: float | None, b: float | None) -> float | None:
    """The earlier of two times to look again, either of which may be none."""
    return b if a is None else a if b is None else min(a, b)


def _waiting(registered: list[str], settings: RendezvousSettings) -> str:
    listed = f": {names(sorted(registered))}" if registered else ""
    return (
        f"waiting for nodes: {len(registered)} of min {settings.min_nodes} registered "
        f"(max {settings.max_nodes}){listed}"
    )
