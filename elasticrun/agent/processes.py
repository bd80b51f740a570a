"""Start, watch and stop one node's worker processes.

Each worker leads its own process group (a new session), so a stop reaches whatever it
spawned too, and a Ctrl-C at the terminal reaches only the agent, which decides. Each
worker also asks the kernel to SIGKILL it when the agent dies (PR_SET_PDEATHSIG), so
workers never outlive the agent, not even an agent killed with SIGKILL. The request is
made by util-linux's `setpriv --pdeathsig` right before it execs the worker, so no
Python runs in the child between fork and exec: the agent has threads (gRPC's), and
Python code in a forked child of a threaded process can deadlock or abort. Only where
`setpriv` is missing does a `preexec_fn` make the request instead.

Exits are awaited, never polled, and `stop()` never returns before every worker is
reaped, even when it is cancelled.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import shutil
import signal
import time
from asyncio.subprocess import PIPE
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elasticrun.errors import WorkerStartError

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
    happens while a grandchild (outside the worker's group) still holds them.
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


class WorkerGroup:
    """This node's worker processes for one attempt."""

    def __init__(
        self,
        procs: Mapping[int, asyncio.subprocess.Process],
        exited: Mapping[int, asyncio.Future[int]],
    ) -> None:
        self.procs = dict(procs)
        self.exits: dict[int, WorkerExit] = {}
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
        stdio: Mapping[int, tuple[int, int]] | None = None,
    ) -> WorkerGroup:
        """Start one process per local rank in `envs`.

        `stdio` gives a local rank's (stdout, stderr): an open file descriptor (its log
        file, see elasticrun.agent.output.worker_stdio) or asyncio.subprocess.PIPE;
        ranks it leaves out get two pipes. Raises WorkerStartError when the command
        cannot be executed at all; workers already started are stopped first.
        """
        procs: dict[int, asyncio.subprocess.Process] = {}
        exits: dict[int, asyncio.Future[int]] = {}
        loop = asyncio.get_running_loop()
        agent_pid = os.getpid()
        try:
            if shutil.which(argv[0]) is None:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv[0])
            if _SETPRIV is not None:
                command, preexec = [_SETPRIV, "--pdeathsig", "KILL", "--", *argv], None
            else:
                command, preexec = list(argv), lambda: _die_with_parent(agent_pid)
            for local_rank, env in envs.items():
                stdout, stderr = (stdio or {}).get(local_rank, (PIPE, PIPE))
                protocol: _ExitProtocol
                transport, protocol = await loop.subprocess_exec(
                    lambda: _ExitProtocol(loop),
                    *command,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=stdout,
                    stderr=stderr,
                    env=dict(env),
                    start_new_session=True,
                    preexec_fn=preexec,
                )
                procs[local_rank] = asyncio.subprocess.Process(transport, protocol, loop)
                exits[local_rank] = protocol.exited
        except OSError as e:
            await cls(procs, exits).stop(signal.SIGKILL, grace=0)
            reason = e.strerror or str(e)
            if e.errno in (errno.ENOENT, errno.EACCES):
                reason = f"{reason} (check the script path and --no-python)"
            raise WorkerStartError(f"cannot start worker '{argv[0]}': {reason}") from e
        return cls(procs, exits)

    async def _watch(self, local_rank: int, exited: asyncio.Future[int]) -> None:
        returncode = await exited
        self.exits[local_rank] = WorkerExit(
            local_rank=local_rank,
            pid=self.procs[local_rank].pid,
            returncode=returncode,
            time=time.time(),
            stopped=self._stopping,
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

    async def stop(self, sig: signal.Signals = signal.SIGTERM, *, grace: float) -> None:
        """Send `sig` to every worker's group, SIGKILL after `grace` s, reap them all.

        Also kills what exited workers left behind in their groups. Runs to the end even
        when cancelled, then re-raises the cancellation.
        """
        self._stopping = True
        watchers = list(self._watchers.values())
        if any(not w.done() for w in watchers):
            self._signal_groups(sig)
        cancelled = False
        try:
            if watchers:
                await asyncio.wait(watchers, timeout=grace)
        except asyncio.CancelledError:
            cancelled = True
        left = [r for r, w in self._watchers.items() if not w.done()]
        if left:
            logger.warning(
                "workers (local ranks %s) still running %.0f s after %s: sending SIGKILL",
                left,
                grace,
                sig.name,
            )
        self._signal_groups(signal.SIGKILL)
        reaping = asyncio.gather(*watchers)
        while not reaping.done():
            try:
                await asyncio.shield(reaping)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError

    def _signal_groups(self, sig: signal.Signals) -> None:
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass  # the group is already empty
