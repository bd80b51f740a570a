"""Carry each worker's stdout and stderr to its log files and the console.

A stream that has a log file (`redirects` or `tee` names it) is that file: the agent
opens it before the worker starts and the worker gets it as its stdout or stderr, so
the kernel writes every byte there, whatever happens to the agent afterwards (SIGKILL
included: a pipe would lose what the agent had not read yet). The agent follows the
file as it grows (elasticrun.agent.filetail) for the console, as torchrun tails its
workers' files for `--tee`. A stream without a file is a pipe that the agent reads.

Console lines carry the worker's global rank (`[3]<stderr>: text`), or the prefix that
TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE makes (torchrun's `${rank}`, `${local_rank}`,
`${role_name}`), and are written whole, so the output of many workers never mixes
inside a line. One exception, on a terminal only: a line that redraws itself with `\r`
(a progress bar) is shown as it is drawn, each frame over the last under the line's
prefix, as the worker's own terminal would show it. Log files hold the worker's bytes
unchanged. As torchrun: `redirects` sends a stream to its file only, `tee` to its file
and the console (`tee` wins where both name a stream), `local_ranks_filter` keeps other
ranks off the console (not out of their files). Every line, shown or not, also goes to
the `publish` sink (the job's `elasticrun logs`), and the last lines of stderr stay in
memory for the failure report.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import json
import logging
import os
import sys
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import BinaryIO, Protocol

from elasticrun.agent.filetail import FileTail
from elasticrun.agent.runfolder import open_log
from elasticrun.agent.spec import Std, WorkerSpec
from elasticrun.errors import WorkerStartError

logger = logging.getLogger("elasticrun.agent")

#: stderr lines kept per worker for the failure report
TAIL_LINES = 200
#: a longer line is cut into pieces of this size, so memory stays bounded
MAX_LINE = 64 * 1024
_CHUNK = 64 * 1024

#: (global rank, "stdout" or "stderr", whole lines) -> None
LineSink = Callable[[int, str, list[str]], None]


class _Reader(Protocol):
    """A worker stream: its pipe (asyncio.StreamReader) or its log file (FileTail)."""

    async def read(self, n: int) -> bytes:
        """Up to `n` bytes, waiting while there are none; b"" at the end."""
        ...


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
    shown = spec.options.local_ranks_filter is None or local_rank in spec.options.local_ranks_filter
    plans = {}
    for std, name in ((Std.OUT, "stdout"), (Std.ERR, "stderr")):
        to_file = bool((redirect | tee) & std)
        plans[std] = StreamPlan(
            # tee wins over redirects, as in torchrun (its tee is a redirect plus a tail)
            console=shown and bool(tee & std or not redirect & std),
            file=worker_dir / f"{name}.log" if to_file else None,
        )
    return plans


@contextlib.contextmanager
def worker_stdio(
    plans: Mapping[int, Mapping[Std, StreamPlan]],
) -> Iterator[dict[int, tuple[int, int]]]:
    """Per local rank, the (stdout, stderr) to start the worker with.

    The descriptor of the stream's log file, or asyncio.subprocess.PIPE where it has
    none.

    The files are opened here, before any worker starts, so a log folder we cannot write
    to fails the start, and so does a link planted where one goes (it is never followed,
    see elasticrun.agent.runfolder). They are emptied (a file left by an earlier run
    under the same run and node id would be relayed again) and opened for appending
    (every write lands at the end, whichever process of the worker's makes it). The
    agent's descriptors close when the block ends: start the workers inside it; theirs
    stay open.
    """
    with contextlib.ExitStack() as opened:
        yield {
            local_rank: (
                _open_log(streams[Std.OUT].file, opened),
                _open_log(streams[Std.ERR].file, opened),
            )
            for local_rank, streams in plans.items()
        }


def _open_log(path: Path | None, opened: contextlib.ExitStack) -> int:
    if path is None:
        return asyncio.subprocess.PIPE
    fd = open_log(path, truncate=True)
    opened.callback(os.close, fd)
    return fd


class Duplicates:
    """torchrun's --duplicate-stdout-filters and --duplicate-stderr-filters.

    The lines of the tee'd streams (--tee) that contain one of a stream's filters,
    copied with their console prefix to `<attempt folder>/filtered_stdout.log` (or
    `filtered_stderr.log`)."""

    def __init__(self, attempt_dir: Path, filters: Mapping[str, tuple[str, ...]]) -> None:
        self._filters = {stream: needles for stream, needles in filters.items() if needles}
        self._files = {
            stream: open(open_log(attempt_dir / f"filtered_{stream}.log", truncate=True), "w", errors="replace")  # noqa: SIM115
            for stream in self._filters
        }

    def take(self, stream: str, prefix: str, lines: list[str]) -> None:
        out = self._files.get(stream)
        if out is None:
            return
        needles = self._filters[stream]
        kept = [f"{prefix}{line}\n" for line in lines if any(n in line for n in needles)]
        if kept:
            out.writelines(kept)
            out.flush()

    def close(self) -> None:
        for out in self._files.values():
            out.close()


class WorkerOutput:
    """Reads one worker's two streams, each its pipe or its log file, to their end."""

    def __init__(
        self,
        pipes: tuple[asyncio.StreamReader | None, asyncio.StreamReader | None],
        global_rank: int,
        plans: Mapping[Std, StreamPlan],
        publish: LineSink | None = None,
        *,
        prefix_template: str | None = None,
        local_rank: int = 0,
        role: str = "default",
        duplicates: Duplicates | None = None,
        json_node: str | None = None,
    ) -> None:
        """`pipes` are the worker's (stdout, stderr) pipes, None where `plans` names a file.

        The worker was started with `worker_stdio(...)` of the same `plans`.

        `publish(global_rank, stream, lines)` also gets every whole line, decoded. With
        `json_node` (--log-format=json), each console line is a JSON object, as the
        agent's own lines are: `time`, `node`, `rank`, `stream`, `text`.
        """
        #: the worker's global rank, for prefixes and reports; in-process mode updates
        #: it when a round moves the worker
        self.global_rank = global_rank
        self._template = Template(prefix_template) if prefix_template is not None else None
        self._local_rank, self._role = local_rank, role
        self._json_node = json_node
        self.stderr_tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._tails: list[FileTail] = []
        streams = (
            (pipes[0], Std.OUT, "stdout", sys.stdout.buffer),
            (pipes[1], Std.ERR, "stderr", sys.stderr.buffer),
        )
        try:
            readers = [self._reader(pipe, plans[std]) for pipe, std, _, _ in streams]
        except BaseException:
            self._close_tails()
            raise

        def sink(stream: str, plan: StreamPlan) -> Callable[[list[str]], None]:
            teed = duplicates is not None and plan.console and plan.file is not None

            def take(lines: list[str]) -> None:
                if stream == "stderr":
                    self.stderr_tail.extend(lines)
                if publish is not None:
                    publish(self.global_rank, stream, lines)
                if teed:
                    assert duplicates is not None
                    duplicates.take(stream, self._prefix(stream).decode(errors="replace"), lines)

            return take

        self._tasks = [
            asyncio.create_task(
                _copy(
                    reader,
                    functools.partial(self._prefix, stream),
                    console if plans[std].console else None,
                    sink(stream, plans[std]),
                    functools.partial(self._json_line, stream) if json_node is not None else None,
                )
            )
            for reader, (_, std, stream, console) in zip(readers, streams, strict=True)
        ]
        for task, (_, _, stream, _) in zip(self._tasks, streams, strict=True):
            task.add_done_callback(functools.partial(self._copy_ended, stream))

    def _copy_ended(self, stream: str, task: asyncio.Task[None]) -> None:
        """A copy that fails is said at once.

        The worker runs on (a log file still takes its output), but the stream no longer
        reaches the console, the tail or status."""
        if not task.cancelled() and task.exception() is not None:
            logger.warning(
                "rank %d: its %s is no longer followed: %r", self.global_rank, stream, task.exception()
            )

    def _prefix(self, stream: str) -> bytes:
        # read for every line: an in-process round may move the worker to another rank
        if self._template is not None:
            return self._template.safe_substitute(
                role_name=self._role, rank=self.global_rank, local_rank=self._local_rank
            ).encode()
        return f"[{self.global_rank}]<{stream}>: ".encode()

    def _json_line(self, stream: str, line: bytes) -> bytes:
        at = datetime.datetime.now().astimezone().isoformat(timespec="milliseconds")
        text = line.decode(errors="replace")
        return json.dumps(
            {"time": at, "node": self._json_node, "rank": self.global_rank, "stream": stream, "text": text}
        ).encode()

    def _reader(self, pipe: asyncio.StreamReader | None, plan: StreamPlan) -> _Reader:
        if plan.file is not None:
            try:
                tail = FileTail(plan.file)
            except OSError as e:
                raise WorkerStartError(
                    f"cannot follow the log file {plan.file}: {e.strerror or e}"
                ) from e
            self._tails.append(tail)
            return tail
        assert pipe is not None, "a stream without a log file is started as a pipe"
        return pipe

    async def drain(self, timeout: float) -> None:
        """Read what is left, once the worker has exited.

        Each log file to its end as of now, each pipe until it closes (the worker and
        its children are gone).

        A grandchild that escaped the worker's process group may write on: to a log
        file, what it writes from now on is in the file only; a pipe it may hold open
        for ever, so after `timeout` seconds the pipe's remaining output is dropped.
        """
        for tail in self._tails:
            tail.finish()
        _, pending = await asyncio.wait(self._tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._close_tails()

    def _close_tails(self) -> None:
        for tail in self._tails:
            tail.close()
        self._tails.clear()


async def _copy(
    reader: _Reader,
    prefix: Callable[[], bytes],
    console: BinaryIO | None,
    sink: Callable[[list[str]], None],
    as_json: Callable[[bytes], bytes] | None = None,
) -> None:
    """Read one stream to its end.

    Whole prefixed lines to the console (or each as a JSON object, `as_json`), decoded
    lines to the sink; on a terminal, the frames of a line that redraws itself as they
    come (not in JSON, whose lines are whole)."""
    partial = b""
    live = _Terminal.of(console) if as_json is None else None
    me = object()  # this stream, as the owner of the terminal's open line
    while True:
        chunk = await reader.read(_CHUNK)
        lines, partial = _split_lines(partial + chunk, eof=not chunk)
        if lines:
            if console is not None:
                head = prefix()
                if as_json is not None:
                    data = b"".join(as_json(line) + b"\n" for line in lines)
                elif live is None:
                    data = b"".join(head + line + b"\n" for line in lines)
                else:
                    data = live.lines(me, head, lines)
                console = _write(console, data)
            sink([line.decode(errors="replace") for line in lines])
        if console is not None and live is not None and b"\r" in partial:
            frame = _last_frame(partial)
            if frame:
                console = _write(console, live.frame(me, prefix() + frame))
        if not chunk:
            return


class _Terminal:
    """A console that is a terminal, and which stream's line is open on it.

    An open line is a frame of a redrawn line, without its newline yet: another stream's
    output starts below it, and the owner's next frame or line replaces it."""

    _known: dict[int, _Terminal | None] = {}

    def __init__(self) -> None:
        self.owner: object | None = None

    @classmethod
    def of(cls, console: BinaryIO | None) -> _Terminal | None:
        if console is None:
            return None
        key = id(console)
        if key not in cls._known:
            try:
                cls._known[key] = cls() if console.isatty() else None
            except (OSError, ValueError):
                cls._known[key] = None
        return cls._known[key]

    def _lead(self, me: object) -> bytes:
        lead = b"" if self.owner is None else b"\r" if self.owner is me else b"\n"
        self.owner = None
        return lead

    def lines(self, me: object, head: bytes, lines: list[bytes]) -> bytes:
        """Whole lines; one that redrew itself (or ends the open line) as its last frame."""
        lead = self._lead(me)
        out = [lead]
        for line in lines:
            redrawn = lead == b"\r" or b"\r" in line
            out.append(head + _last_frame(line) + (_ERASE_REST if redrawn else b"") + b"\n")
            lead = b""
        return b"".join(out)

    def frame(self, me: object, frame: bytes) -> bytes:
        data = self._lead(me) + frame + _ERASE_REST
        self.owner = me
        return data


#: the terminal's "erase to the end of the line": a shorter frame leaves nothing behind
_ERASE_REST = b"\x1b[K"


def _last_frame(line: bytes) -> bytes:
    """What a terminal shows of a line that redraws itself with \\r: its last frame."""
    if b"\r" not in line:
        return line
    frames = [f for f in line.split(b"\r") if f]
    return frames[-1] if frames else b""


def _write(sink: BinaryIO, data: bytes) -> BinaryIO | None:
    """Write and flush; on failure (disk full, closed console) warn and drop the sink.

    The stream is still read to its end: a pipe must be, or the worker would block on
    it, and the stderr tail and the `publish` sink still take every line.
    """
    try:
        sink.write(data)
        sink.flush()
    except OSError as e:
        logger.warning("no more worker output to %s: %s", sink.name, e)
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
