"""torchrun's file timer (TORCHELASTIC_ENABLE_FILE_TIMER=1), served without torch.

A worker that uses `torch.distributed.elastic.timer.FileTimerClient` (through
`timer.configure(...)` and `with timer.expires(after=...)`) writes one JSON line per
request into a FIFO, TORCHELASTIC_TIMER_FILE: `{"version": 1, "pid", "scope_id",
"expiration_time", "signal"}`, acquiring a timer for (pid, scope) until the wall-clock
`expiration_time`, or releasing it with a negative one. When a timer expires, the
worker is sent the timer's signal (SIGKILL by FileTimerClient's default; none when it
is 0), as torchrun's FileTimerServer does; the agent then sees a failed worker and
restarts the group within --max-restarts. Two differences on purpose: only this
agent's workers (and processes of their sessions) are ever signalled, whatever pid a
request names; and the agent does not SIGKILL itself afterwards, as torchrun's server
does, since a node that stays in an elastic job keeps training.

The FIFO is opened read-write, so the agent never sees an end of file when the last
writer closes it, and read when the event loop says there is data: nothing polls.

The agent makes the FIFO itself, and removes only that FIFO. torchrun's server removes
whatever is at TORCHELASTIC_TIMER_FILE, at start and at exit (so a mistaken
`TORCHELASTIC_TIMER_FILE=/dev/null` deletes the machine's /dev/null); here a path where
something exists already, a file, a device, a link, a folder or a FIFO the agent did not
make, is refused at start with one line, and at exit the path is removed only while it
is still the FIFO the agent made (same device and inode).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elasticrun.errors import UsageError

logger = logging.getLogger("elasticrun.agent")

#: the workers' variable that names the FIFO (torch's TORCHELASTIC_TIMER_FILE)
TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"


@dataclass(frozen=True)
class Timer:
    pid: int
    scope: str
    expires_at: float
    signal: int

    def signal_name(self) -> str:
        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"


def _what_is_at(path: Path) -> str:
    """What kind of thing is at `path`, in words (nothing is followed)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "something"
    kinds = (
        (stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISREG, "a regular file"),
        (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "something")


def _open_fifo(path: Path) -> tuple[int, os.stat_result] | None:
    """Open the FIFO at `path`, never through a link.

    None when no FIFO is there (the one just made was replaced)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    made = os.fstat(fd)
    if stat.S_ISFIFO(made.st_mode):
        return fd, made
    os.close(fd)
    return None


def _remove_if(path: Path, made: os.stat_result) -> None:
    """Remove `path` if it is still the FIFO `made` describes; leave anything else."""
    try:
        now = os.lstat(path)
    except OSError:
        return
    if stat.S_ISFIFO(now.st_mode) and (now.st_dev, now.st_ino) == (made.st_dev, made.st_ino):
        path.unlink(missing_ok=True)


def parse_request(line: bytes) -> Timer | None:
    """One request line, or None when it is not one (logged, then ignored)."""
    try:
        body = json.loads(line)
        return Timer(int(body["pid"]), str(body["scope_id"]), float(body["expiration_time"]), int(body["signal"]))
    except (ValueError, KeyError, TypeError) as e:
        logger.warning("file timer: ignoring a malformed request %r: %s", line[:200], e)
        return None


class FileTimerServer:
    """The timers of this node's workers, fed through the FIFO at `path`."""

    def __init__(self, path: Path, sessions: Callable[[], tuple[int, ...]]) -> None:
        """`sessions()` is the pids of the running workers.

        A timer's pid is signalled only when its session is one of theirs."""
        self.path = path
        self._sessions = sessions
        #: pid -> the timer that had it signalled, for the failure report's reason
        self.reaped: dict[int, Timer] = {}
        self._timers: dict[tuple[int, str], Timer] = {}
        self._fd: int | None = None
        #: the FIFO as made (device and inode): the only thing ever removed at `path`
        self._made: os.stat_result | None = None
        self._partial = b""
        self._alarm: asyncio.TimerHandle | None = None

    def start(self) -> os.stat_result:
        """Make the FIFO and serve it; returns what was made (for the agent's warden).

        Raises UsageError when something is at `path` already, or it cannot be made.
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            os.mkfifo(self.path, 0o600)  # EEXIST for anything there, a dangling link included
        except FileExistsError:
            raise UsageError(
                f"{TIMER_FILE_ENV}={self.path}: {_what_is_at(self.path)} is there already; the file timer "
                "makes its own FIFO and removes it at exit, so it never takes a path that exists "
                f"(name a new path in {TIMER_FILE_ENV}, or remove that one if it is a FIFO a killed agent left)"
            ) from None
        except OSError as e:
            raise UsageError(f"{TIMER_FILE_ENV}={self.path}: cannot make the FIFO there: {e.strerror}") from e
        opened = _open_fifo(self.path)
        if opened is None:
            raise UsageError(
                f"{TIMER_FILE_ENV}={self.path}: the FIFO made there was replaced at once (another user "
                "may write in that folder: name a path in a folder of your own)"
            )
        self._fd, made = opened
        self._made = made
        asyncio.get_running_loop().add_reader(self._fd, self._read)
        logger.info("file timer: serving %s", self.path)
        return made

    def close(self) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
        if self._fd is not None:
            asyncio.get_running_loop().remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None
        if self._made is not None:
            _remove_if(self.path, self._made)
            self._made = None

    def _read(self) -> None:
        assert self._fd is not None
        try:
            data = os.read(self._fd, 65536)
        except BlockingIOError:
            return
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in filter(None, lines):
            timer = parse_request(line)
            if timer is None:
                continue
            if timer.expires_at < 0:
                self._timers.pop((timer.pid, timer.scope), None)
            else:
                self._timers[(timer.pid, timer.scope)] = timer
        self._arm()

    def _arm(self) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
            self._alarm = None
        if self._timers:
            earliest = min(t.expires_at for t in self._timers.values())
            self._alarm = asyncio.get_running_loop().call_later(max(0.0, earliest - time.time()), self._expire)

    def _expire(self) -> None:
        self._alarm = None
        now = time.time()
        expired: dict[int, list[Timer]] = {}
        for timer in self._timers.values():
            if timer.expires_at <= now:
                expired.setdefault(timer.pid, []).append(timer)
        for timers in expired.values():
            signalled = next((t for t in sorted(timers, key=lambda t: t.expires_at) if t.signal > 0), None)
            if signalled is not None:
                self._reap(signalled)
            for timer in timers:
                self._timers.pop((timer.pid, timer.scope), None)
        self._arm()

    def _reap(self, timer: Timer) -> None:
        try:
            session = os.getsid(timer.pid)
        except ProcessLookupError:
            return  # gone already
        if session not in self._sessions():
            logger.warning(
                "file timer %r of pid %d expired, but that process is none of this agent's workers: left alone",
                timer.scope, timer.pid,
            )
            return
        logger.warning(
            "file timer %r of worker pid %d expired: sending it %s", timer.scope, timer.pid, timer.signal_name()
        )
        self.reaped[timer.pid] = timer
        with contextlib.suppress(ProcessLookupError):
            os.kill(timer.pid, timer.signal)
