"""The hang watchdog (`--progress-timeout`): a worker alive but making no progress.

Process supervision sees a worker that exits, never one that is stuck (a deadlocked
collective, a data loader that waits forever). With `--progress-timeout` each worker
gets a file of its own (`env()`: ELASTICRUN_PROGRESS_FILE) that its script touches
through `elasticrun.worker.heartbeat()`, and that its step timing touches when the
script made a step (an optimizer's step: elasticrun.worker.steptime), so that a plain
script is watched too. `hang()` returns as soon as one worker has made no progress for
the timeout, counted from the watchdog's creation (the workers' start) and then from
its latest heartbeat. One watchdog per attempt: create it when the workers start.

It reads nothing while it waits: it sleeps until the earliest moment a worker could
be overdue, then looks at the files' modification times once (a stat per worker). A
heartbeat is dated by the file's mtime, and never earlier than the previous look that
saw the file unchanged, so a clock skew of the file system (NFS) can only delay the
verdict, never make a live worker look hung.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from elasticrun.agent.failures import WorkerFailure, traceback_from_stderr

#: the worker's variable that names its progress file (read by elasticrun.worker.heartbeat)
PROGRESS_FILE_ENV = "ELASTICRUN_PROGRESS_FILE"


@dataclass(frozen=True)
class Hang:
    """A worker that made no progress for `silent_for` seconds (at least the timeout)."""

    local_rank: int
    silent_for: float
    #: where it waits, when its step timing says (`waiting in all_reduce for 58s`)
    waiting: str = ""
    #: it made no progress at all since it started: neither heartbeat() nor an
    #: optimizer step (a script the watchdog cannot see into is no hung one)
    never: bool = False

    def reason(self, global_rank: int) -> str:
        """The one-line cause: `worker rank 3 hung: no progress for 61s (waiting in all_reduce for 58s)`."""
        where = f" ({self.waiting})" if self.waiting else ""
        if self.never:
            return (
                f"worker rank {global_rank} hung: no progress for {self.silent_for:.0f}s since it started{where}: it "
                "never called elasticrun.worker.heartbeat() and made no optimizer step"
            )
        return f"worker rank {global_rank} hung: no progress for {self.silent_for:.0f}s{where}"


@dataclass
class _Watched:
    path: Path
    #: the latest progress, on the watchdog's clock
    progress_at: float
    #: the file's mtime (ns) at the latest look; None: no file yet
    mtime_ns: int | None = None


class ProgressWatchdog:
    """Watches the progress files of one attempt's workers.

    With no timeout it finds no hang and only keeps the files, for `progressed()`
    (`--forgive-progress heartbeat` without `--progress-timeout`).
    """

    def __init__(
        self,
        timeout: float | None,
        directory: Path,
        local_ranks: Iterable[int],
        clock: Callable[[], float] = time.monotonic,
        start_timeout: float | None = None,
    ) -> None:
        if timeout is not None and not 0 < timeout < float("inf"):
            raise ValueError(f"the progress timeout must be a positive number of seconds, got {timeout}")
        self.timeout = timeout
        #: how long a worker may take to its first progress (imports, loading a model or
        #: a checkpoint, compiling); the timeout when not given
        self.start_timeout = start_timeout if start_timeout is not None else timeout
        self.directory = Path(directory)
        self._clock = clock
        self.directory.mkdir(parents=True, exist_ok=True)
        start = clock()
        self._workers: dict[int, _Watched] = {}
        for rank in local_ranks:
            path = self.directory / f"progress_{rank}"
            path.unlink(missing_ok=True)  # a file of an earlier attempt is no progress of this one
            self._workers[rank] = _Watched(path=path, progress_at=start)
        #: when the files were last looked at (a change seen now happened after it)
        self._looked_at = start

    def env(self, local_rank: int) -> dict[str, str]:
        """What to add to worker `local_rank`'s environment."""
        try:
            return {PROGRESS_FILE_ENV: str(self._workers[local_rank].path)}
        except KeyError:
            raise ValueError(f"local rank {local_rank} is not watched (watching {sorted(self._workers)})") from None

    def progressed(self) -> bool:
        """Whether every worker has called `heartbeat()` since the watchdog was made.

        That is --forgive-progress heartbeat; an earlier attempt's files were removed
        then."""
        return all(w.path.exists() for w in self._workers.values())

    def check(self) -> Hang | None:
        """Look at the files now: the most overdue worker, if one is past the timeout."""
        now, wall = self._clock(), time.time()
        for watched in self._workers.values():
            try:
                mtime_ns: int | None = os.stat(watched.path).st_mtime_ns
            except OSError:
                mtime_ns = None
            if mtime_ns is not None and mtime_ns != watched.mtime_ns:
                age = max(wall - mtime_ns / 1e9, 0.0)
                watched.progress_at = min(max(watched.progress_at, self._looked_at, now - age), now)
            watched.mtime_ns = mtime_ns
        self._looked_at = now
        if not self._workers or self.timeout is None:
            return None
        rank, worst = min(self._workers.items(), key=lambda kv: (self._due(kv[1]), kv[0]))
        if now < self._due(worst):
            return None
        return Hang(local_rank=rank, silent_for=now - worst.progress_at, never=self.never_progressed(rank))

    def _due(self, watched: _Watched) -> float:
        """When the worker is overdue (watchdog clock).

        The timeout after its latest progress; while it has made none, the start timeout
        after the watchdog's start.
        """
        allowed = self.timeout if watched.mtime_ns is not None else self.start_timeout
        assert allowed is not None  # only asked with a timeout
        return watched.progress_at + allowed

    def never_progressed(self, local_rank: int) -> bool:
        """Whether the worker has made no progress at all since the watchdog was made."""
        return self._workers[local_rank].mtime_ns is None

    def silences(self) -> dict[int, float]:
        """How long each worker had made no progress at the latest look (`check`)."""
        return {rank: self._looked_at - w.progress_at for rank, w in self._workers.items()}

    def next_check_at(self) -> float | None:
        """The earliest moment (watchdog clock) a worker could be overdue."""
        if not self._workers or self.timeout is None:
            return None
        # A worker yet to make progress may make it any moment, and then be due a
        # timeout later: look again by then, to see it (its start allowance is longer).
        return min(min(self._due(w), self._looked_at + self.timeout) for w in self._workers.values())

    async def hang(self) -> Hang:
        """Return when a worker has made no progress for the timeout."""
        while True:
            found = self.check()
            if found is not None:
                return found
            due = self.next_check_at()
            if due is None:  # nothing to watch: never
                await asyncio.Event().wait()
            else:
                await asyncio.sleep(max(due - self._clock(), 0.0))


def hang_failure(
    hang: Hang,
    *,
    node_id: str,
    node_rank: int,
    rank_offset: int,
    pid: int,
    returncode: int,
    timeout: float,
    stderr_tail: Sequence[str] = (),
    at: float | None = None,
) -> WorkerFailure:
    """The hung worker as the failure report's root cause (`make_report`).

    `returncode` is how the worker ended once stopped; `at` when the hang was found
    (wall clock, default now). The "traceback" names the hang and shows the worker's
    last stderr lines, which often say where it waited.
    """
    where = f", {hang.waiting}" if hang.waiting else ""
    never = " since it started, never calling heartbeat() or stepping an optimizer" if hang.never else ""
    detail = (
        f"hung: no progress for {hang.silent_for:.0f}s{never} (--progress-timeout={timeout:g}s{where}); "
        "the agent stopped it"
    )
    tail = traceback_from_stderr(stderr_tail)
    return WorkerFailure(
        node_id=node_id,
        node_rank=node_rank,
        global_rank=rank_offset + hang.local_rank,
        local_rank=hang.local_rank,
        pid=pid,
        returncode=returncode,
        time=time.time() if at is None else at,
        traceback_source="the progress watchdog",
        stopped_by="the progress watchdog",
        traceback=f"{detail}\nlast stderr lines:\n{tail}" if tail.strip() else detail,
    )
