"""Standby workers: one per local rank, started ahead of the next round (warm restarts).

A restart costs a fresh interpreter and the script's imports (`import torch`: seconds on
a GPU host) on top of the rendezvous. A standby pays them ahead: it is the worker's own
command, spawned as every worker is (elasticrun.agent.processes: its session, cgroup,
`setpriv --pdeathsig`, `taskset`, the warden's mark and watch) with the local rank's
constant environment (elasticrun.agent.env.constant_env) and `ELASTICRUN_STANDBY`
naming this agent's private Unix socket. The worker boot (elasticrun/worker/boot)
imports `--warm-imports` there, before Python opens the script, says it is ready, and
waits. At a round's start `take()` sends each standby its worker's complete
environment and its stdout and stderr (descriptors over the socket: the log file, or a
pipe made here whose read end the agent keeps); the boot makes them the process's own
and returns, and Python reads the script from disk and runs it as a cold worker would.

All or nothing per node: unless every local rank's standby is ready, they are stopped
and the round starts cold (a group is one cgroup, one start). Standbys for the next
round start once the round's workers made their first step, with their imports at
the lowest CPU priority in a thread of their own, so they never compete with a start;
the thread that becomes the worker keeps a cold worker's priority.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from elasticrun.agent.cpu_use import CpuUse
from elasticrun.agent.processes import Warden, WorkerGroup
from elasticrun.agent.sessions import KILL_LIMIT, MARK_VAR
from elasticrun.agent.spec import WorkerSpec

logger = logging.getLogger("elasticrun.agent")

#: the boot's variables (elasticrun/worker/boot/sitecustomize.py): the agent's socket,
#: the modules to import ahead, the nice value of those imports
STANDBY_ENV = "ELASTICRUN_STANDBY"
WARM_IMPORTS_ENV = "ELASTICRUN_WARM_IMPORTS"
WARM_NICE_ENV = "ELASTICRUN_WARM_NICE"
#: the nice value of a standby's imports while the round's workers run
_NICE = 19
#: the share of a CPU over which a node's standbys import beside its workers
#: (`Standbys.importing`); an idle standby waiting for its round uses none
_IMPORTING_CPU = 0.05
#: how long a ready standby may take to answer the round (a few ms when it is alive)
_ANSWER_LIMIT = 10.0
#: the lines of a standby's own output kept (each cut to _TAIL_CHARS), for the line that says it died
_TAIL_LINES = 5
_TAIL_CHARS = 300
#: interpreter options that leave the boot out (no sitecustomize, or no environment)
_NO_BOOT = frozenset("IES")


class StandbyState(enum.Enum):
    """What `elasticrun status` shows of a node's standbys."""

    #: every local rank's standby waits for the round
    READY = "ready"
    #: some are still importing
    STARTING = "starting"
    #: none (warm starts off, or none started yet)
    OFF = "off"


def cold_reason(entrypoint: tuple[str, ...]) -> str:
    """Why `entrypoint` cannot run warm ("": it can), said once at DEBUG.

    Warm needs Python to run the boot: an interpreter started with `-I`, `-E` or `-S`
    never does, nor does a program that is not Python (the launcher leaves --warm-imports
    off for --no-python, whatever the program)."""
    if entrypoint[0] != sys.executable and not os.path.basename(entrypoint[0]).startswith("python"):
        return f"{entrypoint[0]} is not a Python interpreter"
    for arg in entrypoint[1:]:
        if not arg.startswith("-") or arg in ("-m", "-c", "-"):
            break
        if not arg.startswith("--") and _NO_BOOT & set(arg[1:]):
            return f"the interpreter's option {arg} leaves out the worker boot"
    return ""


@dataclass
class _Standby:
    workers: WorkerGroup
    pid: int
    #: its connection, once it said it is ready
    conn: socket.socket | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=_TAIL_LINES))


@dataclass
class Taken:
    """A round's workers that were standbys, and the pipes of their streams."""

    workers: WorkerGroup
    #: local rank -> (stdout, stderr): the pipe's reader, or None where a log file is the stream
    streams: dict[int, tuple[asyncio.StreamReader | None, asyncio.StreamReader | None]]
    _transports: list[asyncio.BaseTransport]

    def close(self) -> None:
        """Close the pipes' read ends (once their output is drained)."""
        for transport in self._transports:
            transport.close()


class Standbys:
    """This node's standbys, at most one per local rank."""

    def __init__(
        self,
        spec: WorkerSpec,
        warden: Warden,
        env: Callable[[int], dict[str, str]],
        changed: Callable[[], None],
    ) -> None:
        """`env(local_rank)` is the rank's constant environment; `changed()` is called when state() changes."""
        self._spec = spec
        self._warden = warden
        self._env = env
        self._changed = changed
        self._dir = Path(tempfile.mkdtemp(prefix="elasticrun-standby-"))  # 0700: this user's only
        self._path = str(self._dir / "standby.sock")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.setblocking(False)
        self._server.bind(self._path)
        self._server.listen(max(spec.nproc_per_node, 8))
        for made in (self._path, self._dir):  # should the agent be killed
            warden.remove_on_death(Path(made), os.stat(made))
        self._standbys: dict[int, _Standby] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: why warm starts are off for good ("" while they are on)
        self._off = ""
        self._state = StandbyState.OFF
        self._accepting = False
        #: what the standbys used since the last `importing()`
        self._cpu = CpuUse()

    def state(self) -> StandbyState:
        return self._state

    def importing(self) -> bool:
        """Whether the standbys used more than `_IMPORTING_CPU` of a CPU since the last call.

        Their CPU time, not their state: under a CPU quota (a container's limit) a
        standby's imports take from the workers' share whatever its priority, so the
        workers' step times are not their own meanwhile (StepReport.warming); where the
        node's CPUs are busy, a standby at its low priority gets almost none and takes
        nothing, however long it stays `starting`."""
        return self._cpu.share(s.pid for s in self._standbys.values()) > _IMPORTING_CPU

    def start(self) -> None:
        """Start a standby for every local rank that has none (they import at low priority)."""
        if not self._accepting:
            self._accepting = True
            self._supervise(self._accept())
        if not self._off:
            self._supervise(self._spawn([r for r in range(self._spec.nproc_per_node) if r not in self._standbys]))

    async def take(self, envs: Mapping[int, Mapping[str, str]], stdio: Mapping[int, tuple[int, int]]) -> Taken | None:
        """The round's workers made of the standbys, given `envs` and `stdio`; None: start cold.

        `stdio` is elasticrun.agent.output.worker_stdio's: where it says PIPE, a pipe is
        made here. Standbys that are not used are stopped."""
        ranks = range(self._spec.nproc_per_node)
        standbys = self._standbys
        if not standbys:
            return None
        if self._off or any(r not in standbys or standbys[r].conn is None for r in ranks):
            logger.debug("workers start cold: %s", self._off or "a standby is not ready yet")
            await self.discard()
            return None
        self._standbys = {}
        readers: dict[int, tuple[asyncio.StreamReader | None, asyncio.StreamReader | None]] = {}
        transports: list[asyncio.BaseTransport] = []
        adopted: list[WorkerGroup] = []
        try:
            why = await self._hand_over(standbys, envs, stdio, readers, transports, adopted)
        except (OSError, TimeoutError) as e:
            why = f"handing the round to the standbys failed: {e}"
        if not why:
            self._set_state()
            return Taken(adopted[0], readers, transports)
        logger.debug("workers start cold: %s", why)
        for opened in transports:
            opened.close()
        if adopted:  # the standbys are this group's processes now: stopped with it
            for standby in standbys.values():
                if standby.conn is not None:
                    standby.conn.close()
            await adopted[0].stop(signal.SIGKILL, grace=KILL_LIMIT)
        else:
            await self._stop(standbys)
        self._set_state()
        return None

    async def _hand_over(
        self,
        standbys: Mapping[int, _Standby],
        envs: Mapping[int, Mapping[str, str]],
        stdio: Mapping[int, tuple[int, int]],
        readers: dict[int, tuple[asyncio.StreamReader | None, asyncio.StreamReader | None]],
        transports: list[asyncio.BaseTransport],
        adopted: list[WorkerGroup],
    ) -> str:
        """Give every standby its worker's round; "" once they all run it, else why not (none runs it).

        Fills in `readers` and `transports` (the pipes made here) and `adopted` (the
        group the standbys make, once it is made)."""
        loop = asyncio.get_running_loop()
        ranks = sorted(standbys)
        with contextlib.ExitStack() as closing:
            for r in ranks:
                fds: list[int] = []
                pipes: list[asyncio.StreamReader | None] = []
                for fd in stdio[r]:
                    if fd == asyncio.subprocess.PIPE:
                        read, fd = os.pipe()
                        closing.callback(os.close, fd)
                        reader, transport = await _pipe_reader(read)
                        transports.append(transport)
                        pipes.append(reader)
                    else:
                        pipes.append(None)
                    fds.append(fd)
                readers[r] = (pipes[0], pipes[1])
                conn = standbys[r].conn
                assert conn is not None
                socket.send_fds(conn, [b"R"], fds)
                env = {**envs[r], MARK_VAR: self._warden.mark.value}  # as WorkerGroup.start gives it
                await loop.sock_sendall(conn, json.dumps(env).encode() + b"\n")
            async with asyncio.timeout(_ANSWER_LIMIT):
                answers = await asyncio.gather(*(_read_line(standbys[r].conn) for r in ranks))
        for r, answer in zip(ranks, answers, strict=True):
            if answer != "ready":
                why = "it initialised CUDA" if answer == "cuda" else "it did not answer"
                return f"the standby of local rank {r} cannot be used ({why})"
        for r in ranks:  # the round's workers now: their group's stop is theirs
            self._warden.standing_by.difference_update(standbys[r].workers.sessions.values())
        workers = WorkerGroup.adopt([standbys[r].workers for r in ranks], self._warden)
        if workers is None:
            return "a standby cannot move into the round's cgroup"
        adopted.append(workers)
        for r in ranks:
            conn = standbys[r].conn
            assert conn is not None
            await loop.sock_sendall(conn, b"go\n")
            conn.close()
        return ""

    async def discard(self) -> None:
        """Stop every standby (they are of no use, or the agent ends)."""
        standbys, self._standbys = self._standbys, {}
        await self._stop(standbys)
        self._set_state()

    async def close(self) -> None:
        """Stop every standby and the socket; nothing of them is left."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.discard()
        self._server.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _supervise(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("standby workers: %r (workers start cold)", task.exception())
            self._off = self._off or f"{task.exception()!r}"

    async def _stop(self, standbys: Mapping[int, _Standby]) -> None:
        for standby in standbys.values():
            if standby.conn is not None:
                standby.conn.close()
        # SIGKILL: a standby has nothing to save; the grace only bounds the wait for its end
        await asyncio.gather(*(s.workers.stop(signal.SIGKILL, grace=KILL_LIMIT) for s in standbys.values()))
        for standby in standbys.values():
            self._warden.standing_by.difference_update(standby.workers.sessions.values())

    async def _spawn(self, ranks: list[int]) -> None:
        spec = self._spec
        for r in ranks:
            if r in self._standbys:  # started meanwhile (a replacement, an earlier start)
                continue
            env = {
                **self._env(r),
                STANDBY_ENV: self._path,
                WARM_IMPORTS_ENV: ",".join(spec.options.warm_imports),
                WARM_NICE_ENV: str(_NICE),
            }
            pipes = {r: (asyncio.subprocess.PIPE, asyncio.subprocess.PIPE)}
            workers = await WorkerGroup.start(
                spec.entrypoint, {r: env}, self._warden, pipes, spec.cpu_affinity, standby=True
            )
            proc = workers.procs[r]
            standby = self._standbys[r] = _Standby(workers, proc.pid)
            self._warden.standing_by.update(workers.sessions.values())
            for pipe in (proc.stdout, proc.stderr):
                assert pipe is not None  # started with pipes
                self._supervise(_keep_tail(pipe, standby.tail))
            self._supervise(self._watch(r, standby))
        self._set_state()

    async def _watch(self, local_rank: int, standby: _Standby) -> None:
        """A standby that dies before its round is replaced, said once; one that never got ready turns warm off."""
        exits = await standby.workers.wait()
        if self._standbys.get(local_rank) is not standby:
            return  # taken or discarded: not a standby any more
        end = exits[0]
        del self._standbys[local_rank]
        await self._stop({local_rank: standby})
        tail = " | ".join(standby.tail)
        last = f"; its last output: {tail}" if tail else ""
        if standby.conn is None:
            self._off = f"the standby of local rank {local_rank} exited before it was ready"
            logger.warning(
                "the standby of local rank %d (pid %d) exited with code %d before it was ready: workers start cold "
                "from now on (--warm-imports=off says so)%s", local_rank, standby.pid, end.returncode, last,
            )
            await self.discard()
            return
        logger.warning(
            "the standby of local rank %d (pid %d) exited with code %d before its round: starting another%s",
            local_rank, standby.pid, end.returncode, last,
        )
        await self._spawn([local_rank])

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._server)
            self._supervise(self._hello(conn))

    async def _hello(self, conn: socket.socket) -> None:
        """A standby says it is ready (its imports done), or why it cannot be."""
        try:
            hello = json.loads(await _read_line(conn))
            pid, error = int(hello["pid"]), str(hello["error"])
        except (OSError, ValueError, KeyError, TypeError):
            conn.close()
            return
        standby = next((s for s in self._standbys.values() if s.pid == pid), None)
        if standby is None:
            conn.close()
            return
        if error:
            self._off = error
            logger.warning("--warm-imports: %s in the workers' Python: workers start cold", error)
            conn.close()
            await self.discard()
            return
        standby.conn = conn
        self._set_state()

    def _set_state(self) -> None:
        standbys = self._standbys.values()
        if len(self._standbys) == self._spec.nproc_per_node and all(s.conn is not None for s in standbys):
            state = StandbyState.READY
        else:
            state = StandbyState.STARTING if self._standbys else StandbyState.OFF
        if state is not self._state:
            self._state = state
            pids = ", ".join(f"{r}: {s.pid}" for r, s in sorted(self._standbys.items()))
            level = logging.INFO if state is StandbyState.READY else logging.DEBUG  # LOGLEVEL=INFO shows it
            logger.log(level, "standby workers %s (local rank: pid %s)", state.value, pids or "none")
            self._changed()


async def _read_line(conn: socket.socket | None) -> str:
    """One line from a standby (its hello or its answer); "" when it hung up."""
    assert conn is not None
    loop = asyncio.get_running_loop()
    data = b""
    while not data.endswith(b"\n"):
        chunk = await loop.sock_recv(conn, 4096)
        if not chunk:
            return ""
        data += chunk
    return data.decode().strip()


async def _pipe_reader(fd: int) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    """A stream reader on the read end `fd` of a pipe (the agent's end of a worker's stream)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**16, loop=loop)
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader, loop=loop), os.fdopen(fd, "rb", 0)
    )
    return reader, transport


async def _keep_tail(pipe: asyncio.StreamReader, tail: deque[str]) -> None:
    """Read a standby's own output (its imports' warnings) to its end, keeping the last lines.

    What a standby prints before its round is no worker's output: it is said only
    should the standby die."""
    while chunk := await pipe.read(2**16):
        tail.extend(line[:_TAIL_CHARS] for line in chunk.decode(errors="replace").splitlines() if line.strip())
