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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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
        """`sessions()` is the pids of the running workers: a timer's pid is signalled
        only when its session is one of theirs."""
        self.path = path
        self._sessions = sessions
        #: pid -> the timer that had it signalled, for the failure report's reason
        self.reaped: dict[int, Timer] = {}
        self._timers: dict[tuple[int, str], Timer] = {}
        self._fd: int | None = None
        self._partial = b""
        self._alarm: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self.path.unlink(missing_ok=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(self.path, 0o600)
        self._fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)
        asyncio.get_running_loop().add_reader(self._fd, self._read)
        logger.info("file timer: serving %s", self.path)

    def close(self) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
        if self._fd is not None:
            asyncio.get_running_loop().remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None
        self.path.unlink(missing_ok=True)

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
