"""Where each worker is: its Python stacks, dumped by faulthandler on a signal.

Every worker gets a stack file of its own in its attempt folder (`stacks_env`:
ELASTICRUN_STACKS_FILE). The worker boot (elasticrun/worker/boot/sitecustomize.py)
registers faulthandler on `STACKS_SIGNAL` with that file and writes a first line,
`elasticrun-stacks pid <pid>`. faulthandler writes every thread's stack from C inside
the signal handler, so a dump comes while the main thread is blocked in a collective,
holds the GIL in native code, or sleeps.

Why not py-spy: it reads a process with ptrace, which Yama (ptrace_scope=1, the default
on Ubuntu and Debian) refuses between sibling processes, and which many containers
refuse outright (no CAP_SYS_PTRACE); and it is a binary to install on every node.

A capture (`StackCapture.capture`):

- signals only a process that marked the file (a real-time signal's default action
  ends a process): the latest marker's pid, which must be one of the worker's processes
  (`sessions.belongs`: under a wrapper it is a descendant of the worker the agent
  started) and must handle the signal (its SigCgt in /proc), through a pidfd checked
  against the process the checks saw;
- knows the dump is complete without reading its text: the kernel blocks a signal in
  the thread that runs its handler until the handler returns. Once the file has grown
  and the signal is neither pending nor blocked in any thread that did not block it
  before it was sent, faulthandler has returned (the file's size is read first: a thread
  that writes is in the handler, so it blocks the signal until it is done);
- waits a bounded time: a process stopped or stuck in the kernel (state D, a GPU
  driver) does not run its handler; it is then said in one line, like a worker that
  never loaded the boot (`python -I`, `-E`, `-S`, or not Python) or that has exited.

Captures of one agent run one at a time: two dumps into one file would interleave.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from elasticrun.agent.runfolder import create_new, open_log
from elasticrun.agent.sessions import Session, belongs, process_start
from elasticrun.collectives import is_wrapper_frame
from elasticrun.rendezvous.records import Frame, RankStacks, ThreadStack

#: the worker's variable naming its stack file (read by the worker boot)
STACKS_FILE_ENV = "ELASTICRUN_STACKS_FILE"
#: the signal the boot registers faulthandler on (its STACKS_SIGNAL_OFFSET): a real-time
#: one, which no framework handles (SIGUSR1 and SIGUSR2 are Slurm's and Lightning's)
STACKS_SIGNAL = signal.SIGRTMIN + 7
#: the line the boot writes first, before its pid
MARKER = "elasticrun-stacks pid "

#: why a worker that has not marked its file has no stack
NO_BOOT = (
    "its Python has not started yet, or it never loads elasticrun's boot "
    "(Python started with -I, -E or -S, or not Python): no stack can be had from it"
)

#: how long a signal may look taken with nothing written before the handler counts
#: as another's (the moment between the kernel taking it and the handler starting)
_QUIET = 0.05

_HEADER = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)(?: \[[^\]]*\])? \(most recent call first\):$")
_FRAME = re.compile(r'^  File "(.*)", line (\d+|\?\?\?) in (.*)$')


def stacks_env(path: Path) -> dict[str, str]:
    """What to add to a worker's environment so that its boot dumps to `path`."""
    return {STACKS_FILE_ENV: str(path)}


def prepare_file(path: Path) -> None:
    """Create the worker's stack file empty, 0600 (never through a link): the boot appends to it."""
    os.close(open_log(path, truncate=True))


# --- faulthandler's text -------------------------------------------------------------


def _is_thread_start(thread: ThreadStack) -> bool:
    outer = thread.frames[-1] if thread.frames else None
    return outer is not None and outer.function in ("_bootstrap", "_bootstrap_inner") and outer.file.endswith(
        "threading.py"
    )


def parse_dump(text: str) -> tuple[tuple[ThreadStack, ...], int]:
    """faulthandler's all-threads dump as thread stacks, the main thread first.

    And how many threads it left out (it writes 100 at most).

    faulthandler lists the threads newest first and does not say which one is the main
    thread: it is the oldest (last) one that threading did not start."""
    threads: list[ThreadStack] = []
    more_threads = 0
    current: tuple[str, list[Frame], int] | None = None

    def close() -> None:
        if current is not None:
            threads.append(ThreadStack(thread=current[0], frames=tuple(current[1]), more=current[2]))

    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            close()
            current = (header[1], [], 0)
            continue
        if line == "...":  # faulthandler's limit on threads
            more_threads += 1
            continue
        if current is None:
            continue
        frame = _FRAME.match(line)
        if frame and is_wrapper_frame(frame[1], frame[3]):
            continue  # the step timing's wrapper: ours, between the user's call and torch's
        if frame:
            number = 0 if frame[2] == "???" else int(frame[2])
            current[1].append(Frame(file=frame[1], line=number, function=frame[3]))
        elif line.strip() == "...":  # faulthandler's limit on frames: at least one more
            current = (current[0], current[1], current[2] + 1)
    close()
    if not threads:
        return (), more_threads
    candidates = [i for i, t in enumerate(threads) if not _is_thread_start(t)]
    main = candidates[-1] if candidates else len(threads) - 1
    ordered = [replace(threads[main], main=True)] + [t for i, t in enumerate(threads) if i != main]
    return tuple(ordered), more_threads


def marked_pid(text: str) -> int | None:
    """The pid of the latest process that marked the file (None: none did)."""
    found = None
    for line in text.splitlines():
        if line.startswith(MARKER):
            with contextlib.suppress(ValueError):
                found = int(line[len(MARKER):].strip())
    return found


# --- /proc ---------------------------------------------------------------------------


def _status(path: str) -> dict[str, str]:
    """The fields of a /proc status file that a capture reads (empty when the process is gone).

    Read as bytes and searched: a capture reads one per thread, again and again while it
    waits, and parsing each whole was most of its cost."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    found = {}
    for name in _FIELDS:
        at = raw.find(b"\n" + name + b":")
        if at >= 0:
            end = raw.find(b"\n", at + 1)
            found[name.decode()] = raw[at + len(name) + 2 : end if end >= 0 else None].decode(errors="replace").strip()
    return found


#: the status fields a capture reads: signals pending (thread, process), blocked, caught
_FIELDS = (b"State", b"SigPnd", b"ShdPnd", b"SigBlk", b"SigCgt")


def _has(mask: str, sig: int) -> bool:
    try:
        return bool(int(mask, 16) >> (sig - 1) & 1)
    except ValueError:
        return False


def _threads_blocking(pid: int, sig: int) -> set[str]:
    """The threads of `pid` that block `sig` now (they cannot take it)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return set()
    return {tid for tid in tids if _has(_status(f"/proc/{pid}/task/{tid}/status").get("SigBlk", "0"), sig)}


def _handled(pid: int, sig: int, blocking_before: set[str]) -> bool | None:
    """Whether `sig`, sent to `pid`, has been handled.

    Pending in no thread nor the process, and blocked by no thread that did not block it
    before (a thread blocks a signal while it runs its handler). None: the process is
    gone."""
    status = _status(f"/proc/{pid}/status")
    if not status:
        return None
    if _has(status.get("ShdPnd", "0"), sig):
        return False
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        task = _status(f"/proc/{pid}/task/{tid}/status")
        if _has(task.get("SigPnd", "0"), sig):
            return False
        if tid not in blocking_before and _has(task.get("SigBlk", "0"), sig):
            return False
    return True


def _why_not(pid: int, session: Session, sig: int) -> str:
    """Why process `pid` must not be signalled ("": it may)."""
    if not belongs(pid, session):
        if not _status(f"/proc/{pid}/status"):
            return f"its Python process (pid {pid}) has exited"
        return f"pid {pid} in its stack file is not one of the worker's processes: not signalled"
    status = _status(f"/proc/{pid}/status")
    if not _has(status.get("SigCgt", "0"), sig):
        return f"process {pid} does not handle the dump signal (it replaced the boot's handler): not signalled"
    return ""


def _state(pid: int) -> str:
    return _status(f"/proc/{pid}/status").get("State", "gone")


# --- a capture -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    """One worker to capture."""

    local_rank: int
    rank: int
    #: the session the agent started it in
    session: Session
    #: its stack file
    file: Path
    #: how it ended, when it has ("": it runs)
    exited: str = ""


@dataclass(slots=True)
class _Sent:
    target: Target
    pid: int
    pidfd: int
    offset: int
    blocking: set[str]
    #: since when the signal looked handled while the file had not grown
    quiet_since: float | None = None


class StackCapture:
    """One agent's stack captures, one at a time (in a thread: it reads /proc and sleeps)."""

    def __init__(self, node_id: str, sig: int = STACKS_SIGNAL) -> None:
        self.node_id = node_id
        self._sig = sig
        self._lock = threading.Lock()
        #: per stack file: how far it was read, and the latest pid marked in it (a file
        #: grows by a dump per capture: only what is new is read again)
        self._marks: dict[Path, tuple[int, int | None]] = {}

    def capture(self, targets: Sequence[Target], limit: float) -> tuple[RankStacks, ...]:
        """Every target's stacks, or why there are none; waits `limit` s at most for the dumps.

        Blocks: run it in a thread."""
        with self._lock:
            self._marks = {t.file: self._marks[t.file] for t in targets if t.file in self._marks}
            results: dict[int, RankStacks] = {}
            sent: list[_Sent] = []
            try:
                for target in targets:
                    outcome = self._send(target)
                    if isinstance(outcome, _Sent):
                        sent.append(outcome)
                    else:
                        results[target.local_rank] = outcome
                self._collect(sent, results, time.monotonic() + limit, limit)
            finally:
                for s in sent:
                    os.close(s.pidfd)
            return tuple(results[t.local_rank] for t in targets)

    def _missing(self, target: Target, why: str, pid: int = 0) -> RankStacks:
        return RankStacks(rank=target.rank, local_rank=target.local_rank, node_id=self.node_id, pid=pid, missing=why)

    def _send(self, target: Target) -> _Sent | RankStacks:
        if target.exited:
            return self._missing(target, f"the worker has exited ({target.exited})")
        read, pid = self._marks.get(target.file, (0, None))
        try:
            data = _read_from(target.file, read)
        except OSError as e:
            return self._missing(target, f"its stack file {target.file} cannot be read: {e.strerror or e}")
        pid = marked_pid(data.decode(errors="replace")) or pid
        size = read + len(data)
        self._marks[target.file] = (size, pid)
        if pid is None:
            return self._missing(target, NO_BOOT)
        why = _why_not(pid, target.session, self._sig)
        if why:
            return self._missing(target, why, pid)
        start = process_start(pid)
        blocking = _threads_blocking(pid, self._sig)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return self._missing(target, f"its Python process (pid {pid}) has exited", pid)
        try:
            if process_start(pid) != start or not start:  # ended, its pid reused: not ours
                raise ProcessLookupError
            signal.pidfd_send_signal(pidfd, self._sig)
        except OSError as e:
            os.close(pidfd)
            if isinstance(e, ProcessLookupError):
                return self._missing(target, f"its Python process (pid {pid}) has exited", pid)
            return self._missing(target, f"process {pid} cannot be signalled: {e.strerror or e}", pid)
        return _Sent(target, pid, pidfd, size, blocking)

    def _collect(self, sent: list[_Sent], results: dict[int, RankStacks], deadline: float, limit: float) -> None:
        pending, pause = list(sent), 0.001
        while pending:
            for s in list(pending):
                done = self._done(s)
                if done is not None:
                    results[s.target.local_rank] = done
                    pending.remove(s)
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        for s in pending:
            results[s.target.local_rank] = self._missing(
                s.target,
                f"process {s.pid} wrote no stacks within {limit:g}s of the signal "
                f"(state {_state(s.pid)}: stopped, or stuck in the kernel)",
                s.pid,
            )

    def _done(self, s: _Sent) -> RankStacks | None:
        """The dump, once complete; None while it is not."""
        try:
            grown = os.stat(s.target.file).st_size > s.offset  # first: see the module's docstring
        except OSError:
            grown = False
        handled = _handled(s.pid, self._sig, s.blocking)
        if handled is False:
            s.quiet_since = None
            return None
        if not grown and handled:
            # Taken, yet nothing written: its handler writes elsewhere (the script
            # registered faulthandler on the signal itself), or it is only about to
            # run (the kernel took the signal off the queue, the handler not yet in).
            now = time.monotonic()
            if s.quiet_since is None or now - s.quiet_since < _QUIET:
                s.quiet_since = s.quiet_since or now
                return None
            return self._missing(
                s.target,
                f"process {s.pid} took the signal but wrote nothing to its stack file "
                "(the script registered its own handler for it?)",
                s.pid,
            )
        try:
            text = _read_from(s.target.file, s.offset).decode(errors="replace")
        except OSError as e:
            return self._missing(s.target, f"its stack file cannot be read: {e.strerror or e}", s.pid)
        threads, more = parse_dump(text)
        if not threads:
            return self._missing(s.target, f"its Python process (pid {s.pid}) exited before it wrote its stacks", s.pid)
        return RankStacks(
            rank=s.target.rank,
            local_rank=s.target.local_rank,
            node_id=self.node_id,
            pid=s.pid,
            threads=threads,
            more_threads=more,
        )


def _read_from(path: Path, offset: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.lseek(fd, offset, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


# --- kept in the run folder ----------------------------------------------------------


def keep(path: Path, reason: str, lines: Sequence[str]) -> None:
    """Write one capture's text to `path`, a new file in the run folder (0600, never through a link)."""
    stamp = datetime.now().astimezone().isoformat(timespec="milliseconds")
    with os.fdopen(create_new(path, "stacks file"), "w") as f:
        f.write(f"captured {stamp}: {reason}\n\n" + "\n".join(lines) + "\n")
