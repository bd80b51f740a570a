"""The store keys of one job, under one prefix per job, and who watches which.

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
    c/replicas/<rank>   ReplicaPost: node rank <rank>'s replica port and the commits it holds
                        copies of, bound to its lease (restart mode, --state-memory)
    c/stragglers        StragglerReport: the nodes the leader names as stragglers
    c/stacks/<node_id>  NodeStacks: the node's answer to a StacksRequest, bound to its lease

Only the leader watches `r/`; every node watches `r/job/`. A membership change
therefore costs O(1) events per node, which is what lets one round span thousands of
nodes, and the busy `c/` records (output windows) never wake the leader.

The failure records are kept out of `r/job/` for the same reason: the table has an entry
per node that ever failed (a thousand after a mass drop-out), so a quarantined node
reads only its own hold (`r/holds/<node_id>`), and only when the leader's state says
some node is kept out.
"""

from __future__ import annotations

from dataclasses import dataclass

# the store prefix under which every job has its own (`elasticrun list` reads it): the
# store knows it too, as it keeps each job's worker keys under it (credentials.py)
from elasticrun.store.credentials import JOBS_PREFIX, ROUND_RECORD, RUN_RECORD, worker_prefix


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
        # the record whose `closed` the store server checks worker credentials against
        return self.prefix + ROUND_RECORD

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
    def successors(self) -> str:
        """Who takes the store over (`Successors`): under job/, so every node's watch brings it."""
        return self.job + "successors"

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
    def replicas(self) -> str:
        return self.control + "replicas/"

    def replica(self, node_rank: int) -> str:
        return f"{self.replicas}{node_rank:08d}"

    @property
    def stragglers(self) -> str:
        return self.control + "stragglers"
