"""A cgroup v2 of its own for each worker group, where the kernel lets the agent make one.

Why: sessions.py finds what the workers started by their session, the agent's mark in
their environment, and parenthood. A process that leaves its worker's session
(`setsid()`), replaces its environment (`env -i`) and whose parent is gone has none of
the three: it outlived its agent. A cgroup is kept across all of that: every
process a member forks is a member, and `cgroup.kill` SIGKILLs all of them at once,
whatever they did. So where a cgroup v2 hierarchy is mounted and the agent may make a
cgroup below its own (root, or a delegated subtree: systemd's `Delegate=yes`, a
container with its own cgroup namespace), each worker group gets one; where not, the
session tracking alone applies, as before, and the agent says so once at DEBUG level.

How a worker joins: its command starts with `/bin/sh -c 'echo 0 >.../cgroup.procs;
exec "$@"'`, so the worker's process moves itself into the cgroup before it execs
anything of its own (no Python between fork and exec, as in processes.py; the pid
stays the worker's). What the group's cgroup does not hold: anything that moved itself
into another cgroup (it needs write access to that one, so root or a delegated tree),
and, where no cgroup could be made, everything sessions.py's docstring lists.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("elasticrun.agent")

#: the filesystem type of the unified hierarchy in /proc/self/mountinfo
_CGROUP2 = "cgroup2"
#: what a worker's command starts with to join its group's cgroup ($0: the cgroup's folder)
_JOIN = 'echo 0 2>/dev/null >"$0/cgroup.procs"; exec "$@"'


@dataclass(frozen=True, slots=True)
class Cgroup:
    """One worker group's cgroup: a folder of the cgroup v2 hierarchy."""

    path: Path

    @classmethod
    def make(cls, name: str) -> Cgroup | None:
        """A new cgroup `name` below the agent's own, or None where none can be made."""
        parent = own_cgroup()
        if parent is None:
            return None
        path = parent / name
        try:
            path.mkdir()
        except FileExistsError:  # one an agent of the same pid left: empty it and reuse it
            Cgroup(path).kill()
        except OSError as e:
            logger.debug("no cgroup for the workers (%s: %s): they are tracked by session and mark", path, e)
            return None
        return cls(path)

    def join_prefix(self) -> list[str]:
        """What a worker's command starts with to join this cgroup before it runs."""
        return ["/bin/sh", "-c", _JOIN, str(self.path)]

    def adopt(self, pid: int) -> bool:
        """Move process `pid` (all its threads) into this cgroup; whether it moved.

        For a standby that becomes a worker (elasticrun.agent.standby): it joins the
        round's cgroup as a cold worker's command does, only later."""
        try:
            (self.path / "cgroup.procs").write_text(str(pid))
            return True
        except OSError as e:
            logger.debug("cannot move process %d into %s: %s", pid, self.path, e)
            return False

    def pids(self) -> list[int]:
        """The processes in it now."""
        try:
            return [int(line) for line in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def signal(self, sig: signal.Signals, *, skip: Collection[int] = ()) -> None:
        """Send `sig` to every process in it now, but those in `skip` (signalled already)."""
        for pid in set(self.pids()) - set(skip):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def kill(self) -> None:
        """SIGKILL everything in it at once (`cgroup.kill`).

        Where the kernel has none (before 5.14), each process it lists."""
        try:
            (self.path / "cgroup.kill").write_text("1")
        except OSError:
            self.signal(signal.SIGKILL)

    def remove(self, timeout: float) -> bool:
        """Kill what is in it, wait up to `timeout` s for it to empty, remove it; whether it is gone."""
        deadline = time.monotonic() + timeout
        while True:
            self.kill()
            try:
                self.path.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError:  # EBUSY: not empty yet (a process ends only once the kernel lets it)
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.01)


def own_cgroup() -> Path | None:
    """The folder of this process's cgroup in the unified (v2) hierarchy, or None.

    None where there is none mounted, or where this process is in none of it."""
    mount = _cgroup2_mount()
    if mount is None:
        return None
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            folder = mount / path.lstrip("/")
            return folder if folder.is_dir() else None
    return None


def _cgroup2_mount() -> Path | None:
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields, _, rest = line.partition(" - ")
        if rest.split(" ", 1)[0] == _CGROUP2:
            return Path(fields.split()[4])
    return None
