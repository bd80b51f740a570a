"""Carry each worker's stdout and stderr to the console and to its log files.

Console lines carry the worker's global rank (`[3]<stderr>: text`) and are written whole,
so the output of many workers never mixes inside a line. Log files get the worker's
bytes unchanged. As torchrun: `redirects` sends a stream to its file only, `tee` to the
console and its file, `local_ranks_filter` keeps other ranks off the console (not out of
their files). The last lines of stderr stay in memory for the failure report.
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from elasticrun.agent.spec import Std, WorkerSpec

#: stderr lines kept per worker for the failure report
TAIL_LINES = 200
#: a longer line is cut into pieces of this size, so memory stays bounded
MAX_LINE = 64 * 1024
_CHUNK = 64 * 1024


@dataclass(frozen=True, slots=True)
class StreamPlan:
    """Where one stream of one worker goes."""

    console: bool
    file: Path | None


def plan_streams(
    spec: WorkerSpec, local_rank: int, worker_dir: Path
) -> dict[Std, StreamPlan]:
    """For Std.OUT and Std.ERR of `local_rank`: console or not, which file if any."""
    redirect = spec.redirects.get(local_rank, Std.NONE)
    tee = spec.tee.get(local_rank, Std.NONE)
    shown = spec.local_ranks_filter is None or local_rank in spec.local_ranks_filter
    plans = {}
    for std, name in ((Std.OUT, "stdout"), (Std.ERR, "stderr")):
        to_file = bool((redirect | tee) & std)
        plans[std] = StreamPlan(
            console=shown and not redirect & std,
            file=worker_dir / f"{name}.log" if to_file else None,
        )
    return plans


class WorkerOutput:
    """Copies one worker's two pipes until they close."""

    def __init__(
        self,
        stdout: asyncio.StreamReader,
        stderr: asyncio.StreamReader,
        global_rank: int,
        plans: dict[Std, StreamPlan],
    ) -> None:
        self.stderr_tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._tasks = [
            asyncio.create_task(
                self._copy(stdout, plans[Std.OUT], f"[{global_rank}]<stdout>: ", None)
            ),
            asyncio.create_task(
                self._copy(
                    stderr, plans[Std.ERR], f"[{global_rank}]<stderr>: ", self.stderr_tail
                )
            ),
        ]

    async def drain(self, timeout: float) -> None:
        """Wait for both pipes to close (the worker and its children are gone).

        A grandchild that escaped the worker's process group may hold a pipe open for
        ever: after `timeout` seconds its remaining output is dropped.
        """
        _, pending = await asyncio.wait(self._tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _copy(
        self,
        reader: asyncio.StreamReader,
        plan: StreamPlan,
        prefix: str,
        tail: deque[str] | None,
    ) -> None:
        console: BinaryIO | None = None
        if plan.console:
            console = sys.stdout.buffer if tail is None else sys.stderr.buffer
        prefix_bytes = prefix.encode()
        log = plan.file.open("wb") if plan.file is not None else None
        try:
            partial = b""
            while True:
                chunk = await reader.read(_CHUNK)
                if log is not None and chunk:
                    log.write(chunk)
                    log.flush()
                lines, partial = _split_lines(partial + chunk, eof=not chunk)
                if console is not None and lines:
                    console.write(b"".join(prefix_bytes + line + b"\n" for line in lines))
                    console.flush()
                if tail is not None:
                    tail.extend(line.decode(errors="replace") for line in lines)
                if not chunk:
                    return
        finally:
            if log is not None:
                log.close()


def _split_lines(data: bytes, *, eof: bool) -> tuple[list[bytes], bytes]:
    """Whole lines in `data` (without newlines) and the unfinished rest.

    An unfinished rest longer than MAX_LINE, or any rest at end of file, is a line too.
    """
    lines = data.split(b"\n")
    rest = lines.pop()
    while len(rest) > MAX_LINE:
        lines.append(rest[:MAX_LINE])
        rest = rest[MAX_LINE:]
    if eof and rest:
        lines.append(rest)
        rest = b""
    return lines, rest
