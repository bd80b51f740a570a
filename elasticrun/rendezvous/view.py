"""What the leader's decision sees (`View`, its `SeenNode`s) and what it returns (`Decision`).

Plain frozen records: the leader builds a View from its watch (`leader.py`), the pure
`decide_round()` (`round_policy.py`) turns it into a Decision, and the leader carries it out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from elasticrun.rendezvous.records import NodeInfo, QuarantineTable, RestartRequest, Successors
from elasticrun.rendezvous.rounds import Participant, Round


@dataclass(frozen=True, slots=True)
class SeenNode:
    """A registered node and when the leader first saw it (leader's monotonic clock).

    Its `participant` is made once: a decision puts every waiting node in a group, and
    at 10,000 nodes building them anew was a quarter of each decision's time."""

    info: NodeInfo
    seen_at: float
    participant: Participant = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        info = self.info
        object.__setattr__(self, "participant", Participant(node_id=info.node_id, addr=info.addr, nproc=info.nproc))


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
    #: failure records and quarantines, with times on the leader's clock (as `now`)
    quarantine: QuarantineTable = QuarantineTable()
    #: nodes an operator asked to leave (`elasticrun drain`): their going is no failure
    draining: frozenset[str] = frozenset()
    #: nodes that said they leave on purpose (a signal, a drain, a sick GPU): nor is theirs
    departed: frozenset[str] = frozenset()
    #: of those, the nodes that asked to be kept out (`Departure.keep_out`), with their
    #: reason: each is quarantined with it once its registration is gone
    keep_out: Mapping[str, str] = field(default_factory=dict)
    #: members whose liveness port refused the leader's connection after the current
    #: round's restart request (their port had accepted one before): their agent is gone
    refused: frozenset[str] = frozenset()
    #: members of the current round named stragglers, the slowest first, with why
    #: (--straggler=replace): one is kept out when a spare or the elastic range allows
    slow: tuple[tuple[str, str], ...] = ()
    #: who takes the built-in store over, as last named: while one of them (or the agent
    #: that named them) is unaccounted for, a round needs a majority (`round_policy._no_majority`)
    successors: Successors | None = None
    #: the members of the round `successors` were named for (empty: not at hand)
    named_members: frozenset[str] = frozenset()


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
    #: the quarantine table changed: store this one (before the round)
    quarantine: QuarantineTable | None = None
    #: members declared dead because they did not answer the liveness ping for a
    #: lease TTL, or their liveness port refused a connection: the leader ends their
    #: registrations (the store keeps a dead node's lease until its TTL, etcd even
    #: longer), or the next decision would admit them again as newcomers
    dead: tuple[str, ...] = ()
    #: the job has ended: there is nothing left to lead (a round after it would
    #: re-form a job that every agent already took for finished)
    ended: bool = False
    #: nodes of `View.keep_out` that are gone and held by the quarantine: their
    #: departure has done its work, and the leader deletes the records of those outside
    #: the round (a member's goes with the round that lets it go, as any departure's),
    #: so that each departure holds its node once
    settled: tuple[str, ...] = ()
