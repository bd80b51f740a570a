"""The leader's round decision: a pure function of what it sees, the settings and now.

No I/O, no clock of its own: `decide(view, settings, now)` returns the round to open, or
nothing with the reason it waits and the time to look again. That keeps the whole
membership policy in one readable place, tested without sleeping.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from elasticrun.rendezvous.state import NodeInfo, Participant, RestartRequest, Round


@dataclass(frozen=True, slots=True)
class RendezvousSettings:
    """How the rendezvous forms rounds; one job, one set of settings.

    The defaults are chosen for fast recovery: a dead node is noticed within
    `heartbeat_ttl`, a formation or scale-up waits `last_call` for stragglers.
    """

    run_id: str
    min_nodes: int
    max_nodes: int
    #: after `min_nodes` are registered (or a newcomer arrives), wait this long for more
    last_call: float = 1.0
    #: a node that gets no place in a round within this time gives up
    join_timeout: float = 600.0
    #: lease TTL: a node that stops renewing is removed after this long
    heartbeat_ttl: float = 5.0
    #: how long a closed job stays closed, so late agents exit instead of starting anew
    closed_ttl: float = 60.0
    #: seconds between lease renewals; 0: a third of heartbeat_ttl
    heartbeat_interval: float = 0.0

    @property
    def keep_alive_interval(self) -> float:
        return self.heartbeat_interval or self.heartbeat_ttl / 3


@dataclass(frozen=True, slots=True)
class SeenNode:
    """A registered node and when the leader first saw it (leader's monotonic clock)."""

    info: NodeInfo
    seen_at: float


@dataclass(frozen=True, slots=True)
class View:
    """Everything the leader knows when it decides."""

    nodes: Mapping[str, SeenNode]
    round: Round | None
    restart: RestartRequest | None = None
    #: when the leader first saw `restart` (its clock)
    restart_seen_at: float = 0.0
    #: nodes that answered the liveness ping of the current round
    acks: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Decision:
    """Open `round`, or (when None) wait, looking again at `recheck_at` at the latest.

    `ping` (a round number) asks every node of that round to show it is alive; `fail`
    ends the job as failed with that report.
    """

    reason: str
    round: Round | None = None
    recheck_at: float | None = None
    ping: int = 0
    #: end the job as failed, with this report
    fail: str = ""


def _names(nodes: list[str], limit: int = 8) -> str:
    shown = ", ".join(nodes[:limit])
    return shown + (f", ... ({len(nodes) - limit} more)" if len(nodes) > limit else "")


def _count(n: int) -> str:
    return f"{n} node" if n == 1 else f"{n} nodes"


def _participant(node: SeenNode) -> Participant:
    return Participant(node_id=node.info.node_id, addr=node.info.addr, nproc=node.info.nproc)


def decide(view: View, settings: RendezvousSettings, now: float) -> Decision:
    """The next round, or why there is none yet.

    Survivors keep their order (and so their node ranks); newcomers go last in the
    order the leader saw them. A lost node ends the round at once; a newcomer is
    admitted after the last call; a worker failure restarts the same members.
    """
    current = view.round
    if current is not None and current.closed:
        return Decision(reason=f"job {current.closed}")
    members = current.participants if current else ()
    member_ids = {p.node_id for p in members}
    survivors = [p for p in members if p.node_id in view.nodes]
    lost = [p.node_id for p in members if p.node_id not in view.nodes]
    newcomers = sorted(
        (n for n in view.nodes.values() if n.info.node_id not in member_ids),
        key=lambda n: (n.seen_at, n.info.node_id),
    )
    admitted = newcomers[: max(settings.max_nodes - len(survivors), 0)]
    number = current.number + 1 if current else 1
    restarts = current.restart_count if current else 0

    def open_round(group: list[Participant], reason: str, restart_count: int = restarts) -> Decision:
        return Decision(
            reason=reason,
            round=Round(
                number=number,
                participants=tuple(group),
                restart_count=restart_count,
                reason=reason,
                opened_at=0.0,  # stamped with wall time by the writer
            ),
        )

    group = survivors + [_participant(n) for n in admitted]
    joined = f"; joined: {_names([n.info.node_id for n in admitted])}" if admitted else ""

    if lost:
        reason = f"lost {_names(lost)}"
        if len(group) >= settings.min_nodes:
            return open_round(group, reason + joined)
        # Too few to continue: an empty round stops the survivors' workers now.
        return open_round([], f"{reason}; {_waiting(list(view.nodes), settings)}")

    restart = view.restart
    if current is not None and members and restart is not None and restart.round == current.number:
        # A peer that died breaks the others' collectives too, and their workers fail
        # before its lease expires. Only when every member shows it is alive is this a
        # worker failure (spending the budget); a dead one's lease expires first.
        silent = [p.node_id for p in members if p.node_id not in view.acks]
        deadline = view.restart_seen_at + settings.heartbeat_ttl
        if silent and now < deadline:
            return Decision(
                reason=f"worker failure on {restart.node_id}: checking that every node is "
                f"alive (no answer yet from {_names(silent)})",
                recheck_at=deadline,
                ping=current.number,
            )
        if restart.final:
            return Decision(reason=f"job failed on {restart.node_id}: {restart.reason}", fail=restart.report or restart.reason)
        return open_round(
            group,
            f"restart after a worker failure on {restart.node_id}: {restart.reason}{joined}",
            restart_count=restarts + 1,
        )

    if members:
        if not admitted:
            full = f" ({len(newcomers)} waiting, max {settings.max_nodes} reached)" if newcomers else ""
            return Decision(reason=f"round {current.number} running with {_count(len(members))}{full}")  # type: ignore[union-attr]
        deadline = admitted[0].seen_at + settings.last_call
        if len(group) >= settings.max_nodes or now >= deadline:
            return open_round(group, f"scale up to {_count(len(group))}{joined}")
        return Decision(
            reason=f"last call for more nodes: {len(admitted)} waiting to join "
            f"{len(members)} running (max {settings.max_nodes})",
            recheck_at=deadline,
        )

    if len(newcomers) < settings.min_nodes:
        return Decision(reason=_waiting([n.info.node_id for n in newcomers], settings))
    deadline = newcomers[settings.min_nodes - 1].seen_at + settings.last_call
    if len(admitted) >= settings.max_nodes or now >= deadline:
        return open_round(group, f"formed with {_count(len(group))}: {_names([p.node_id for p in group])}")
    return Decision(
        reason=f"last call for more nodes: {len(newcomers)} registered "
        f"(min {settings.min_nodes}, max {settings.max_nodes})",
        recheck_at=deadline,
    )


def _waiting(registered: list[str], settings: RendezvousSettings) -> str:
    names = f": {_names(sorted(registered))}" if registered else ""
    return (
        f"waiting for nodes: {len(registered)} of min {settings.min_nodes} registered "
        f"(max {settings.max_nodes}){names}"
    )
