"""The records the rendezvous keeps in the store, their keys, and their JSON form.

Everything stored is versioned JSON (never pickle), so any tool (`elasticrun status`,
`etcdctl get`) can read it, and a newer agent can refuse a record it does not understand.

Key layout, one prefix per job (`/elasticrun/<run_id>/`); the rendezvous lives under
`r/`, what job control reads under `c/`:

    r/nodes/<node_id>   NodeInfo, bound to the node's lease: vanishes when the node dies
    r/restart           RestartRequest, written by a node whose workers failed
    r/acks/<node_id>    Ack: the node answers a liveness ping, bound to its lease
    r/job/round         RoundHead: the current round without its members (or the job's end)
    r/ranks/<n>-<leader>/<shard>  RankShard: round n's members whose id hashes to <shard>
    r/job/leader        the leader's node id, bound to its lease
    r/job/master        Master: MASTER_ADDR/PORT of the current round, by its node rank 0
    r/job/ping          Ping: the leader asks every node to show it is alive
    r/job/spec          JobSpec: what every node must agree on; a node with another is refused
    r/job/state         LeaderState: what the leader waits for, for waiting nodes and status
    r/job/launch        JobLaunch: when and where the job was started (for status and join)
    r/job/drain/<node>  DrainRequest: an operator asked this node to leave
    r/job/stacks        StacksRequest: every node is asked for its workers' stacks; then the summary
    r/left/<node_id>    Departure: the node leaves on purpose (the leader says it left, not
                        that it was lost; one with keep_out is quarantined), deleted by
                        the leader once it let the node go
    r/quarantine        QuarantineTable: failures per node, and who is kept out until when
    r/holds/<node_id>   QuarantineEntry: the node's latest quarantine, for the node to read
    c/status/<node_id>  NodeStatus: the node's live state, bound to its lease
    c/logs/<rank>       LogWindow: the latest lines of one rank, bound to its node's lease
    c/events/<t>-<node> Event: what happened, oldest pruned by the leader
    c/steps/<node_id>   StepReport: the node's step compute time, bound to its lease
    c/stragglers        StragglerReport: the nodes the leader names as stragglers
    c/stacks/<node_id>  NodeStacks: the node's answer to a StacksRequest, bound to its lease

Only the leader watches `r/`; every node watches `r/job/`. A membership change
therefore costs O(1) events per node, which is what lets one round span thousands of
nodes, and the busy `c/` records (output windows) never wake the leader.

A round is stored in two parts so that what a node reads of it does not grow with the
job: the head (`r/job/round`, a few hundred bytes, seen by every node's watch) and
its members in shards of about `SHARD_SIZE` (`r/ranks/`, which no node watches); a
node reads the one shard its id hashes to (`shard_of`). A round's bytes are then O(N)
in total, not O(N) to every node. The leader, which watches `r/`, and job control,
which reads the whole job, put the shards back together into the `Round` that
`decide()` made (`JobRecords.round`). The failure records are kept out of `r/job/` for
the same reason: the table has an entry per node that ever failed (a thousand after a
mass drop-out), so a quarantined node reads only its own hold (`r/holds/<node_id>`),
and only when the leader's state says some node is kept out.

`encode` and `decode` are the only JSON codec, and `JobRecords.apply` the only place a
key becomes its record: the rendezvous, the leader and job control all read through it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import typing
import zlib
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, TypeVar

from elasticrun.errors import RendezvousError, SpecMismatchError

# the store prefix under which every job has its own (`elasticrun list` reads it): the
# store knows it too, as it keeps each job's worker keys under it (credentials.py)
from elasticrun.store.credentials import JOBS_PREFIX, RUN_RECORD, worker_prefix

FORMAT_VERSION = 1

#: members per stored round shard, on average: what one node reads of a round
SHARD_SIZE = 64

#: the job spec's own version, bumped whenever what a spec holds changes: a node whose
#: spec has another version is refused as a mismatch, never compared field by field
JOB_SPEC_VERSION = 3


def job_prefix(run_id: str) -> str:
    """The store prefix that holds everything of one job."""
    return f"{JOBS_PREFIX}{run_id}/"


@dataclass(frozen=True, slots=True)
class Keys:
    """The store keys of one job."""

    run_id: str

    @property
    def prefix(self) -> str:
        return job_prefix(self.run_id)

    @property
    def rdzv(self) -> str:
        return self.prefix + "r/"

    @property
    def control(self) -> str:
        return self.prefix + "c/"

    @property
    def nodes(self) -> str:
        return self.rdzv + "nodes/"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    @property
    def restart(self) -> str:
        return self.rdzv + "restart"

    @property
    def acks(self) -> str:
        return self.rdzv + "acks/"

    def ack(self, node_id: str) -> str:
        return self.acks + node_id

    @property
    def ranks(self) -> str:
        return self.rdzv + "ranks/"

    def shard(self, folder: str, shard: int) -> str:
        """A round's shard: `folder` is the round's own (`RoundHead.ranks`)."""
        return f"{self.ranks}{folder}/{shard:05d}"

    @property
    def job(self) -> str:
        return self.rdzv + "job/"

    @property
    def ping(self) -> str:
        return self.job + "ping"

    @property
    def round(self) -> str:
        return self.job + "round"

    @property
    def leader(self) -> str:
        return self.job + "leader"

    @property
    def master(self) -> str:
        return self.job + "master"

    @property
    def spec(self) -> str:
        return self.job + "spec"

    @property
    def state(self) -> str:
        return self.job + "state"

    @property
    def launch(self) -> str:
        # the record whose `run` the store server checks worker credentials against
        return self.prefix + RUN_RECORD

    @property
    def workers(self) -> str:
        """The workers' c10d keys on the built-in store (none on etcd)."""
        return worker_prefix(self.run_id)

    @property
    def drains(self) -> str:
        return self.job + "drain/"

    @property
    def quarantine(self) -> str:
        return self.rdzv + "quarantine"

    @property
    def holds(self) -> str:
        return self.rdzv + "holds/"

    def hold(self, node_id: str) -> str:
        return self.holds + node_id

    def drain(self, node_id: str) -> str:
        return self.drains + node_id

    @property
    def stacks(self) -> str:
        return self.job + "stacks"

    @property
    def stack_answers(self) -> str:
        return self.control + "stacks/"

    def stack_answer(self, node_id: str) -> str:
        return self.stack_answers + node_id

    @property
    def departures(self) -> str:
        return self.rdzv + "left/"

    def departure(self, node_id: str) -> str:
        return self.departures + node_id

    @property
    def statuses(self) -> str:
        return self.control + "status/"

    def status(self, node_id: str) -> str:
        return self.statuses + node_id

    @property
    def logs(self) -> str:
        return self.control + "logs/"

    def log(self, rank: int) -> str:
        return f"{self.logs}{rank:08d}"

    @property
    def events(self) -> str:
        return self.control + "events/"

    def event(self, at: float, node_id: str) -> str:
        return f"{self.events}{int(at * 1e6):020d}-{node_id}"

    @property
    def steps(self) -> str:
        return self.control + "steps/"

    def step_report(self, node_id: str) -> str:
        return self.steps + node_id

    @property
    def stragglers(self) -> str:
        return self.control + "stragglers"


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What a node says about itself when it registers."""

    node_id: str
    host: str
    addr: str  # the address other nodes reach this node's workers at
    nproc: int
    pid: int
    started_at: float  # wall-clock time, for display only
    gpus: tuple[str, ...] = ()  # GPU names, for display
    #: The last round this node ran and that round's restart count (0: none yet). A
    #: node registers again when its membership lapsed (a store stall longer than the
    #: lease TTL) or when the store restarted empty; saying where it was lets the
    #: leader see that it left its round, number the next round above every round a
    #: registered node ran (a new store numbers from 1 again), and keep the budget.
    ran_round: int = 0
    ran_restarts: int = 0
    #: of `ran_restarts`, those forgiven (--forgive-progress)
    ran_forgiven: int = 0
    #: the agent's liveness port on `addr` (0: none): a refused connection there tells
    #: the leader that the agent process is gone (see liveness.py)
    liveness_port: int = 0


@dataclass(frozen=True, slots=True)
class Participant:
    """A node's place in a round: the order of participants is the node rank."""

    node_id: str
    addr: str
    nproc: int


@dataclass(frozen=True, slots=True)
class Round:
    """One round of the job, as the leader decided it.

    A round with no participants stops every group without starting one: it is what the
    leader writes when a node is lost and fewer than `min` remain. A round with `closed`
    set is the job's end ("succeeded", "failed", "stopped"); `detail` says why.
    """

    number: int
    participants: tuple[Participant, ...]
    restart_count: int
    reason: str
    opened_at: float  # wall-clock time
    closed: str = ""
    detail: str = ""
    #: of `restart_count`, the restarts forgiven because the workers had made progress
    #: since the previous failure (--forgive-progress): not counted against the budget
    forgiven: int = 0

    def node_ranks(self) -> dict[str, int]:
        """Each participant's node rank, by node id: built once by a caller that looks
        up many nodes (a lookup per node that scanned the members was O(N^2) a round,
        seconds of the leader's loop at 10,000 nodes)."""
        return {p.node_id: rank for rank, p in enumerate(self.participants)}

    @property
    def world_size(self) -> int:
        return sum(p.nproc for p in self.participants)


@dataclass(frozen=True, slots=True)
class RoundHead:
    """A round as every node sees it (r/job/round): all of `Round` but its members.

    `nodes` and `world_size` are the round's; its members are in `shards` records
    (`RankShard`). `kept_since` is the oldest round number all of whose members are
    still in this one (so far as each round kept all of the one before): a node that
    ran round r lost a peer if `kept_since > r`.
    """

    number: int
    restart_count: int
    reason: str
    opened_at: float
    closed: str = ""
    detail: str = ""
    forgiven: int = 0
    nodes: int = 0
    world_size: int = 0
    shards: int = 0
    #: the folder of its shards under r/ranks/: the round number and the leader that
    #: wrote them, so that a stale leader's shards never mix with the round's
    ranks: str = ""
    kept_since: int = 0
    #: when the job was closed (wall clock; 0 while open)
    closed_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Placed:
    """A member of a round: its node rank and the global rank of its first worker."""

    node_id: str
    addr: str
    nproc: int
    rank: int
    offset: int


@dataclass(frozen=True, slots=True)
class RankShard:
    """The members of round `round` whose node id hashes to this shard (`shard_of`)."""

    round: int
    placed: tuple[Placed, ...]


def shard_of(node_id: str, shards: int) -> int:
    """The shard that holds `node_id`'s place: a stable hash, the same on every host."""
    return zlib.crc32(node_id.encode()) % max(shards, 1)


#: the fields a round's head copies from the `Round`, and back
_HEAD_FIELDS = tuple(f.name for f in fields(Round) if f.name != "participants")


def split_round(
    new: Round, leader: str, before: RoundHead | None, previous: Round | None
) -> tuple[RoundHead, list[RankShard]]:
    """`new` as stored by `leader`: its head and its shards. `before` and `previous` are
    the round it follows (head and members), for `kept_since`."""
    count = len(new.participants)
    shards = math.ceil(count / SHARD_SIZE)
    members = {p.node_id for p in new.participants}
    kept = (
        before is not None
        and previous is not None
        and not previous.closed
        and {p.node_id for p in previous.participants} <= members
    )
    head = RoundHead(
        **{name: getattr(new, name) for name in _HEAD_FIELDS},
        nodes=count,
        world_size=new.world_size,
        shards=shards,
        ranks=f"{new.number:08d}-{leader}",
        kept_since=(before.kept_since or before.number) if kept and before else new.number,
    )
    buckets: list[list[Placed]] = [[] for _ in range(shards)]
    offset = 0
    for rank, p in enumerate(new.participants):
        buckets[shard_of(p.node_id, shards)].append(Placed(p.node_id, p.addr, p.nproc, rank, offset))
        offset += p.nproc
    return head, [RankShard(round=new.number, placed=tuple(b)) for b in buckets]


def join_round(head: RoundHead, shards: Mapping[int, RankShard]) -> Round | None:
    """The `Round` that `split_round` stored, once every shard of it is at hand."""
    complete = len(shards) >= head.shards and all(s.round == head.number for s in shards.values())
    if not complete and not head.closed:
        return None
    placed = sorted((p for s in shards.values() for p in s.placed), key=lambda p: p.rank)
    return Round(
        participants=tuple(Participant(p.node_id, p.addr, p.nproc) for p in placed),
        **{name: getattr(head, name) for name in _HEAD_FIELDS},
    )


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What every node of a job must agree on; the job's first node stores it (r/job/spec).

    A node that registers with another spec is refused, naming each field that differs,
    and `elasticrun join` starts an agent from the stored one, so that nobody repeats the
    job's flags by hand; its command join runs only as its operator gives it again, since
    whoever can write the store can write this record. It holds no secret and no path of
    one node's: every node and every operator of the job reads it.
    """

    #: what the workers run, without this node's interpreter: `script args`,
    #: `-m module args`, or with `no_python` a program and its arguments
    command: tuple[str, ...]
    no_python: bool = False
    #: --nproc-per-node as given (a number, gpu, auto or cpu): nodes may differ in GPUs
    nproc_per_node: str = "1"
    min_nodes: int = 1
    max_nodes: int = 1
    #: --node-unit: every round runs a multiple of this many nodes
    node_unit: int = 1
    max_restarts: int = 0
    #: --forgive-progress: "heartbeat", seconds, or "" (off)
    forgive_progress: str = ""
    elastic_mode: str = "restart"
    progress_timeout: float | None = None
    progress_start_timeout: float | None = None
    role: str = "default"
    #: --straggler: what the leader does with a node slower than the others (off,
    #: report, replace)
    straggler: str = "report"
    #: the --rdzv-conf timings every node must share
    rdzv_conf: Mapping[str, str] = field(default_factory=dict)
    version: int = JOB_SPEC_VERSION

    @property
    def nnodes(self) -> str:
        """--nnodes as the launcher takes it."""
        return f"{self.min_nodes}:{self.max_nodes}"

    def differences(self, mine: JobSpec) -> list[str]:
        """`field: job has X, this node Y` for each field where this node's spec differs;
        min_nodes and max_nodes as one `nnodes`, the flag the user gave them with."""
        found = []
        for f in fields(self):
            name, theirs, ours = f.name, getattr(self, f.name), getattr(mine, f.name)
            if name == "max_nodes":
                continue
            if name == "min_nodes":
                name, theirs, ours = "nnodes", self.nnodes, mine.nnodes
            if theirs != ours:
                found.append(f"{name}: job has {_shown(theirs)!r}, this node {_shown(ours)!r}")
        return found


def _shown(value: object) -> object:
    """A spec value as the stored JSON has it (a command is a list), for messages."""
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True, slots=True)
class RestartRequest:
    """A node asks for a new round with the same members after a worker failure."""

    round: int
    node_id: str
    reason: str
    #: the node's budget is spent: end the job (with `report`) unless a node died
    final: bool = False
    report: str = ""
    #: the workers had made progress since the previous failure (--forgive-progress):
    #: the restart is free
    forgiven: bool = False


@dataclass(frozen=True, slots=True)
class Ping:
    """The leader asks every node of round `round` to show it is alive (an Ack)."""

    round: int


@dataclass(frozen=True, slots=True)
class Master:
    """Where round `round`'s workers meet (their MASTER_ADDR and MASTER_PORT)."""

    round: int
    addr: str
    port: int


@dataclass(frozen=True, slots=True)
class LeaderState:
    """The leader's latest decision reason, published for waiting nodes and `status`."""

    leader: str
    reason: str
    registered: int
    at: float
    waiting: tuple[str, ...] = field(default=())
    #: nodes kept out by a quarantine now: a waiting node reads its own hold only then
    quarantined: int = 0


@dataclass(frozen=True, slots=True)
class JobLaunch:
    """Facts about the job that nodes need not agree on: where and when it started, and
    the first node's own launcher settings (`--gpus`, `--tee`, `--shutdown-timeout`, ...),
    which `elasticrun join` repeats where they can neither run code nor name a file
    (`CARRIED_FLAGS`): nodes may differ in them, so they are no part of the spec, but a
    joining node starts like the first unless told otherwise. `cwd` is only shown."""

    cwd: str
    created_at: float
    created_by: str
    #: those settings as launcher flags (`--shutdown-timeout=5`, `--isolate-gpus`)
    flags: tuple[str, ...] = ()
    #: this run of the job: a nonce of the first node's, new each time the job starts;
    #: the workers' store credential names it (store/credentials.py)
    run: str = ""



@dataclass(frozen=True, slots=True)
class DrainRequest:
    reason: str
    at: float


@dataclass(frozen=True, slots=True)
class Departure:
    """A node leaves the job on purpose (a signal, a drain, a sick GPU), and why.

    `keep_out`: the node asks to be kept out, as sick (a GPU, a failed health check)
    or too slow to keep: the leader quarantines it with `reason`, the way it does a
    flapping node, so `status` shows it held out after its agent is gone and a node of
    the same id is admitted again only after the cooldown.
    """

    reason: str
    keep_out: bool = False


@dataclass(frozen=True, slots=True)
class QuarantineEntry:
    """One node's failure record: its failures, and whether it is kept out.

    A failure is a worker failure attributed to the node (its restart request, once
    every member answered the liveness ping) or the node dropping out of a round.
    """

    node_id: str
    #: failures counted since its last quarantine
    failures: int = 0
    #: how many times it was quarantined; each time the cooldown doubles
    times: int = 0
    #: the end of its latest quarantine (0: never quarantined); kept out while until > now
    until: float = 0.0
    #: its latest failure, or (while quarantined) why it is kept out
    reason: str = ""
    #: when its latest failure was counted
    last_failure_at: float = 0.0

    def active(self, now: float) -> bool:
        """Whether the node is kept out at `now`."""
        return self.until > now


@dataclass(frozen=True, slots=True)
class QuarantineTable:
    """The leader's failure records (r/quarantine), one entry per node id.

    Stored with wall-clock times, so that the next leader and `elasticrun status` read
    them; the leader shifts them to its own clock for `decide()` (`shifted`).
    """

    entries: tuple[QuarantineEntry, ...] = ()
    #: the last round whose failure or losses were counted: nothing counts twice
    counted_round: int = 0

    def get(self, node_id: str) -> QuarantineEntry | None:
        return next((e for e in self.entries if e.node_id == node_id), None)

    def active(self, now: float) -> dict[str, QuarantineEntry]:
        """The nodes kept out at `now`."""
        return {e.node_id: e for e in self.entries if e.active(now)}

    def shifted(self, delta: float) -> QuarantineTable:
        """The same table on another clock (a time of 0, "never", stays 0)."""
        def move(t: float) -> float:
            return t + delta if t else 0.0

        entries = tuple(replace(e, until=move(e.until), last_failure_at=move(e.last_failure_at)) for e in self.entries)
        return replace(self, entries=entries)


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """A node's live state, as `elasticrun status` shows it."""

    node_id: str
    host: str
    addr: str
    state: str
    reason: str
    round: int
    node_rank: int  # -1 while the node has no place in a round
    ranks: str  # "4-7", "" without a place
    world_size: int
    restarts: int
    attempt: int
    pids: tuple[int, ...]
    gpus: tuple[str, ...]
    started_at: float
    updated_at: float


@dataclass(frozen=True, slots=True)
class StepReport:
    """A node's step timing (c/steps/<node_id>), read from its workers' own records.

    A worker's compute time per step is its step's wall time less the time it waited
    for its peers in collectives (elasticrun.worker.steptime); a node is as slow as its
    slowest worker. Bound to the node's lease; published when it changed, at most once
    per `straggler_interval`.
    """

    node_id: str
    round: int
    #: steps made by this node's workers in the round (the fewest of any worker)
    steps: int
    #: seconds: the median compute time of its slowest worker's recent steps, and the
    #: median wall time of that worker's steps
    compute: float
    wall: float
    #: the global rank of that worker
    rank: int
    #: what marks its steps: optimizer, heartbeat or commit
    source: str
    #: the collective every worker of the node waits in now ("": one does not wait),
    #: and since when (wall clock) the last of them does
    waiting: str = ""
    waiting_since: float = 0.0
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class Straggler:
    """A node the leader names a straggler, with its scores."""

    node_id: str
    #: its compute time per step over the median of the other nodes'
    relative: float
    #: its compute time per step over its own best of the round
    individual: float
    #: seconds of compute per step
    compute: float
    #: when it was named (wall clock)
    since: float
    reason: str


@dataclass(frozen=True, slots=True)
class StragglerReport:
    """The stragglers of the current round (c/stragglers), written by the leader when
    its verdict changes."""

    round: int
    #: the median compute time per step of the round's nodes, in seconds
    median: float
    nodes: tuple[Straggler, ...] = ()
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class LogLine:
    seq: int
    stream: str
    text: str


@dataclass(frozen=True, slots=True)
class LogWindow:
    """The latest lines of one rank; `seq` numbers lines across the window's life."""

    rank: int
    node_id: str
    lines: tuple[LogLine, ...]


@dataclass(frozen=True, slots=True)
class Event:
    """One entry of the job's event log."""

    at: float
    node: str
    kind: str
    detail: str


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame of a Python stack, as faulthandler names it."""

    file: str
    #: 0 where faulthandler did not know it ("???")
    line: int
    function: str


@dataclass(frozen=True, slots=True)
class ThreadStack:
    """One thread's Python stack, the innermost frame first (as faulthandler writes it)."""

    #: the thread's id as faulthandler writes it (0x00007f...)
    thread: str
    frames: tuple[Frame, ...]
    #: the process's main thread (the one that runs the script)
    main: bool = False
    #: frames left out, the outermost ones (faulthandler's own limit, or the store's)
    more: int = 0


@dataclass(frozen=True, slots=True)
class RankStacks:
    """One worker's stacks (its threads, the main one first), or why there are none."""

    rank: int
    local_rank: int
    node_id: str
    #: the process that wrote them (a worker's descendant under a wrapper); 0: none
    pid: int
    threads: tuple[ThreadStack, ...] = ()
    #: why there is no stack ("" when there is one)
    missing: str = ""
    #: threads left out (faulthandler's own limit, or the store's)
    more_threads: int = 0


@dataclass(frozen=True, slots=True)
class NodeStacks:
    """A node's workers' stacks, captured for `request` (c/stacks/<node>, on its lease)."""

    node_id: str
    #: the StacksRequest answered
    request: str
    #: why they were captured
    reason: str
    at: float
    round: int
    ranks: tuple[RankStacks, ...]
    #: its last ranks left out of the record, which they did not fit (its run folder
    #: has them)
    left_out: int = 0


@dataclass(frozen=True, slots=True)
class StacksRequest:
    """Every node of the round is asked for its workers' stacks (r/job/stacks); whoever
    asked writes the record again with the summary once the answers are in (`done`)."""

    id: str
    #: who asked: a node id, or user@host for `elasticrun stacks`
    by: str
    reason: str
    at: float
    #: the round whose nodes are asked (a node running another round does not answer:
    #: its workers are not the ones asked about)
    round: int = 0
    #: the round's nodes, asked to answer
    nodes: int = 0
    #: how many answered in time (once done)
    answered: int = 0
    #: the job-wide summary (stack_summary.summarise), once done
    summary: tuple[str, ...] = ()
    done: bool = False


# --- JSON codec ----------------------------------------------------------------------

#: every record kept in the store
Record = (
    NodeInfo | Round | RoundHead | RankShard | RestartRequest | Ping | Master | LeaderState | JobSpec | JobLaunch
    | DrainRequest | Departure | QuarantineTable | QuarantineEntry | NodeStatus | LogWindow | Event
    | NodeStacks | StacksRequest | StepReport | StragglerReport
)
R = TypeVar("R", bound=Record)


def encode(record: Record) -> bytes:
    """A record as versioned JSON bytes."""
    body = asdict(record)
    body["v"] = FORMAT_VERSION
    return json.dumps(body, separators=(",", ":")).encode()


def decode(kind: type[R], raw: bytes) -> R:
    """A record of type `kind` from what `encode` wrote, its nested records included."""
    what = kind.__name__
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise RendezvousError(f"unreadable {what} record in the store: {e}") from None
    if not isinstance(body, dict) or body.pop("v", None) != FORMAT_VERSION:
        raise RendezvousError(
            f"the {what} record in the store has another format version; "
            "is another elasticrun version using the same --rdzv-id?"
        )
    # The spec's own version comes first: another version's fields may mean other things.
    if kind is JobSpec and body.get("version") != JOB_SPEC_VERSION:
        raise SpecMismatchError(
            f"the running job's spec has version {body.get('version')!r}, this node's {JOB_SPEC_VERSION} "
            "(its nodes run another elasticrun version); start this node with that version, or use another --rdzv-id"
        )
    try:
        record: R = _build(kind, body)
    except (KeyError, TypeError) as e:  # a field missing, unknown, or of another shape
        raise RendezvousError(f"unreadable {what} record in the store: {e}") from None
    return record


def _build(kind: type, body: dict[str, Any]) -> Any:
    """`kind(**body)`, each value first made what its field's type says."""
    made = _converters(kind)
    return kind(**{name: made[name](value) if name in made else value for name, value in body.items()})


@functools.cache
def _converters(kind: type) -> dict[str, Callable[[Any], Any]]:
    """How each field of a record type that is not plain JSON (a tuple, a record) is
    made from its JSON value, worked out once per type from its annotations (strings):
    decoding is most of what a large job's nodes and leader spend their CPU on (a
    round's shard holds 64 records), and resolving type hints per value tripled it."""
    hints = typing.get_type_hints(kind)
    return {name: made for name, hint in hints.items() if (made := _converter(hint)) is not None}


def _converter(hint: Any) -> Callable[[Any], Any] | None:
    """A list as a tuple (of what its items' type says), an object as a record; None
    for a value that JSON gives as the field holds it."""
    if typing.get_origin(hint) is tuple:
        item = _converter(typing.get_args(hint)[0])
        if item is None:
            return lambda value: tuple(value) if isinstance(value, list) else value
        return lambda value: tuple(item(v) for v in value) if isinstance(value, list) else value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return lambda value: _build(hint, value) if isinstance(value, dict) else value
    return None


# --- key -> record -------------------------------------------------------------------


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
    #: `round`, put together once per change of the head or a shard
    _joined: tuple[Round | None] | None = field(default=None, repr=False, compare=False)

    @property
    def round(self) -> Round | None:
        """The current round with its members, once its head and every shard are read
        (a closed round: with the members still at hand, if any)."""
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
        elif key == keys.quarantine:
            self.quarantine = _read(QuarantineTable, value) or QuarantineTable()


def _read(kind: type[R], value: bytes | None) -> R | None:
    return None if value is None else decode(kind, value)


def _fold(records: dict[Any, R], name: Any, kind: type[R], value: bytes | None) -> None:
    if value is None:
        records.pop(name, None)
    else:
        records[name] = decode(kind, value)
