"""The failure report: which worker failed first (the root cause), how, and why.

The traceback comes from the worker's error file when the script used torch's
`torch.distributed.elastic.multiprocessing.errors.record`, and otherwise from the last
lines of the worker's stderr, so users get one without decorating anything.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from elasticrun.agent.processes import WorkerExit

#: what a signal usually means, for people reading the report
_SIGNAL_HINTS = {
    signal.SIGKILL: "often the out-of-memory killer",
    signal.SIGSEGV: "a crash in native code",
    signal.SIGABRT: "an abort in native code, e.g. a failed CUDA or NCCL check",
    signal.SIGBUS: "a bad memory access, e.g. /dev/shm too small",
    signal.SIGTERM: "stopped from outside the job",
}
#: stderr lines shown when they hold no Python traceback
_PLAIN_TAIL_LINES = 20
_CHAINED = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)


def describe_exit(returncode: int, stopped_by: str = "") -> str:
    """How a worker ended, for people: `exit code 3`, `SIGKILL (-9), often the out-of-memory killer`.

    A worker the agent stopped itself says who did: `SIGTERM (-15), stopped by the progress watchdog`.
    """
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        sig = signal.Signals(-returncode)
    except ValueError:
        return f"signal {-returncode} ({returncode})"
    hint = f"stopped by {stopped_by}" if stopped_by else _SIGNAL_HINTS.get(sig)
    return f"{sig.name} ({returncode})" + (f", {hint}" if hint else "")


@dataclass(frozen=True, slots=True)
class ErrorFile:
    """What torch's `@record` wrote for a failed worker."""

    message: str
    traceback: str


def parse_error_file(text: str) -> ErrorFile | None:
    """Read torch's error-file JSON; None when it is not in that format.

    The format: {"message": {"message": "...", "extraInfo": {"py_callstack": "...",
    "timestamp": "..."}}}, or {"message": "..."} from other writers.
    """
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    message = data.get("message")
    if isinstance(message, str):
        return ErrorFile(message=message, traceback="")
    if not isinstance(message, dict):
        return None
    extra = message.get("extraInfo")
    callstack = extra.get("py_callstack") if isinstance(extra, dict) else None
    return ErrorFile(
        message=str(message.get("message", "")),
        traceback=callstack if isinstance(callstack, str) else "",
    )


def read_error_file(path: Path) -> ErrorFile | None:
    """The worker's error file, or None when it wrote none (or not in torch's format)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    return parse_error_file(text)


def traceback_from_stderr(lines: Sequence[str]) -> str:
    """The last Python traceback in these stderr lines, or their last lines when there is none.

    The traceback comes with the exceptions chained to it."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most")]
    if not starts:
        return "\n".join(lines[-_PLAIN_TAIL_LINES:])
    start = starts.pop()
    while starts:
        between = [line for line in lines[:start] if line.strip()]
        if not between or between[-1] not in _CHAINED:
            break
        start = starts.pop()
    return "\n".join(lines[start:])


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    """One worker that ended on its own with a non-zero status."""

    node_id: str
    node_rank: int
    global_rank: int
    local_rank: int
    pid: int
    returncode: int
    #: when the agent saw it exit (seconds since the epoch)
    time: float
    #: where the traceback came from: the error file's path, or "stderr"
    traceback_source: str
    traceback: str
    #: who stopped it, when the agent did (its exit is no cause of its own)
    stopped_by: str = ""


def make_failure(
    worker_exit: WorkerExit,
    *,
    node_id: str,
    node_rank: int,
    rank_offset: int,
    error_file: Path,
    error: ErrorFile | None,
    stderr_tail: Sequence[str],
) -> WorkerFailure:
    """Combine a failed worker's exit, its error file (if any) and its stderr tail."""
    if error is not None and error.traceback:
        source, text = str(error_file), error.traceback.rstrip("\n")
    elif error is not None and error.message:
        source, text = str(error_file), error.message
    else:
        source, text = "stderr", traceback_from_stderr(stderr_tail)
    return WorkerFailure(
        node_id=node_id,
        node_rank=node_rank,
        global_rank=rank_offset + worker_exit.local_rank,
        local_rank=worker_exit.local_rank,
        pid=worker_exit.pid,
        returncode=worker_exit.returncode,
        time=worker_exit.time,
        traceback_source=source,
        traceback=text,
    )


@dataclass(frozen=True, slots=True)
class FailureReport:
    """The root cause (the earliest failure), the others, and the text for people."""

    root_cause: WorkerFailure
    others: tuple[WorkerFailure, ...]
    text: str


def make_report(
    failures: Sequence[WorkerFailure], *, title: str, stacks: Sequence[str] = (), stacks_file: str = ""
) -> FailureReport:
    """The report over one attempt's failures (at least one); `title` names the job.

    `stacks` summarises where the ranks were when a hang was found (stack_summary),
    `stacks_file` is where they all are."""
    ordered = sorted(failures, key=lambda f: (f.time, f.global_rank))
    root, others = ordered[0], tuple(ordered[1:])
    rule = "=" * 72
    lines = [
        rule,
        title,
        "-" * 72,
        "Root cause (first failure):",
        f"  rank      : {root.global_rank} (local rank {root.local_rank})",
        f"  node      : {root.node_rank} ({root.node_id})",
        f"  exit      : {describe_exit(root.returncode, root.stopped_by)}",
        f"  pid       : {root.pid}",
        f"  time      : {_format_time(root.time)}",
        f"  traceback (from {root.traceback_source}):",
    ]
    traceback = root.traceback or "(none: no error file, nothing on stderr)"
    lines += [f"    {line}" for line in traceback.splitlines()]
    if others:
        lines += ["-" * 72, "Other failures:"]
        lines += [
            f"  rank {f.global_rank} (local rank {f.local_rank}, node {f.node_rank}): "
            f"{describe_exit(f.returncode, f.stopped_by)} at {_format_time(f.time)}"
            for f in others
        ]
    if stacks:
        where = f"; all of them in {stacks_file}" if stacks_file else ""
        lines += ["-" * 72, f"Where the ranks were (their stacks when the hang was found{where}):"]
        lines += [f"  {line}" for line in stacks]
    lines.append(rule)
    return FailureReport(root_cause=root, others=others, text="\n".join(lines))


def _format_time(t: float) -> str:
    return datetime.fromtimestamp(t).astimezone().isoformat(timespec="milliseconds")
