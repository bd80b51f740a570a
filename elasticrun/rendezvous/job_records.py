"""A job's records as last read from the store: `JobRecords`, where a key becomes a record.

The rendezvous, the leader and job control all fold what they read through
`JobRecords.apply`, so that the store's layout is read in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elasticrun.rendezvous.codec import R, decode
from elasticrun.rendezvous.keys import Keys
from elasticrun.rendezvous.records import (
    Departure,
    DrainRequest,
    Event,
    JobLaunch,
    JobSpec,
    LeaderState,
    Master,
    NodeInfo,
    NodeStatus,
    Ping,
    QuarantineEntry,
    QuarantineTable,
    RestartRequest,
    StacksRequest,
    StepReport,
    StragglerReport,
    Successors,
)
from elasticrun.rendezvous.rounds import RankShard, Round, RoundHead, join_round


@dataclass(slots=True)
class JobRecords:
    """A job's records as last read from the store: the one place a key becomes a record.

    The rendezvous folds in what it watches (`r/job/`), the leader `r/`, job control the
    whole job; each then reads the fields it needs. Output windows (`c/logs/`) and the
    nodes' stacks (`c/stacks/`) are not kept: only `elasticrun logs` and `elasticrun
    stacks` read them.
    """

    keys: Keys
    #: the round's head: what a node watching r/job/ knows of the round
    head: RoundHead | None = None
    #: the rounds' shards read so far, by folder and shard (the leader and job
    #: control see them; a node reads only its own)
    shards: dict[str, dict[int, RankShard]] = field(default_factory=dict)
    #: the round key's mod revision: the leader writes the next round against it
    round_revision: int = 0
    #: the leader state's: a waiting node trusts the leader's reason only when it was
    #: published after what the node knows (the round, its own registration)
    state_revision: int = 0
    #: the leader's node id (its key holds the bare id, which it compares and sets)
    leader: str = ""
    master: Master | None = None
    ping: Ping | None = None
    spec: JobSpec | None = None
    state: LeaderState | None = None
    launch: JobLaunch | None = None
    restart: RestartRequest | None = None
    #: the latest request for every node's stacks, and its mod revision
    stacks: StacksRequest | None = None
    stacks_revision: int = 0
    quarantine: QuarantineTable = field(default_factory=QuarantineTable)
    #: the records kept one per node (or per event), by the name that ends their key
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    holds: dict[str, QuarantineEntry] = field(default_factory=dict)
    acks: dict[str, Ping] = field(default_factory=dict)
    drains: dict[str, DrainRequest] = field(default_factory=dict)
    departures: dict[str, Departure] = field(default_factory=dict)
    statuses: dict[str, NodeStatus] = field(default_factory=dict)
    events: dict[str, Event] = field(default_factory=dict)
    steps: dict[str, StepReport] = field(default_factory=dict)
    stragglers: StragglerReport | None = None
    successors: Successors | None = None
    #: `round`, put together once per change of the head or a shard
    _joined: tuple[Round | None] | None = field(default=None, repr=False, compare=False)

    @property
    def round(self) -> Round | None:
        """The current round with its members, once its head and every shard are read.

        A closed round comes with its members still at hand, if any."""
        if self._joined is None:
            head = self.head
            self._joined = (None if head is None else join_round(head, self.shards.get(head.ranks, {})),)
        return self._joined[0]

    def apply(self, key: str, value: bytes | None, revision: int = 0) -> None:
        """Fold one key in: `value` is what it holds at `revision`, None once deleted."""
        keys = self.keys
        if key.startswith(keys.ranks):
            folder, _, shard = key[len(keys.ranks):].partition("/")
            held = self.shards.setdefault(folder, {})
            _fold(held, int(shard), RankShard, value)
            if not held:
                del self.shards[folder]
            self._joined = None
        elif key.startswith(keys.nodes):
            _fold(self.nodes, key[len(keys.nodes):], NodeInfo, value)
        elif key.startswith(keys.acks):
            _fold(self.acks, key[len(keys.acks):], Ping, value)
        elif key.startswith(keys.drains):
            _fold(self.drains, key[len(keys.drains):], DrainRequest, value)
        elif key.startswith(keys.departures):
            _fold(self.departures, key[len(keys.departures):], Departure, value)
        elif key.startswith(keys.holds):
            _fold(self.holds, key[len(keys.holds):], QuarantineEntry, value)
        elif key.startswith(keys.statuses):
            _fold(self.statuses, key[len(keys.statuses):], NodeStatus, value)
        elif key.startswith(keys.events):
            _fold(self.events, key[len(keys.events):], Event, value)
        elif key.startswith(keys.steps):
            _fold(self.steps, key[len(keys.steps):], StepReport, value)
        elif key == keys.stragglers:
            self.stragglers = _read(StragglerReport, value)
        elif key == keys.round:
            self.head = _read(RoundHead, value)
            self._joined = None
            self.round_revision = revision if value is not None else 0
        elif key == keys.leader:
            self.leader = value.decode() if value is not None else ""
        elif key == keys.master:
            self.master = _read(Master, value)
        elif key == keys.ping:
            self.ping = _read(Ping, value)
        elif key == keys.spec:
            self.spec = _read(JobSpec, value)
        elif key == keys.state:
            self.state = _read(LeaderState, value)
            self.state_revision = revision if value is not None else 0
        elif key == keys.launch:
            self.launch = _read(JobLaunch, value)
        elif key == keys.restart:
            self.restart = _read(RestartRequest, value)
        elif key == keys.stacks:
            self.stacks = _read(StacksRequest, value)
            self.stacks_revision = revision if value is not None else 0
        elif key == keys.successors:
            self.successors = _read(Successors, value)
        elif key == keys.quarantine:
            self.quarantine = _read(QuarantineTable, value) or QuarantineTable()


def _read(kind: type[R], value: bytes | None) -> R | None:
    return None if value is None else decode(kind, value)


def _fold(records: dict[Any, R], name: Any, kind: type[R], value: bytes | None) -> None:
    if value is None:
        records.pop(name, None)
    else:
        records[name] = decode(kind, value)
