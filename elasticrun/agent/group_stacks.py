"""When the agent captures its workers' stacks, and what it does with them.

One `GroupStacks` per worker group (an attempt's workers). Three moments:

- `answer`: while the workers run, every request for the job's stacks (an operator's
  `elasticrun stacks`, another node's hang) is answered with a fresh capture.
- `of_hang`: the progress watchdog found a hang; before the workers stop, capture them,
  ask every node of the round (`JobControl.job_stacks`), and log the summary of
  where every rank was (the failure report carries it too).
- `of_stall`: the node made no step for long (elasticrun.agent.step_reports): the same
  job-wide capture and summary, logged once; the workers run on.
- `at_round_end`: a round ended because a peer was lost while the workers ran: capture
  this node's workers before they stop (this node only, briefly: the next round waits).

Every capture is kept whole in the attempt's folder (`stacks_<k>.txt`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from elasticrun.agent.failures import describe_exit
from elasticrun.agent.processes import WorkerGroup
from elasticrun.agent.stacks import StackCapture, Target, keep
from elasticrun.agent.watchdog import Hang
from elasticrun.errors import UsageError
from elasticrun.loglines import HEADLINE
from elasticrun.rendezvous.handler import Assignment, JobControl
from elasticrun.rendezvous.records import NodeStacks, RankStacks
from elasticrun.rendezvous.stack_summary import one_line, render_ranks, summarise
from elasticrun.rendezvous.stacks import ANSWER_WAIT

logger = logging.getLogger("elasticrun.agent")

#: how long a capture waits for the workers' stacks (a process stopped or stuck in the
#: kernel never writes them): when asked, and when a hang was found
CAPTURE_LIMIT = 2.0
#: the same when a round ends because a peer was lost: the next round waits for it
LOST_PEER_CAPTURE_LIMIT = 0.5
#: a round that ends this soon after this node answered a request for the job's stacks
#: ends, most likely, because of what the request was about (a hang on another node,
#: which then stopped its workers): that answer is where the workers were, and a capture
#: now would catch them in their teardown (a broken collective's exception, the
#: interpreter's exit)
RECENT_ANSWER = ANSWER_WAIT + CAPTURE_LIMIT


class GroupStacks:
    """The stacks of one worker group: its workers' stack files and the captures kept."""

    def __init__(
        self,
        capture: StackCapture,
        control: JobControl,
        workers: WorkerGroup,
        files: Mapping[int, Path],
        folder: Path,
    ) -> None:
        self._capture = capture
        self._control = control
        self._workers = workers
        self._files = dict(files)
        self._folder = folder
        self._kept = 0
        #: the latest answer to a request for the job's stacks, when (monotonic), and its file
        self._answered: tuple[float, NodeStacks, Path | None] | None = None

    async def capture(self, assignment: Assignment, reason: str, limit: float) -> NodeStacks:
        """The workers' stacks now, or why a worker has none."""
        workers = self._workers
        targets = [
            Target(
                local_rank=local_rank,
                rank=assignment.rank_offset + local_rank,
                session=workers.sessions[local_rank],
                file=self._files[local_rank],
                exited=describe_exit(workers.exits[local_rank].returncode) if local_rank in workers.exits else "",
            )
            for local_rank in sorted(workers.procs)
        ]
        ranks = await asyncio.to_thread(self._capture.capture, targets, limit)
        return NodeStacks(
            node_id=self._capture.node_id, request="", reason=reason, at=time.time(), round=assignment.round,
            ranks=ranks,
        )

    def keep(self, reason: str, ranks: Iterable[RankStacks], head: Iterable[str] = ()) -> Path | None:
        """Keep a capture in the attempt's folder; its file (None: it could not be written)."""
        self._kept += 1
        path = self._folder / f"stacks_{self._kept}.txt"
        try:
            keep(path, reason, [*head, *render_ranks(ranks)])
        except (OSError, UsageError) as e:
            logger.warning("cannot keep the workers' stacks in %s: %s", path, e)
            return None
        return path

    async def answer(self, assignment: Assignment) -> NoReturn:
        """Answer every request for the job's stacks while the workers run."""
        while True:
            request = await self._control.stacks_asked()
            mine = await self.capture(assignment, f"asked by {request.by}: {request.reason}", CAPTURE_LIMIT)
            self._answered = (time.monotonic(), mine, self.keep(mine.reason, mine.ranks))
            await self._control.answer_stacks(replace(mine, request=request.id))

    async def of_hang(self, assignment: Assignment, hang: Hang) -> tuple[list[str], Path | None]:
        """Where every rank of the job was when this node's watchdog found `hang`.

        The summary (logged), and the file that keeps it with this node's stacks (and,
        when this node asked, every node's)."""
        reason = hang.reason(assignment.rank_offset + hang.local_rank)
        return await self._job_wide(assignment, reason, "where the ranks were when the hang was found")

    async def of_stall(self, assignment: Assignment, reason: str) -> None:
        """Where every rank of the job is now that this node has stalled (logged, kept).

        Every node of a stalled job stalls together: the first request stands and the
        others join it, so the job's stacks are captured once."""
        await self._job_wide(assignment, f"stalled: {reason}", f"{reason}: where the ranks are")

    async def _job_wide(self, assignment: Assignment, reason: str, headline: str) -> tuple[list[str], Path | None]:
        started = time.monotonic()
        mine = await self.capture(assignment, reason, CAPTURE_LIMIT)
        job = await self._control.job_stacks(mine, f"{self._capture.node_id}: {reason}")
        took = f"{time.monotonic() - started:.2f}s"
        if job is not None:
            lines = list(job.request.summary)
            scope = f"job-wide: {job.request.answered} of {job.request.nodes} nodes answered, {took}"
        else:
            lines, scope = summarise(mine.ranks), f"this node's workers only, {took}"
        others = [r for n in (job.answers if job else ()) if n.node_id != mine.node_id for r in n.ranks]
        head = [f"where the ranks were ({scope}):", *(f"  {line}" for line in lines), ""]
        path = self.keep(reason, [*mine.ranks, *others], head)
        logger.warning(
            "%s (%s): %s%s", headline, scope, one_line(lines), f"; all stacks in {path}" if path else "",
            extra=HEADLINE,
        )
        return lines, path

    async def at_round_end(self, assignment: Assignment, reason: str) -> None:
        """Where the workers were when a peer was lost (logged, kept).

        From the answer this node gave moments ago, if it did (`RECENT_ANSWER`): the
        stacks from before the teardown began, not of it."""
        started = time.monotonic()
        answered = self._answered
        if answered is not None and started - answered[0] <= RECENT_ANSWER:
            _, mine, path = answered
            when = f"as answered {started - answered[0]:.1f}s before, for the job's stacks"
        else:
            mine = await self.capture(assignment, reason, LOST_PEER_CAPTURE_LIMIT)
            when = f"captured in {time.monotonic() - started:.3f}s"
            path = self.keep(reason, mine.ranks)
        logger.info(
            "where this node's workers were when round %d ended (%s; %s): %s%s",
            assignment.round,
            reason,
            when,
            one_line(summarise(mine.ranks)),
            f"; all stacks in {path}" if path else "",
        )  # not by default: a planned change (a drain, a join) is no news, and the file stays
