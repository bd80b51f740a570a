"""Carry each worker's stdout and stderr to the console and to its log files.

Console lines carry the worker's global rank (`[3]<stderr>: text`) and are written whole,
so the output of many workers never mixes inside a line. Log files get the worker's
bytes unchanged. As torchrun: `redirects` sends a stream to its file only, `tee` to the
console and its file, `local_ranks_filter` keeps other ranks off the console (not out of
their files). The last lines of stderr stay in memory for the failure report.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from elasticrun.agent.spec import Std, WorkerSpec

logger = logging.getLogger("elasticrun.agent")

#: stderr lines kept per worker for the failure report
TAIL_LINES = 200
#: a longer line is cut into pieces of this size, so memory stays bounded
MAX_LINE = 64 * 1024
_CHUNK = 64 * 1024

#: (global rank, "stdout" or "stderr", whole lines) -> None
LineSink = Callable[[int, str, list[str]], None]


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
        publish: LineSink | None = None,
    ) -> None:
        """`publish(global_rank, stream, lines)` also gets every whole line, decoded."""
        #: the worker's global rank, for prefixes and reports; in-process mode updates
        #: it when a round moves the worker
        self.global_rank = global_rank
        self.stderr_tail: deque[str] = deque(maxlen=TAIL_LINES)
        # Files are opened here, so a log folder we cannot write to fails the start.
        out_file = plans[Std.OUT].file.open("wb") if plans[Std.OUT].file else None
        err_file = plans[Std.ERR].file.open("wb") if plans[Std.ERR].file else None

        def sink(stream: str) -> Callable[[list[str]], None]:
            def take(lines: list[str]) -> None:
                if stream == "stderr":
                    self.stderr_tail.extend(lines)
                if publish is not None:
                    publish(self.global_rank, stream, lines)

            return take

        self._tasks = [
            asyncio.create_task(
                _copy(
                    reader,
                    lambda stream=stream: f"[{self.global_rank}]<{stream}>: ".encode(),  # type: ignore[misc]
                    console if plans[std].console else None,
                    log_file,
                    sink(stream),
                )
            )
            for reader, stream, std, console, log_file in (
                (stdout, "stdout", Std.OUT, sys.stdout.buffer, out_file),
                (stderr, "stderr", Std.ERR, sys.stderr.buffer, err_file),
            )
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
    reader: asyncio.StreamReader,
    prefix: Callable[[], bytes],
    console: BinaryIO | None,
    log_file: BinaryIO | None,
    sink: Callable[[list[str]], None],
) -> None:
    """Copy one pipe until it closes: whole prefixed lines to the console, bytes to the
    log file, decoded lines to the sink."""
    log = log_file
    try:
        partial = b""
        while True:
            chunk = await reader.read(_CHUNK)
            if log is not None and chunk:
                log = _write(log, chunk)
            lines, partial = _split_lines(partial + chunk, eof=not chunk)
            if console is not None and lines:
                head = prefix()
                console = _write(console, b"".join(head + line + b"\n" for line in lines))
            if lines:
                sink([line.decode(errors="replace") for line in lines])
            if not chunk:
                return
    finally:
        if log_file is not None:
            log_file.close()


def _write(sink: BinaryIO, data: bytes) -> BinaryIO | None:
    """Write and flush; on failure (disk full, closed console) warn and drop the sink.

    The pipe must still be read to its end, or the worker would block on a full pipe.
    """
    try:
        sink.write(data)
        sink.flush()
    except OSError as e:
        logger.warning("worker output to %s is lost from here on: %s", sink.name, e)
        return None
    return sink


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
