"""Find and kill every process of a worker's session, however deep its tree.

Each worker starts a new session, so its session id is its own pid, and everything it
spawns stays in that session unless it calls setsid() itself: grandchildren, shell
pipelines, a daemon that double-forked or moved to a process group of its own. A
process group would miss the last two, and parenthood is lost the moment a process is
orphaned; the session id (field 6 of /proc/PID/stat) is neither. Unprivileged and on
any Linux, unlike a cgroup (`cgroup.kill`), which needs a delegated, writable cgroup
that containers and plain hosts rarely give.

A session id is a pid, and pids are reused: the kernel frees the number only once no
process has it as pid, process group or session, so a live member of session S means S
is still the session it was, but once the session is empty a new process may take the
number and lead a new, unrelated session S. `Session` therefore remembers its leader's
start time: where a process with the leader's pid runs with another start time, the
session is not ours any more. Each process is signalled through a pidfd opened and then
checked against what the scan saw, so a pid reused between the scan and the signal is
never hit either.
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

#: how long to wait for SIGKILLed processes to end before giving up on them (a process
#: stuck in the kernel, e.g. in a GPU driver, ends only when the kernel lets it)
KILL_LIMIT = 10.0


@dataclass(frozen=True, slots=True)
class Session:
    """One worker's session: its id (the worker's pid) and its leader's start time."""

    sid: int
    #: the leader's start time in clock ticks after boot (/proc/PID/stat field 22);
    #: None when the leader had already ended when it was read
    leader_start: int | None

    @classmethod
    def of_leader(cls, pid: int) -> Session:
        """The session led by process `pid`, just started with a new session."""
        stat = _stat(pid)
        return cls(pid, stat.start if stat is not None and stat.sid == pid else None)


@dataclass(frozen=True, slots=True)
class _Stat:
    """What one process's /proc/PID/stat says that matters here."""

    pid: int
    #: neither a zombie nor dead: signalling it can still change something
    live: bool
    sid: int
    start: int


def _stat(pid: int) -> _Stat | None:
    """Process `pid`'s stat, or None when it is gone."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    # The command name (field 2) is in parentheses and may hold spaces and parentheses.
    fields = raw[raw.rindex(b")") + 2 :].split()
    return _Stat(pid, fields[0] not in (b"Z", b"X"), int(fields[3]), int(fields[19]))


def _members(sessions: Iterable[Session]) -> list[_Stat]:
    """The live processes of `sessions`, skipping a session whose id was reused."""
    stats = [s for s in map(_stat, _pids()) if s is not None]
    by_pid = {s.pid: s for s in stats}
    ours = set()
    for session in sessions:
        leader = by_pid.get(session.sid)
        if leader is None or leader.start == session.leader_start:
            ours.add(session.sid)
    return [s for s in stats if s.live and s.sid in ours]


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _signal_members(sessions: Iterable[Session], sig: signal.Signals) -> list[int]:
    """Send `sig` to every live process of `sessions`; return pidfds of those it reached.

    The caller closes them.
    """
    pidfds = []
    for member in _members(sessions):
        try:
            pidfd = os.pidfd_open(member.pid)
        except ProcessLookupError:
            continue
        now = _stat(member.pid)
        if now is not None and now.start == member.start:  # not ended, pid not reused
            try:
                signal.pidfd_send_signal(pidfd, sig)
            except ProcessLookupError:
                pass
            else:
                pidfds.append(pidfd)
                continue
        os.close(pidfd)
    return pidfds


def signal_sessions(sessions: Iterable[Session], sig: signal.Signals) -> None:
    """Send `sig` to every live process of `sessions` (no wait)."""
    for pidfd in _signal_members(sessions, sig):
        os.close(pidfd)


def kill_sessions(sessions: Iterable[Session], limit: float) -> list[int]:
    """SIGKILL every process of `sessions` until none is left; blocks, for `limit` s at most.

    Scans again after each round of kills has ended, since a process may have forked
    while the scan ran. Returns the pids still alive at the limit (a process stuck in
    the kernel, e.g. in a GPU driver); none when all are gone.
    """
    sessions = list(sessions)
    deadline = time.monotonic() + limit
    while True:
        pidfds = _signal_members(sessions, signal.SIGKILL)
        if not pidfds:
            return []
        try:
            if not _wait_ended(pidfds, deadline):
                return [s.pid for s in _members(sessions)]
        finally:
            for pidfd in pidfds:
                os.close(pidfd)


def _wait_ended(pidfds: list[int], deadline: float) -> bool:
    """Wait until every process behind `pidfds` has ended; False at the deadline."""
    poller = select.poll()
    for pidfd in pidfds:
        poller.register(pidfd, select.POLLIN)
    pending = set(pidfds)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        for pidfd, _ in poller.poll(left * 1000):
            pending.discard(pidfd)
            poller.unregister(pidfd)
    return True
