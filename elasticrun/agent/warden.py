"""The warden: one small process per agent that kills what is left of the workers'
sessions once the agent has ended, however it ended (SIGKILL included).

Each worker dies with its agent by itself (PR_SET_PDEATHSIG, see processes.py), but
what it spawned does not: a grandchild `sleep`, a shell pipeline, a data-preparation
subprocess, a daemon that double-forked would live on, orphaned, holding GPU memory
for the next job. The agent tells the warden each worker's session (see sessions.py)
as it starts it, one line on the warden's stdin; when that pipe reaches its end, the
agent is gone, and the warden SIGKILLs every process of the sessions it was told
about (and not told to release), scanning again until none is left, then exits.

Why the end of a pipe and not PR_SET_PDEATHSIG: the kernel closes a dying process's
files whatever kills it, before it even tells the parent, and only the agent holds the
pipe's write end (it is close-on-exec, and every child of the agent is started with
its other files closed), so the end of the pipe is the agent's end. PR_SET_PDEATHSIG
would add nothing but its races (a parent that died before the request; a signal sent
when the creating *thread* ends). The warden runs in a session of its own, so a Ctrl-C
at the terminal or a signal to the agent's process group does not reach it, and
otherwise keeps the default dispositions: killing the warden loses its protection, but
never kills a worker.

Why one warden per agent, rather than a cgroup (`cgroup.kill`) or a subreaper parent
per worker: a writable cgroup is rarely delegated to a job (containers, plain hosts),
and a parent per worker would add a process per worker and change the worker's pid
and parent, which the agent waits on and reports. One warden costs one small process
per agent, started once, off the path of starting workers.

What it cannot see: a process that leaves the session (setsid(), as a true daemon
does) is no longer part of the worker's tree; and a worker the agent was still
forking when it died, before `setpriv` made the death-signal request, is one the
warden was never told about.

Run as `python -m elasticrun.agent.warden`; the agent's side is
`elasticrun.agent.processes.Warden`.
"""

from __future__ import annotations

import sys

from elasticrun.agent.sessions import KILL_LIMIT, Session, kill_sessions


def watch_line(session: Session) -> bytes:
    """The line that tells the warden about a worker's session."""
    start = "-" if session.leader_start is None else str(session.leader_start)
    return f"watch {session.sid} {start}\n".encode()


def release_line(session: Session) -> bytes:
    """The line that tells the warden a session is empty (the agent killed it itself)."""
    return f"release {session.sid}\n".encode()


def main() -> None:
    """Read the agent's lines until its end, then kill what is left of the sessions."""
    watched: dict[int, Session] = {}
    for line in sys.stdin.buffer:
        verb, sid, *rest = line.decode().split()
        if verb == "watch":
            start = None if rest[0] == "-" else int(rest[0])
            watched[int(sid)] = Session(int(sid), start)
        else:
            watched.pop(int(sid), None)
    left = kill_sessions(watched.values(), KILL_LIMIT)
    if left:
        print(
            f"elasticrun warden: processes {left} of the dead agent's workers are still "
            f"alive {KILL_LIMIT:g}s after SIGKILL",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
