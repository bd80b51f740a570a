"""The workers' step timing, read from the files they write, as one report per node.

Each worker records its own compute time per step (elasticrun.worker.steptime, loaded by
the worker boot) into a small file of its own in the run folder (`env()`:
ELASTICRUN_STEPS_FILE), at most twice a second. The agent looks at the files every
`READ_INTERVAL` (a stat each; a read of the ones that changed) and makes the node's
`StepReport`: a node is as slow as its slowest worker. The rendezvous publishes it for
the leader's straggler check (c/steps/<node>); the hang watchdog asks where a worker
waits (`waiting_in`).

No worker writes a file until its script makes a step, and a worker that never imports
elasticrun (another interpreter, `python -I`) never does: the node then reports nothing.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from elasticrun.rendezvous.handler import Assignment
from elasticrun.rendezvous.records import StepReport

#: the worker's variable naming its file (elasticrun.worker.steptime.STEPS_FILE_ENV)
STEPS_FILE_ENV = "ELASTICRUN_STEPS_FILE"
#: seconds between looks at the files
READ_INTERVAL = 1.0
#: a worker's file is a few hundred bytes: more is not a summary of ours
_MAX_BYTES = 4096
#: a node's report says where its workers wait only once they have waited this many of
#: their usual steps, and at least LONG_WAIT seconds: a wait in every step is no news
LONG_WAIT_STEPS = 10
LONG_WAIT = 5.0
#: a node whose workers made no step for this many of their usual steps, and at least
#: STALL_MIN seconds, is stalled: shown, its stacks summarised, nothing killed (that is
#: --progress-timeout's). A minute: a checkpoint save or an evaluation pass is no stall.
STALL_STEPS = 20
STALL_MIN = 60.0
#: a worker's times are medians of its last 16 steps (elasticrun.worker.steptime.WINDOW):
#: once more than half of them came after the node's standbys imported, they are its own
STEPS_AFTER_WARMING = 9


@dataclass(frozen=True, slots=True)
class WorkerSteps:
    """What one worker's file said."""

    pid: int
    source: str
    steps: int
    compute: float
    wall: float
    waiting: str
    waiting_since: float


class StepTimes:
    """The step timing files of one node's workers."""

    def __init__(self, directory: Path, local_ranks: Iterable[int], *, keep: bool = False) -> None:
        """Watch `directory`; an earlier attempt's files are removed unless `keep`.

        `keep` is for workers that outlive attempts (in-process mode)."""
        self.directory = Path(directory)
        self._files = {rank: self.directory / f"rank_{rank}.json" for rank in local_ranks}
        if not keep:
            for path in self._files.values():
                path.unlink(missing_ok=True)
        self._seen: dict[int, tuple[int, WorkerSteps]] = {}
        #: each worker's step count and when (wall clock) this agent saw it change
        self._stepped: dict[int, tuple[int, float]] = {}
        #: the node's step count from which its times are its own again (`report`)
        self._warm_until = 0

    def env(self, local_rank: int) -> dict[str, str]:
        """What to add to worker `local_rank`'s environment."""
        return {STEPS_FILE_ENV: str(self._files[local_rank])}

    def read(self) -> dict[int, WorkerSteps]:
        """Each worker's latest summary (a file read only when it changed)."""
        for rank, path in self._files.items():
            try:
                mtime = os.stat(path).st_mtime_ns
            except OSError:
                self._seen.pop(rank, None)
                continue
            seen = self._seen.get(rank)
            if seen is not None and seen[0] == mtime:
                continue
            steps = _parse(path)
            if steps is not None:
                self._seen[rank] = (mtime, steps)
                if self._stepped.get(rank, (-1, 0.0))[0] != steps.steps:
                    self._stepped[rank] = (steps.steps, time.time())
        return {rank: steps for rank, (_, steps) in self._seen.items()}

    def report(self, node_id: str, assignment: Assignment, *, importing: bool = False) -> StepReport | None:
        """The node's report, once every worker has made a step; None before.

        `importing`: the node's standbys import now (`Standbys.importing`). Its report
        says `warming` until the workers' medians no longer hold a step made meanwhile."""
        workers = self.read()
        if len(workers) < len(self._files) or any(w.steps == 0 for w in workers.values()):
            return None
        steps = min(w.steps for w in workers.values())
        if importing:
            self._warm_until = steps + STEPS_AFTER_WARMING
        rank, slowest = max(workers.items(), key=lambda kv: (kv[1].compute, -kv[0]))
        names = {w.waiting for w in workers.values()}
        waiting = names.pop() if len(names) == 1 else ""
        since = max(w.waiting_since for w in workers.values()) if waiting else 0.0
        now = time.time()
        if now - since < max(LONG_WAIT_STEPS * slowest.wall, LONG_WAIT):
            waiting, since = "", 0.0
        last_step = max(self._stepped[r][1] for r in workers)
        stalled = now - last_step >= max(STALL_STEPS * slowest.wall, STALL_MIN)
        return StepReport(
            node_id=node_id,
            round=assignment.round,
            steps=steps,
            compute=slowest.compute,
            wall=slowest.wall,
            rank=assignment.rank_offset + rank,
            source=slowest.source,
            waiting=waiting,
            waiting_since=since,
            at=now,
            last_step=last_step,
            stalled_since=last_step if stalled else 0.0,
            warming=steps < self._warm_until,
        )

    def waiting_in(self, local_rank: int, now: float | None = None) -> str:
        """Where worker `local_rank` waits, as the hang's report says it.

        `waiting in all_reduce for 58s`; "" when it does not (or its file does not say)."""
        steps = self.read().get(local_rank)
        if steps is None or not steps.waiting:
            return ""
        waited = max((time.time() if now is None else now) - steps.waiting_since, 0.0)
        return f"waiting in {steps.waiting} for {waited:.0f}s"


def stall_reason(report: StepReport) -> str:
    """`no step for 65s (usually 0.21s a step)`: why a stalled node says so."""
    silent = report.at - report.stalled_since
    return f"no step for {silent:.0f}s (usually {report.wall:.2f}s a step)"


def _parse(path: Path) -> WorkerSteps | None:
    """A worker's summary, or None for a file that is not one (never raises)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            body = json.loads(f.read(_MAX_BYTES))
        return WorkerSteps(
            pid=int(body["pid"]),
            source=str(body["source"]),
            steps=int(body["steps"]),
            compute=float(body["compute"]),
            wall=float(body["wall"]),
            waiting=str(body["waiting"]),
            waiting_since=float(body["waiting_since"]),
        )
    except (OSError, ValueError, TypeError, KeyError):
        return None
