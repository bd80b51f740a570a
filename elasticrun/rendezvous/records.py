"""The records the rendezvous keeps in the store, besides the round (`rendezvous/rounds.py`).

Each is a frozen dataclass of plain values, stored as versioned JSON (`rendezvous/codec.py`)
under its key (`rendezvous/keys.py`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

from elasticrun.rendezvous.rounds import RankShard, Round, RoundHead

#: the stream of the line an agent adds to each of its ranks' output windows as a round
#: starts: `elasticrun logs` shows where one round's output ends and the next begins
ROUND_STREAM = "round"

#: the module a `--run-path` worker runs (elasticrun/worker/run_path.py)
RUN_PATH_MODULE = "elasticrun.worker.run_path"

#: the job spec's own version, bumped whenever what a spec holds changes: a node whose
#: spec has another version is refused as a mismatch, never compared field by field
JOB_SPEC_VERSION = 4


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
    #: sha256 of the script as the node that stored the spec read it ("" for a module,
    #: a program, or a script it could not read): compared, never refused, since
    #: nodes may legitimately run builds of one script that differ (a debug print)
    script_digest: str = ""
    version: int = JOB_SPEC_VERSION

    @property
    def nnodes(self) -> str:
        """--nnodes as the launcher takes it."""
        return f"{self.min_nodes}:{self.max_nodes}"

    def differences(self, mine: JobSpec) -> list[str]:
        """`field: job has X, this node Y` for each field where this node's spec differs.

        Min_nodes and max_nodes as one `nnodes`, the flag the user gave them with."""
        found = []
        for f in fields(self):
            name, theirs, ours = f.name, getattr(self, f.name), getattr(mine, f.name)
            if name in ("max_nodes", "script_digest"):
                continue
            if name == "min_nodes":
                name, theirs, ours = "nnodes", self.nnodes, mine.nnodes
            if name == "command" and by_name(self.command) == by_name(mine.command):
                continue
            if theirs != ours:
                found.append(f"{name}: job has {_shown(theirs)!r}, this node {_shown(ours)!r}")
        return found


    def content_differs(self, mine: JobSpec) -> str:
        """A line saying that this node's script is not the job's, or "" (same, or unknown)."""
        if not (self.script_digest and mine.script_digest) or self.script_digest == mine.script_digest:
            return ""
        at = script_at(mine.command)
        name = os.path.basename(mine.command[at]) if at is not None else "script"
        return (
            f"this node's {name} differs in content from the one the job's first node read "
            f"(sha256 {mine.script_digest[:12]} here, {self.script_digest[:12]} there): "
            "the nodes may train different code"
        )


def script_at(command: tuple[str, ...]) -> int | None:
    """Where `command` names its script or program (None: a module, `-m pkg.mod`)."""
    at = 2 if command[:2] == ("-m", RUN_PATH_MODULE) else 0 if command[:1] != ("-m",) else None
    return at if at is not None and len(command) > at else None


def by_name(command: tuple[str, ...]) -> tuple[str, ...]:
    """`command` as the job's nodes must agree on it: its script (or program) by file name.

    Code sits at different paths on different nodes (`train.py` on one, its absolute
    path or `../x/train.py` on another): what must agree is which script runs with
    which arguments, not how each node spells its path. A module (`-m pkg.mod`) is
    its name already."""
    at = script_at(command)
    if at is None:
        return command
    return (*command[:at], os.path.basename(command[at]), *command[at + 1:])


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
    """Facts about the job that nodes need not agree on.

    Where and when it started, and the first node's own launcher settings (`--gpus`,
    `--tee`, `--shutdown-timeout`, ...), which `elasticrun join` repeats where they can
    neither run code nor name a file (`CARRIED_FLAGS`): nodes may differ in them, so
    they are no part of the spec, but a joining node starts like the first unless told
    otherwise. `cwd` is only shown."""

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
    them; the leader shifts them to its own clock for `decide_round()` (`shifted`).
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
    #: its standby workers, for the next restart: ready, starting or off
    standby: str = "off"
    #: restart mode: the last commit of its workers' state it holds (the least of its
    #: ranks' commit counts) and, of that, what its buddy node holds a copy of (-1: none)
    state_held: int = -1
    state_replicated: int = -1


@dataclass(frozen=True, slots=True)
class ReplicaPost:
    """Where a member of a round takes its predecessor's commits, and whose it holds (c/replicas/<node rank>).

    Each member of a round posts one under its node rank, bound to its lease, before
    its workers start: the node before it in the ring sends it its commits, and a node
    that takes a lost member's place finds the lost ranks' commits at the node after
    it (elasticrun.agent.state_replicas).
    """

    round: int
    node_id: str
    addr: str
    #: the agent's replica port on `addr`
    port: int
    #: its own workers' global ranks: the first, and how many
    first_rank: int
    nproc: int
    #: the global ranks whose commits it holds copies of (its predecessor's)
    held: tuple[int, ...] = ()
    #: the newest commit count its own workers' files hold (-1: none), and the world
    #: size it was made at: a node that finds no copy of its ranks' state knows from
    #: this whether the job had any at this size
    committed: int = -1
    committed_world: int = 0


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
    #: when (wall clock) a worker of the node last made a step
    last_step: float = 0.0
    #: since when the node makes no step, once that is many of its usual steps and at
    #: least a minute (elasticrun.agent.step_reports.stalled); 0: it steps
    stalled_since: float = 0.0
    #: whether its standbys (warm restarts) import beside its workers, or did within the
    #: steps its times are medians of: then its times are not its own, for under a CPU
    #: quota (a container's limit) their imports take from the workers' share whatever
    #: their priority (elasticrun.agent.step_reports)
    warming: bool = False


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
    """The stragglers of the current round (c/stragglers), written by the leader when its verdict changes."""

    round: int
    #: the median compute time per step of the round's nodes, in seconds
    median: float
    nodes: tuple[Straggler, ...] = ()
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class LogLine:
    """One line of a rank's output window; `stream` is stdout, stderr or `ROUND_STREAM`."""

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
    """Every node of the round is asked for its workers' stacks (r/job/stacks).

    Whoever asked writes the record again with the summary once the answers are in
    (`done`)."""

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


@dataclass(frozen=True, slots=True)
class Successor:
    """A node that takes the store over when the ones before it are gone."""

    node_id: str
    #: host:port it serves the store at once it takes it over
    endpoint: str
    #: its agent's liveness port on `addr`: a refusal there tells the next successor it is gone
    addr: str
    liveness_port: int


@dataclass(frozen=True, slots=True)
class Successors:
    """Who takes the store over from the agent that serves it (r/job/successors).

    Named by the serving agent for round `round`, its first members by node rank;
    `quorum` is a majority of that round's nodes: the first round at a successor's
    store opens only with that many of them (docs/concepts.md, "Never two jobs")."""

    serving: str
    round: int
    quorum: int
    nodes: tuple[Successor, ...]
    #: the folder of that round's members (`RoundHead.ranks`): the leader keeps it while
    #: this record names it, so that the majority is counted among them
    ranks: str = ""


#: every record kept in the store
Record = (
    NodeInfo | Round | RoundHead | RankShard | RestartRequest | Ping | Master | LeaderState | JobSpec | JobLaunch
    | DrainRequest | Departure | QuarantineTable | QuarantineEntry | NodeStatus | LogWindow | Event
    | NodeStacks | StacksRequest | StepReport | StragglerReport | Successors | ReplicaPost
)
