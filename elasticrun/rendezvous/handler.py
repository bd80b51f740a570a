"""What the agent sees of a rendezvous: an `Assignment` per round, and the handler.

The agent knows the rendezvous only through `RendezvousHandler`; the elastic rendezvous
(over any `Store`) and the static one implement it, and backends know nothing of the
agent.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

from elasticrun.rendezvous.records import NodeStacks, ReplicaPost, StacksRequest, StepReport
from elasticrun.rendezvous.stacks import JobStacks


@dataclass(frozen=True, slots=True)
class Assignment:
    """This node's place in one round of the job.

    Global ranks of this node's workers are `rank_offset + local_rank`.
    """

    round: int
    node_rank: int
    node_count: int
    rank_offset: int
    world_size: int
    master_addr: str
    master_port: int
    #: worker-failure restarts the job has used so far (TORCHELASTIC_RESTART_COUNT)
    restart_count: int
    #: of those, the ones forgiven because the workers had made progress
    #: (--forgive-progress): they do not count against --max-restarts
    forgiven: int = 0
    #: the job's run (its launch record's nonce): the workers' store credential names it
    run: str = ""
    #: seconds within which this node hears of any change of the round (the lease
    #: TTL; 0 where rounds never change): in-process workers whose collective broke
    #: wait this long for the round's end before their break counts as a failure,
    #: since a peer's re-formation breaks it a moment before this node hears of it
    settle: float = 0.0

    @property
    def budget_spent(self) -> int:
        """Restarts that count against --max-restarts."""
        return self.restart_count - self.forgiven


@dataclass(frozen=True, slots=True)
class AgentStatus:
    """What the agent reports of itself, for `elasticrun status`."""

    state: str
    reason: str
    assignment: Assignment | None
    pids: tuple[int, ...]
    attempt: int
    #: its standby workers (elasticrun.agent.standby): ready, starting or off
    standby: str = "off"
    #: restart mode: the last commit held, and replicated to its buddy (NodeStatus's)
    state_held: int = -1
    state_replicated: int = -1


class RendezvousHandler(abc.ABC):
    """One node's membership in the job's rendezvous.

    The agent's loop is: `next_round()`, start workers, then wait for the first of
    (workers ended, `round_ended()`, a signal), and report what happened with
    `request_restart()`, `fail()`, `finish()` or `leave()`. What the node reports for
    job control, and the job's stacks, go through its `control` channel.
    """

    #: the job's id (`--rdzv-id`)
    run_id: str
    #: this node's reports and the job's stacks (the base: a backend without a store)
    control: JobControl

    @abc.abstractmethod
    async def next_round(self) -> Assignment:
        """Wait until this node is placed in a round it has not run yet.

        Raises RendezvousClosedError when the job has ended, RendezvousTimeoutError
        when no round took this node within the join timeout (the message says what
        was missing).
        """

    @abc.abstractmethod
    async def round_ended(self) -> str:
        """Return (with a reason) as soon as the current round is superseded.

        A node joined or left, another node's workers failed and it asked for a
        restart, or this node lost its membership (its lease expired): in every case
        this node's workers must stop now. Raises RendezvousClosedError when the job
        was stopped or failed elsewhere: no round follows.
        """

    def peers_lost(self) -> bool:
        """Whether the round that ended ours dropped or restarted one of our peers.

        Asked after `round_ended()` returns. False means nodes only joined: every peer
        is still alive and in step, so workers kept across rounds (in-process mode) may
        finish their step before leaving; True means a collective with a lost peer may
        never finish, and must be interrupted. Backends without membership changes
        never end a round this way.
        """
        return True

    def closed_by_success(self, round_number: int) -> bool:
        """Whether another node's workers succeeded and closed the job in round `round_number`.

        Its other nodes' workers run on to their end, but no round follows: a failure
        here in that round can restart nothing, and ends the job as failed (`fail()`). A
        failure of an earlier round was answered already (a round without this node, a
        quarantine). Backends without a job shared by several nodes are never closed by
        another node."""
        return False

    @abc.abstractmethod
    async def request_restart(self, reason: str, *, forgiven: bool = False) -> None:
        """Ask for a new round with the same members after a worker failure here.

        The new round's `restart_count` is one higher; membership changes never
        raise it. A `forgiven` failure (the workers had made progress since the
        previous one) raises `forgiven` too, so it spends none of the budget.
        """

    @abc.abstractmethod
    async def fail(self, report: str) -> None:
        """End the job for every node: this node's failure is beyond the budget.

        Or it came after the job closed as succeeded (`closed_by_success()`): the job
        failed all the same."""

    @abc.abstractmethod
    async def finish(self) -> None:
        """This node's workers all succeeded: close the job and leave."""

    @abc.abstractmethod
    async def leave(self, reason: str, *, keep_out: bool = False) -> None:
        """Leave the job on purpose (SIGTERM, drain): the others continue without us.

        `keep_out`: this node is unfit (a sick GPU, a failed health check): the job
        quarantines it, with `reason` (`Departure.keep_out`).
        """

    async def aclose(self) -> None:
        """Give up this node's membership now (idempotent): the agent is done with the job, however it ended.

        Backends without a membership have nothing to do."""

    @property
    def waiting_status(self) -> str | None:
        """What `next_round()` waits for right now, for the agent's log.

        None when it would not wait (the job has ended for this node: it raises at
        once)."""
        return "waiting for a round"

    def quarantined_nodes(self) -> int:
        """How many of the job's nodes a quarantine keeps out now, for metrics.

        Read from another thread (the metrics server's): it must only read what it
        holds."""
        return 0

    async def drained(self) -> str:
        """Return (with the reason) when an operator asks this node to leave.

        Backends without job control never return.
        """
        await asyncio.Event().wait()
        return ""


class JobControl:
    """One node's channel to job control: its reports, and the job's stacks.

    What `elasticrun status`, `logs`, `stacks` and the leader's straggler check read of
    this node, apart from its membership (`RendezvousHandler`). This base class is a
    backend without a store: it publishes nothing, and a node's stacks stay its own;
    the elastic rendezvous's is `rendezvous/job_control.py`'s.
    """

    # Stacks, job-wide (rendezvous/stacks.py).

    async def stacks_asked(self) -> StacksRequest:
        """Return when someone asks every node for its workers' stacks.

        A request this node has not answered yet. Backends without a store never return."""
        never: asyncio.Future[StacksRequest] = asyncio.get_running_loop().create_future()
        return await never

    async def answer_stacks(self, stacks: NodeStacks) -> None:
        """Publish this node's stacks, the answer to request `stacks.request`."""

    async def job_stacks(self, mine: NodeStacks, reason: str) -> JobStacks | None:
        """Ask every node of this node's round for its workers' stacks, answer with `mine`, return the job's.

        A request made moments ago is joined instead. The job's stacks come concluded
        (with the summary) within a bounded wait; None when there is no job to ask or no
        summary came in time."""
        return None

    # State replicas (elasticrun.agent.state_replicas): found through the store.

    #: the address this node's agent is reached at by the others ("": a backend
    #: without a store, where no node can find another's replicas)
    addr: str = ""

    async def post_replicas(self, node_rank: int, post: ReplicaPost) -> None:
        """Publish this node's replica post under its node rank, for as long as it is a member."""

    async def replica_post(self, node_rank: int, round_number: int, timeout: float) -> ReplicaPost | None:
        """Node rank `node_rank`'s post in round `round_number`, once it is there; None if not within `timeout`."""
        return None

    # Reports for job control. Best effort and never blocking: published in the
    # background.

    def report_status(self, status: AgentStatus) -> None:
        """This node's state changed."""

    def report_output(self, rank: int, stream: str, lines: list[str]) -> None:
        """Worker `rank` printed these whole lines."""

    def report_event(self, kind: str, detail: str) -> None:
        """Something worth the job's event log happened on this node."""

    def report_steps(self, report: StepReport) -> None:
        """This node's step timing changed (for the leader's straggler check)."""

    def straggler_scores(self) -> Mapping[str, tuple[float, float, bool]]:
        """While this node leads.

        Each scored node's straggler scores (relative, individual) and whether it is
        named one, for metrics. Read from the metrics server's thread: it must only read
        what it holds."""
        return {}
