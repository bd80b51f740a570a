"""Helpers for the agent tests: worker scripts, agents in child processes, exit waits."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
import textwrap
from pathlib import Path
from typing import TypeVar

from elasticrun.agent.spec import WorkerOptions, WorkerSpec
from elasticrun.rendezvous.static import StaticRendezvous

REPO = Path(__file__).resolve().parents[2]

T = TypeVar("T")


def write_script(tmp_path: Path, name: str, code: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return path


def make_spec(script: Path, **kwargs: object) -> WorkerSpec:
    """A spec running `script` with this interpreter, unbuffered, as the launcher does.

    The `WorkerOptions` fields among `kwargs` (stop_grace, log_dir, ...) go into its options."""
    kwargs.setdefault("run_id", "test")
    kwargs.setdefault("nproc_per_node", 1)
    kwargs.setdefault("node_id", "node0")
    options = {f.name: kwargs.pop(f.name) for f in dataclasses.fields(WorkerOptions) if f.name in kwargs}
    options.setdefault("stop_grace", 10.0)
    return WorkerSpec(
        entrypoint=(sys.executable, "-u", str(script)), options=WorkerOptions(**options), **kwargs  # type: ignore[arg-type]
    )


def static_for(spec: WorkerSpec, *, node_rank: int = 0, nnodes: int = 1,
               master_port: int = 29500) -> StaticRendezvous:
    return StaticRendezvous(
        spec.run_id,
        node_rank=node_rank,
        nnodes=nnodes,
        nproc_per_node=spec.nproc_per_node,
        master_addr="127.0.0.1",
        master_port=master_port,
    )


# An agent in its own process, configured by one JSON argument, exiting with the agent's
# exit code: what the launcher will do, minus the flags.
_AGENT_MAIN = """
import asyncio, json, logging, sys
from pathlib import Path
from elasticrun.agent.agent import Agent
from elasticrun.agent.spec import Std, WorkerOptions, WorkerSpec
from elasticrun.rendezvous.static import StaticRendezvous
logging.basicConfig(level=logging.INFO, format="agent: %(message)s")
c = json.loads(sys.argv[1])
spec = WorkerSpec(run_id="test", node_id=f"node{c['node_rank']}",
                  entrypoint=tuple(c["entrypoint"]), nproc_per_node=c["nproc"],
                  max_restarts=c.get("max_restarts", 0),
                  options=WorkerOptions(stop_grace=c.get("stop_grace", 10), log_dir=Path(c["log_dir"])),
                  tee={r: Std(c.get("tee", 0)) for r in range(c["nproc"])})
handler = StaticRendezvous("test", node_rank=c["node_rank"], nnodes=c["nnodes"],
                           nproc_per_node=c["nproc"], master_addr="127.0.0.1",
                           master_port=c["master_port"])
sys.exit(asyncio.run(Agent(spec, handler).run()).exit_code)
"""


async def start_agent_process(
    script: Path,
    log_dir: Path,
    *,
    nproc: int = 1,
    node_rank: int = 0,
    nnodes: int = 1,
    master_port: int = 29500,
    **extra: object,
) -> asyncio.subprocess.Process:
    """Start an agent in a child process; its stdout and stderr are pipes."""
    config = {
        "entrypoint": [sys.executable, "-u", str(script)],
        "nproc": nproc,
        "node_rank": node_rank,
        "nnodes": nnodes,
        "master_port": master_port,
        "log_dir": str(log_dir),
        **extra,
    }
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", _AGENT_MAIN, json.dumps(config),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )


async def read_lines_until(
    stream: asyncio.StreamReader, count: int, marker: str, timeout: float = 60
) -> list[str]:
    """Read lines until `count` of them contain `marker`; return those lines."""
    found: list[str] = []

    async def read() -> None:
        while len(found) < count:
            line = await stream.readline()
            if not line:
                raise AssertionError(f"stream closed with {len(found)}/{count} '{marker}'")
            text = line.decode()
            if marker in text:
                found.append(text.rstrip("\n"))

    await asyncio.wait_for(read(), timeout)
    return found


async def wait_pid_gone(pid: int, timeout: float = 30) -> None:
    """Wait (on a pidfd, without polling) until process `pid` has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
    try:
        await asyncio.wait_for(exited, timeout)
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def kill_and_reap(proc: asyncio.subprocess.Process) -> None:
    """Cleanup for a test that failed half-way: SIGKILL the process by its pid, reap it."""
    if proc.returncode is None:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    await proc.wait()
