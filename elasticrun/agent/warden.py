"""The warden: one small process per agent that cleans up once the agent has ended.

However the agent ended (SIGKILL included), it removes the agent's secret files and
kills everything its workers started.

Each worker dies with its agent by itself (PR_SET_PDEATHSIG, see processes.py), but
what it spawned does not: a grandchild `sleep`, a shell pipeline, a data-preparation
subprocess, a daemon that double-forked or called setsid() would live on, orphaned,
holding GPU memory, ports and files for the next job. The agent tells the warden each
worker's session (see sessions.py) as it starts it, and each file it must not leave
behind (the workers' store token, the file timer's FIFO), one line each on the warden's
stdin; the warden is given the agent's mark (sessions.Mark) when it starts. When that
pipe reaches its end, the agent is gone: the warden removes those files (where each is
still the file the agent made), then SIGKILLs every process of the sessions it was told
about (and not told to release) and every process that carries the mark, with their
descendants, scanning again until none is left, then exits.

Why the end of a pipe and not PR_SET_PDEATHSIG: the kernel closes a dying process's
files whatever kills it, before it even tells the parent, and only the agent holds the
pipe's write end (it is close-on-exec, and every child of the agent is started with
its other files closed), so the end of the pipe is the agent's end. PR_SET_PDEATHSIG
would add nothing but its races (a parent that died before the request; a signal sent
when the creating *thread* ends). The warden runs in a session of its own, so a Ctrl-C
at the terminal or a signal to the agent's process group does not reach it, and
otherwise keeps the default dispositions: killing the warden loses its protection, but
never kills a worker. It inherits none of the agent's secrets (the store token's
variable, etcd's password variable): its environment is the agent's without them.

Why one warden per agent, rather than a cgroup alone or a subreaper parent per worker:
a writable cgroup is often not delegated to a job (containers, plain hosts), and a
parent per worker would add a process per worker and change the worker's pid and
parent, which the agent waits on and reports. One warden costs one small process per
agent, started once, off the path of starting workers. The warden is not an ancestor of
the workers, so it would adopt nothing as a subreaper: it finds them by session and
mark instead (sessions.py says why that is enough, and what is not), and where the
agent could give a worker group a cgroup (elasticrun.agent.cgroups), it is told that
too and kills the cgroup first (`cgroup.kill`), which holds even what left the session
and dropped the mark.

What it cannot see: without a cgroup, a process that both left its worker's session and
replaced the environment it inherited (`setsid env -i ...`), once its parent is gone; one that made
itself unreadable to this user (a setuid program, or one that called
prctl(PR_SET_DUMPABLE, 0), which this user could not kill anyway unless root); and a
worker the agent was still forking when it died, before `setpriv` made the death-signal
request, is one the warden was never told about (it carries the mark, though).

Run as `python -m elasticrun.agent.warden MARK`; the agent's side is
`elasticrun.agent.processes.Warden`.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from pathlib import Path

from elasticrun.agent.cgroups import Cgroup
from elasticrun.agent.sessions import KILL_LIMIT, Mark, Session, kill_sessions, process_start


def watch_line(session: Session) -> bytes:
    """The line that tells the warden about a worker's session."""
    start = "-" if session.leader_start is None else str(session.leader_start)
    return f"watch {session.sid} {start}\n".encode()


def release_line(session: Session) -> bytes:
    """The line that tells the warden a session is empty (the agent killed it itself)."""
    return f"release {session.sid}\n".encode()


def cgroup_line(cgroup: Cgroup, *, gone: bool = False) -> bytes:
    """The line that tells the warden about a worker group's cgroup (or that it is gone)."""
    return f"{'uncgroup' if gone else 'cgroup'} {os.fsencode(cgroup.path).hex()}\n".encode()


def remove_line(path: Path, made: os.stat_result) -> bytes:
    """The line that has the warden remove `path` should the agent die.

    Only if it is still the file `made` describes (its device and inode): never another
    file by that name. A folder goes only if it is empty by then: name what is in it first."""
    return f"remove {made.st_dev} {made.st_ino} {os.fsencode(path).hex()}\n".encode()


def _remove(path: bytes, dev: int, ino: int) -> None:
    """Remove the file, or the empty folder (a folder with anything left in it stays)."""
    with contextlib.suppress(OSError):
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) == (dev, ino):
            if stat.S_ISDIR(now.st_mode):
                os.rmdir(path)
            else:
                os.unlink(path)


def main() -> None:
    """Read the agent's lines until its end, then remove its files and kill what is left."""
    mark = Mark(sys.argv[1], born_after=process_start(os.getpid()))
    watched: dict[int, Session] = {}
    files: dict[bytes, tuple[int, int]] = {}
    cgroups: set[bytes] = set()
    for line in sys.stdin.buffer:
        verb, first, *rest = line.decode().split()
        if verb == "watch":
            start = None if rest[0] == "-" else int(rest[0])
            watched[int(first)] = Session(int(first), start)
        elif verb == "release":
            watched.pop(int(first), None)
        elif verb == "cgroup":
            cgroups.add(bytes.fromhex(first))
        elif verb == "uncgroup":
            cgroups.discard(bytes.fromhex(first))
        else:  # remove
            files[bytes.fromhex(rest[1])] = (int(first), int(rest[0]))
    for path, (dev, ino) in files.items():  # the secret first: it goes at once
        _remove(path, dev, ino)
    groups = [Cgroup(Path(os.fsdecode(path))) for path in cgroups]
    for group in groups:  # everything in them at once, whatever it did
        group.kill()
    left = kill_sessions(watched.values(), KILL_LIMIT, mark)
    for group in groups:
        group.remove(KILL_LIMIT)
    if left:
        print(
            f"elasticrun warden: processes {left} of the dead agent's workers are still "
            f"alive {KILL_LIMIT:g}s after SIGKILL",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
