"""The host memory each local rank's committed state lives in, owned by the agent.

In restart mode a worker's `State.commit()` copies the state into a file on a tmpfs that
the agent made for its local rank, and a restarted worker reads it back
(elasticrun.worker.elastic.host_copy has the layout). The file belongs to the agent and
the local rank, not to an attempt: it is made the first time a worker of that local rank
starts, handed to every later one by the same path (`ELASTICRUN_STATE_FILE`), and
removed when the agent ends, by the agent, or by its warden should the agent be killed.

The agent makes, sizes and removes the files; what is in them is the worker's, except
that the agent reads a file's newest commit to send it to a buddy node and, at a
round's start, writes into it a commit of its new rank that a buddy held
(elasticrun.agent.state_replicas, through elasticrun.agent.commit_files; never with
torch). A file is sized (`ftruncate`) to `--state-memory` but
takes memory only as a worker writes into it: a worker reserves each part
(`posix_fallocate`) before it writes it, so a full tmpfs is a clear error in the worker.

Where: /dev/shm, the tmpfs every Linux has for this, else the agent's private run
folder. A file's name says which agent made it (its process, by pid, start time and pid
namespace): an agent killed together with its warden (a whole process group, a
cgroup's kill) leaves its files, which would hold their memory until the host restarts,
so each agent removes, when it makes its first, the files of this user's agents of its
pid namespace that are gone (`sweep`). A file there is made new (O_EXCL, never through a link), 0600, under a name with
a random part, so no other user can read a state or plant a file in its place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path

from elasticrun.agent.runfolder import create_new
from elasticrun.agent.sessions import process_start

logger = logging.getLogger("elasticrun.agent")

#: the tmpfs the files go to, when it is there
SHM = Path("/dev/shm")

#: elasticrun-<kind>-<pid>.<start time>.<pid namespace>-<tag>-<rank>
_NAME = re.compile(r"elasticrun-(state|replica)-(\d+)\.(\d+)\.(\d+)-[0-9a-f]+-\d+")


def _process(pid: int) -> tuple[int, int] | None:
    """Process `pid`'s start time (clock ticks after boot) and pid namespace (its inode), or None if none runs."""
    started = process_start(pid)
    try:
        namespace = os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None
    return (started, namespace) if started else None


def sweep(folder: Path) -> int:
    """Remove the files in `folder` of this user's agents of this pid namespace that are gone; how many.

    Only a name made by `StateFiles` is looked at; an agent that runs (same pid and start
    time) keeps its files, and one of another pid namespace (whose pids mean nothing here)
    is left alone."""
    me = _process(os.getpid())
    if me is None:
        return 0
    removed = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            match = _NAME.fullmatch(entry.name)
            if match is None or int(match[4]) != me[1]:
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                    continue
                if _process(int(match[2])) != (int(match[3]), me[1]):
                    os.unlink(entry.path)
                    removed += 1
    if removed:
        logger.info("removed %d state files in %s left by agents that are gone", removed, folder)
    return removed


class StateFiles:
    """One state file per local rank, made on first use and removed at close().

    The same for the replica files that hold a buddy's commits (`kind="replica"`, one
    per global rank; elasticrun.agent.state_replicas)."""

    def __init__(
        self, fallback: Path, size: int, remove_on_death: Callable[[Path, os.stat_result], None], kind: str = "state"
    ) -> None:
        """Files of `size` bytes, in /dev/shm, else in `fallback` (the run folder).

        `remove_on_death(path, stat)` is the warden's (Warden.remove_on_death)."""
        self.size = size
        self._kind = kind
        self._folder = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else fallback
        self._remove_on_death = remove_on_death
        started, namespace = _process(os.getpid()) or (0, 0)
        self._tag = f"{os.getpid()}.{started}.{namespace}-{secrets.token_hex(8)}"
        self._paths: dict[int, Path] = {}
        if self._folder == SHM and kind == "state":  # once per agent (replica files are made beside)
            sweep(SHM)

    def path(self, local_rank: int) -> Path:
        """Local rank `local_rank`'s file: the same across its workers' restarts."""
        path = self._paths.get(local_rank)
        if path is None:
            path = self._folder / f"elasticrun-{self._kind}-{self._tag}-{local_rank}"
            fd = create_new(path, f"{self._kind} file")
            try:
                os.ftruncate(fd, self.size)
                made = os.fstat(fd)
            finally:
                os.close(fd)
            self._remove_on_death(path, made)
            self._paths[local_rank] = path
        return path

    def made(self) -> dict[int, Path]:
        """The files made so far, by local rank."""
        return dict(self._paths)

    def remove(self, local_rank: int) -> None:
        path = self._paths.pop(local_rank, None)
        if path is not None:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        """Remove every file: the agent ends, and the states with it."""
        for path in self._paths.values():
            path.unlink(missing_ok=True)
        self._paths.clear()
