"""Start, watch and stop one node's worker processes, and whatever they spawn.

Each worker leads a new session, so a Ctrl-C at the terminal reaches only the agent,
which decides. Everything a worker spawns stays findable (elasticrun.agent.sessions):
by its session, by the agent's mark in its environment (`ELASTICRUN_TREE`, inherited
whatever session it moves to, setsid() and double forks included), or as the child of
a process that is found. A stop signals all of it and SIGKILLs it until nothing is
left, and so does the agent's `Warden` when the agent dies, however it dies. Each
worker also asks the kernel to SIGKILL it when the agent dies (PR_SET_PDEATHSIG), so a
worker goes at once, not only when the warden gets to it. The request is made by
util-linux's `setpriv --pdeathsig` right before it execs the worker, so no Python runs
in the child between fork and exec: the agent has threads (gRPC's), and Python code in
a forked child of a threaded process can deadlock or abort. Only where `setpriv` is
missing does a `preexec_fn` make the request instead.

Exits are awaited, never polled, and `stop()` never returns before every worker is
reaped and nothing it started is left, even when it is cancelled.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import secrets
import shutil
import signal
import sys
import time
from asyncio.subprocess import PIPE
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from elasticrun.agent import warden
from elasticrun.agent.cgroups import Cgroup
from elasticrun.agent.numa import cpu_list
from elasticrun.agent.sessions import (
    KILL_LIMIT,
    MARK_VAR,
    Mark,
    Session,
    kill_sessions,
    member_pids,
    process_start,
    signal_sessions,
)
from elasticrun.errors import WorkerStartError
from elasticrun.first_of import first_of

logger = logging.getLogger("elasticrun.agent")

_PR_SET_PDEATHSIG = 1
_SETPRIV = shutil.which("setpriv")
# Resolved in the agent, before any fork: the child must not load or look up symbols
# between fork and exec.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent(parent_pid: int) -> None:
    """Runs in the child between fork and exec: tie its life to the agent's."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        # The agent died before prctl took effect: nobody would kill us later.
        os._exit(1)


@dataclass(frozen=True, slots=True)
class WorkerExit:
    """How and when one worker process ended."""

    local_rank: int
    pid: int
    #: the exit status; negative: killed by that signal number
    returncode: int
    #: wall-clock time the agent saw the exit (seconds since the epoch)
    time: float
    #: whether it ended after the agent began stopping the group (not a failure)
    stopped: bool

    @property
    def failed(self) -> bool:
        """A worker that ended on its own with a non-zero status."""
        return self.returncode != 0 and not self.stopped


class _ExitProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """Reports the exit the moment the process ends.

    `Process.wait()` also waits for the stdout and stderr pipes to close, which never
    happens while a process the worker left behind still holds them.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=2**16, loop=loop)
        self.exited: asyncio.Future[int] = loop.create_future()

    def process_exited(self) -> None:
        # read it before the base class drops it; typeshed leaves asyncio's private attribute out
        transport = self._transport  # type: ignore[attr-defined]  # SubprocessStreamProtocol's own
        if transport is not None:
            returncode = transport.get_returncode()
            if returncode is not None:
                self.exited.set_result(returncode)
        super().process_exited()


class Warden:
    """The agent's side of its warden process (elasticrun.agent.warden).

    Started once per agent, before its first workers, and closed when the agent ends;
    should the agent die instead, the warden removes the files it was told about and
    kills the sessions it was told about and every process with its mark.
    """

    def __init__(self, proc: asyncio.subprocess.Process, mark: Mark) -> None:
        self._proc = proc
        #: what each worker's environment carries, so that the warden finds its descendants
        self.mark = mark
        #: the sessions of the agent's standby workers (elasticrun.agent.standby): they
        #: carry the mark too, but a group's stop is not theirs
        self.standing_by: set[Session] = set()
        self._lost = False

    @classmethod
    async def start(cls, withheld_env: Collection[str] = ()) -> Warden:
        """Start the warden, with the agent's environment less `withheld_env` (its secrets)."""
        value = secrets.token_hex(16)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            warden.__name__,
            value,
            stdin=PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            env={key: v for key, v in os.environ.items() if key not in withheld_env},
            start_new_session=True,
        )
        # Every worker starts after the warden: an older process is none of theirs.
        return cls(proc, Mark(value, born_after=process_start(proc.pid)))

    def watch(self, session: Session) -> None:
        """Have the warden kill `session` if the agent dies."""
        self._send(warden.watch_line(session))

    def release(self, session: Session) -> None:
        """`session` is empty: the warden may forget it."""
        self._send(warden.release_line(session))

    def contain(self, cgroup: Cgroup) -> None:
        """Have the warden kill everything in `cgroup`, and remove it, if the agent dies."""
        self._send(warden.cgroup_line(cgroup))

    def release_cgroup(self, cgroup: Cgroup) -> None:
        """`cgroup` is gone: the warden may forget it."""
        self._send(warden.cgroup_line(cgroup, gone=True))

    def remove_on_death(self, path: Path, made: os.stat_result) -> None:
        """Have the warden remove `path`, the file `made` describes, if the agent dies.

        A folder is removed only if it is empty by then (name what is in it first)."""
        self._send(warden.remove_line(path, made))

    def _send(self, line: bytes) -> None:
        assert self._proc.stdin is not None  # started with stdin=PIPE
        if self._proc.returncode is None:
            self._proc.stdin.write(line)
        elif not self._lost:  # killed by someone: the workers still die with the agent
            self._lost = True
            logger.warning(
                "the agent's warden (pid %d) ended with exit code %d: should the agent be "
                "killed, what its workers spawned may outlive it, and its files stay",
                self._proc.pid,
                self._proc.returncode,
            )

    async def close(self) -> None:
        """The agent ends: the warden kills what is left of the sessions, and exits."""
        assert self._proc.stdin is not None  # started with stdin=PIPE
        self._proc.stdin.close()
        await self._proc.wait()


class WorkerGroup:
    """This node's worker processes for one attempt."""

    def __init__(
        self,
        procs: Mapping[int, asyncio.subprocess.Process],
        exited: Mapping[int, asyncio.Future[int]],
        sessions: Mapping[int, Session],
        warden: Warden,
        cgroup: Cgroup | None = None,
        standby: bool = False,
    ) -> None:
        self.procs = dict(procs)
        #: a standby's group (elasticrun.agent.standby): its stop reaches its sessions and
        #: cgroup only, not every process with the agent's mark (the round's workers
        #: and what they spawned carry it too); a standby spawns nothing
        self._mark = None if standby else warden.mark
        self._exited = dict(exited)
        #: each worker's session, as told to the warden
        self.sessions = dict(sessions)
        #: the group's cgroup, where one could be made (elasticrun.agent.cgroups)
        self.cgroup = cgroup
        self.exits: dict[int, WorkerExit] = {}
        self._warden = warden
        self._stopping = False
        self._watchers = {
            local_rank: asyncio.create_task(self._watch(local_rank, exited[local_rank]))
            for local_rank in self.procs
        }

    @classmethod
    async def start(
        cls,
        argv: Sequence[str],
        envs: Mapping[int, Mapping[str, str]],
        warden: Warden,
        stdio: Mapping[int, tuple[int, int]] | None = None,
        cpus: Mapping[int, frozenset[int]] | None = None,
        *,
        standby: bool = False,
    ) -> WorkerGroup:
        """Start one process per local rank in `envs`, each told to `warden` at once.

        `stdio` gives a local rank's (stdout, stderr): an open file descriptor (its log
        file, see elasticrun.agent.output.worker_stdio) or asyncio.subprocess.PIPE;
        ranks it leaves out get two pipes. `cpus` binds a local rank to those CPUs (under
        `taskset`, before its first instruction). `standby`: the group is a standby's.
        Raises WorkerStartError when the command cannot be executed at all; workers
        already started are stopped first.
        """
        procs: dict[int, asyncio.subprocess.Process] = {}
        exits: dict[int, asyncio.Future[int]] = {}
        sessions: dict[int, Session] = {}
        loop = asyncio.get_running_loop()
        agent_pid = os.getpid()
        cgroup = None
        try:
            if shutil.which(argv[0]) is None:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv[0])
            if _SETPRIV is not None:
                prefix, preexec = [_SETPRIV, "--pdeathsig", "KILL", "--"], None
            else:
                prefix, preexec = [], lambda: _die_with_parent(agent_pid)
            cgroup = Cgroup.make(f"elasticrun-{agent_pid}-{secrets.token_hex(4)}")
            if cgroup is not None:
                warden.contain(cgroup)
                prefix = [*cgroup.join_prefix(), *prefix]
            for local_rank, env in envs.items():
                bound = (cpus or {}).get(local_rank)
                binding = ["taskset", "--cpu-list", cpu_list(bound)] if bound else []
                command = [*prefix, *binding, *argv]
                stdout, stderr = (stdio or {}).get(local_rank, (PIPE, PIPE))
                protocol: _ExitProtocol
                transport, protocol = await loop.subprocess_exec(
                    lambda: _ExitProtocol(loop),
                    *command,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=stdout,
                    stderr=stderr,
                    env={**env, MARK_VAR: warden.mark.value},
                    start_new_session=True,
                    preexec_fn=preexec,
                )
                procs[local_rank] = asyncio.subprocess.Process(transport, protocol, loop)
                exits[local_rank] = protocol.exited
                sessions[local_rank] = Session.of_leader(procs[local_rank].pid)
                warden.watch(sessions[local_rank])
        except OSError as e:
            await cls(procs, exits, sessions, warden, cgroup, standby).stop(signal.SIGKILL, grace=0)
            reason = e.strerror or str(e)
            if e.errno in (errno.ENOENT, errno.EACCES):
                reason = f"{reason} (check the script path and --no-python)"
            raise WorkerStartError(f"cannot start worker '{argv[0]}': {reason}") from e
        return cls(procs, exits, sessions, warden, cgroup, standby)

    @classmethod
    def adopt(cls, parts: Sequence[WorkerGroup], warden: Warden) -> WorkerGroup | None:
        """One group of the workers of `parts` (standbys that become a round's workers).

        Its workers are moved into a new cgroup of the group's own, where cgroups are
        made, as a cold group's workers join one; the parts' cgroups go. None, and
        nothing moved for good, when a worker cannot be moved: start cold instead.
        """
        cgroup = Cgroup.make(f"elasticrun-{os.getpid()}-{secrets.token_hex(4)}") if parts[0].cgroup else None
        if cgroup is not None:
            warden.contain(cgroup)
            if not all(cgroup.adopt(proc.pid) for part in parts for proc in part.procs.values()):
                if cgroup.remove(KILL_LIMIT):  # kills what moved; the caller stops the parts
                    warden.release_cgroup(cgroup)
                return None
        procs, exited, sessions = {}, {}, {}
        for part in parts:
            for watcher in part._watchers.values():
                watcher.cancel()
            procs.update(part.procs)
            exited.update(part._exited)
            sessions.update(part.sessions)
            if part.cgroup is not None and part.cgroup.remove(KILL_LIMIT):
                warden.release_cgroup(part.cgroup)
        return cls(procs, exited, sessions, warden, cgroup)

    async def _watch(self, local_rank: int, exited: asyncio.Future[int]) -> None:
        returncode = await asyncio.shield(exited)  # a watcher cancelled by adopt() leaves the exit to the next
        self.exits[local_rank] = WorkerExit(
            local_rank=local_rank,
            pid=self.procs[local_rank].pid,
            returncode=returncode,
            time=time.time(),
            stopped=self._stopping,
        )

    def tree(self) -> set[int]:
        """The workers' pids and those of every live process they started: what may hold their GPU memory.

        Scans /proc."""
        return {proc.pid for proc in self.procs.values()} | member_pids(
            self.sessions.values(), self._mark, self._spare()
        )

    async def wait(self) -> list[WorkerExit]:
        """Wait until a worker fails or every worker has exited; return the exits so far.

        Failed workers come first, earliest first: the first is the root cause.
        """
        pending = set(self._watchers.values())
        while pending:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(e.failed for e in self.exits.values()):
                break
        return sorted(self.exits.values(), key=lambda e: (not e.failed, e.time))

    async def stop(
        self, sig: signal.Signals = signal.SIGTERM, *, grace: float, hurry: asyncio.Event | None = None
    ) -> None:
        """Send `sig` to every worker's session, SIGKILL them after `grace` s, reap.

        The SIGKILL comes sooner as soon as `hurry` is set (a second Ctrl-C).

        What exited workers left behind in their sessions is killed too: stop() returns
        once every worker is reaped and nothing of their sessions is left. Runs to the
        end even when cancelled, then re-raises the cancellation.
        """
        self._stopping = True
        watchers = list(self._watchers.values())
        cancelled = False
        started = time.monotonic()
        if any(not w.done() for w in watchers):
            reached = signal_sessions(self.sessions.values(), sig, self._mark, self._spare())
            if self.cgroup is not None:  # what left the sessions and dropped the mark too
                self.cgroup.signal(sig, skip=reached)
            try:
                # asyncio.wait never cancels the watchers it waits on; first_of cancels the wait
                await first_of(asyncio.wait(watchers, timeout=grace), *([hurry.wait()] if hurry else []))
            except asyncio.CancelledError:
                cancelled = True
        left = [r for r, w in self._watchers.items() if not w.done()]
        if left:
            logger.warning(
                "workers (local ranks %s) still running %.0f s after %s: sending SIGKILL",
                left,
                time.monotonic() - started,
                sig.name,
            )
        ending = asyncio.ensure_future(self._end(watchers))
        while not ending.done():
            try:
                await asyncio.shield(ending)
            except asyncio.CancelledError:
                cancelled = True
        ending.result()
        if cancelled:
            raise asyncio.CancelledError

    def _spare(self) -> set[Session]:
        """The agent's standbys that are not of this group: its stop leaves them be."""
        return self._warden.standing_by - set(self.sessions.values())

    async def _end(self, watchers: list[asyncio.Task[None]]) -> None:
        """SIGKILL the sessions until they are empty, reap the workers, release them."""
        # In a thread: scanning /proc and waiting for the ends would hold the loop.
        if self.cgroup is not None:
            self.cgroup.kill()
        stuck = await asyncio.to_thread(
            kill_sessions, self.sessions.values(), KILL_LIMIT, self._mark, self._spare()
        )
        if self.cgroup is not None and await asyncio.to_thread(self.cgroup.remove, KILL_LIMIT):
            self._warden.release_cgroup(self.cgroup)
        await asyncio.gather(*watchers)
        if stuck:  # the warden keeps them, to try again when the agent ends
            logger.warning(
                "processes %s of the workers' sessions still alive %.0f s after SIGKILL",
                stuck,
                KILL_LIMIT,
            )
            return
        for session in self.sessions.values():
            self._warden.release(session)
