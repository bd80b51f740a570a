"""Find and kill every process the workers started, however deep, wherever it went.

Three ways to belong, each catching what the one before misses:

- The worker's session. Each worker starts a new session, so its session id is its own
  pid, and everything it spawns stays in it unless it calls setsid(): grandchildren,
  shell pipelines, a daemon that double-forked or moved to a process group of its own.
  A process group would miss the last two, and parenthood is lost the moment a process
  is orphaned; the session id (field 6 of /proc/PID/stat) is neither.
- The agent's mark: each worker gets `ELASTICRUN_TREE=<random>` in its environment
  (`Mark`), and every process it starts inherits it, whatever session it moves to and
  whoever adopts it once its parent is gone, as long as it keeps the environment it
  was given: a `setsid()` helper, a daemon that double-forked and left the session,
  a data service that `subprocess.Popen(..., start_new_session=True)` started. This is
  how Jenkins' ProcessTreeKiller finds the daemons a build left (its BUILD_ID cookie).
  Only processes younger than the mark are read (a worker's descendant is younger than
  the worker), so the scan reads few environments besides the workers' own.
- Parenthood: a child of a process that belongs, at the moment of the scan. It catches
  a process that left the session *and* replaced its environment while its parent still
  belongs (the worker, say).

Why not a subreaper (PR_SET_CHILD_SUBREAPER) or a cgroup. A subreaper keeps orphans in
its tree only while it lives: the agent as subreaper loses them to init the moment it is
SIGKILLed, which is when they matter, and the warden (elasticrun.agent.warden) is not an
ancestor of the workers, so it never adopts anything of theirs; making it one would
change each worker's parent and how the agent waits on it. A cgroup (`cgroup.kill`)
needs a delegated, writable cgroup, which containers and plain hosts often do not give:
where one can be made, elasticrun.agent.cgroups adds it on top of this. This works
unprivileged, on any Linux, and does not depend on when the agent dies.

Pids are reused. A session id is a pid: the kernel frees the number only once no
process has it as pid, process group or session, so a live member of session S means S
is still the session it was, but once the session is empty a new process may take the
number and lead a new, unrelated session S. `Session` therefore remembers its leader's
start time: where a process with the leader's pid runs with another start time, the
session is not ours any more. Each process is signalled through a pidfd opened and then
checked against what the scan saw, so a pid reused between the scan and the signal is
never hit either.
"""

from __future__ import annotations

import functools
import os
import select
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

from elasticrun.descriptors import exhausted, waiting_for_descriptors

#: how long to wait for SIGKILLed processes to end before giving up on them (a process
#: stuck in the kernel, e.g. in a GPU driver, ends only when the kernel lets it)
KILL_LIMIT = 10.0

#: the environment variable that marks every process of one agent's workers (`Mark`)
MARK_VAR = "ELASTICRUN_TREE"


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
class Mark:
    """One agent's mark, `ELASTICRUN_TREE=<value>` in each of its workers' environments."""

    #: random, one per agent: no other process carries it by chance
    value: str
    #: only processes that started at this time or later (clock ticks after boot) are
    #: read: those that started earlier cannot descend from a worker started after it
    born_after: int

    def entry(self) -> bytes:
        """The environment entry, between the NULs of /proc/PID/environ."""
        return f"\0{MARK_VAR}={self.value}\0".encode()


def process_start(pid: int) -> int:
    """Process `pid`'s start time in clock ticks after boot (0 when it is gone)."""
    stat = _stat(pid)
    return stat.start if stat is not None else 0


def cpu_seconds(pid: int) -> float:
    """The CPU time process `pid` has used, user and system (0 when it is gone)."""
    stat = _stat(pid)
    return stat.cpu_ticks / _TICKS_PER_SECOND if stat is not None else 0.0


@dataclass(frozen=True, slots=True)
class _Stat:
    """What one process's /proc/PID/stat says that matters here."""

    pid: int
    ppid: int
    #: neither a zombie nor dead: signalling it can still change something
    live: bool
    sid: int
    start: int
    #: its user and system CPU time, in clock ticks
    cpu_ticks: int


#: the clock ticks of /proc/PID/stat's times
_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> _Stat | None:
    """Process `pid`'s stat, or None when it is gone."""
    raw = _read(f"/proc/{pid}/stat", 4096)
    if raw is None:
        return None
    # The command name (field 2) is in parentheses and may hold spaces and parentheses.
    fields = raw[raw.rindex(b")") + 2 :].split()
    return _Stat(
        pid, int(fields[1]), fields[0] not in (b"Z", b"X"), int(fields[3]), int(fields[19]),
        int(fields[11]) + int(fields[12]),
    )


def _read(path: str, limit: int) -> bytes | None:
    """The file's first `limit` bytes, or None when it cannot be read.

    It cannot when the process is gone, or its files are not this user's to read. Out
    of descriptors, it raises: that says nothing about the process."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        if exhausted(e):
            raise
        return None
    try:
        chunks = []
        while limit > 0 and (chunk := os.read(fd, min(limit, 65536))):
            chunks.append(chunk)
            limit -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def belongs(pid: int, session: Session) -> bool:
    """Whether live process `pid` is one of `session`'s.

    In it, or descended from one of its processes (a wrapper's child that moved to a
    session of its own).

    A process with the leader's pid counts only with the leader's start time. One
    with the session's id is in it: the kernel gives no new process that number while
    any process is in the session."""
    stat = _stat(pid)
    if stat is None or not stat.live or session.leader_start is None:
        return False
    seen = set()
    while stat is not None and stat.pid not in seen:
        if stat.pid == session.sid:
            return stat.start == session.leader_start
        if stat.sid == session.sid:
            leader = _stat(session.sid)
            return leader is None or leader.start == session.leader_start
        seen.add(stat.pid)
        stat = _stat(stat.ppid) if stat.ppid > 1 else None
    return False


def _carries(pid: int, mark: Mark) -> bool:
    """Whether process `pid`'s environment holds the mark."""
    environ = _read(f"/proc/{pid}/environ", 1 << 22)
    return environ is not None and mark.entry() in b"\0" + environ


def _members(sessions: Iterable[Session], mark: Mark | None = None, spare: Iterable[Session] = ()) -> list[_Stat]:
    """The live processes of `sessions` or with `mark`, and their descendants; none of `spare`.

    A session whose id was reused is skipped. Out of descriptors (a flood of
    connections on the store this agent hosts), the scan waits for some: a scan that
    failed must not read as "nothing left to kill"."""
    sessions, spare = list(sessions), list(spare)
    return waiting_for_descriptors("scanning /proc", lambda: _scan(sessions, mark, spare))


def _scan(sessions: list[Session], mark: Mark | None, spare: list[Session]) -> list[_Stat]:
    stats = [s for s in map(_stat, _pids()) if s is not None]
    by_pid = {s.pid: s for s in stats}

    def live(sessions: list[Session]) -> set[int]:
        ids = set()
        for session in sessions:
            leader = by_pid.get(session.sid)
            if leader is None or leader.start == session.leader_start:
                ids.add(session.sid)
        return ids

    ours, spared = live(sessions), live(spare) - live(sessions)
    found = {
        s.pid
        for s in stats
        if s.sid in ours
        or (
            mark is not None and s.live and s.sid not in spared and s.start >= mark.born_after and _carries(s.pid, mark)
        )
    }
    children: dict[int, list[int]] = {}
    for s in stats:
        children.setdefault(s.ppid, []).append(s.pid)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return [by_pid[pid] for pid in found if by_pid[pid].live]


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _signal_members(
    sessions: Iterable[Session], mark: Mark | None, sig: signal.Signals, spare: Iterable[Session] = ()
) -> dict[int, int]:
    """Send `sig` to every live process of `sessions` and `mark`; return the pidfds of those it reached, by pid.

    The caller closes them.
    """
    pidfds: dict[int, int] = {}
    for member in _members(sessions, mark, spare):
        try:
            pidfd = waiting_for_descriptors("signalling workers", functools.partial(os.pidfd_open, member.pid))
        except ProcessLookupError:
            continue
        now = _stat(member.pid)
        if now is not None and now.start == member.start:  # not ended, pid not reused
            try:
                signal.pidfd_send_signal(pidfd, sig)
            except ProcessLookupError:
                pass
            else:
                pidfds[member.pid] = pidfd
                continue
        os.close(pidfd)
    return pidfds


def member_pids(sessions: Iterable[Session], mark: Mark | None = None, spare: Iterable[Session] = ()) -> set[int]:
    """The pids of every live process of `sessions` and `mark`, but `spare`'s (a scan of /proc)."""
    return {member.pid for member in _members(sessions, mark, spare)}


def signal_sessions(
    sessions: Iterable[Session], sig: signal.Signals, mark: Mark | None = None, spare: Iterable[Session] = ()
) -> set[int]:
    """Send `sig` to every live process of `sessions` and `mark`, but `spare`'s (no wait); return the pids it reached.

    `spare`: sessions that carry the mark but are not the caller's to stop (the agent's
    standby workers, elasticrun.agent.standby).

    A caller that signals others too must not signal these twice: a second SIGTERM runs a
    worker's handler again, in the middle of its first run.
    """
    reached = _signal_members(sessions, mark, sig, spare)
    for pidfd in reached.values():
        os.close(pidfd)
    return set(reached)


def kill_sessions(
    sessions: Iterable[Session], limit: float, mark: Mark | None = None, spare: Iterable[Session] = ()
) -> list[int]:
    """SIGKILL every process of `sessions` and `mark`, but `spare`'s, until none is left; blocks, for `limit` s at most.

    Scans again after each round of kills has ended, since a process may have forked
    while the scan ran. Returns the pids still alive at the limit (a process stuck in
    the kernel, e.g. in a GPU driver); none when all are gone.
    """
    sessions, spare = list(sessions), list(spare)
    deadline = time.monotonic() + limit
    while True:
        pidfds = list(_signal_members(sessions, mark, signal.SIGKILL, spare).values())
        if not pidfds:
            return []
        try:
            if not _wait_ended(pidfds, deadline):
                return [s.pid for s in _members(sessions, mark, spare)]
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
