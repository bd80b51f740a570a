"""The agent's side of torchrun's file timer, without torch: requests through the FIFO,
expiry, release, and only the agent's own workers signalled."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticrun.agent.filetimer import FileTimerServer

pytestmark = pytest.mark.timeout(30)


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)


def request(path: Path, pid: int, scope: str, after: float, sig: int = signal.SIGKILL) -> None:
    """As FileTimerClient sends it: one JSON line, the FIFO opened without blocking."""
    line = {"version": 1, "pid": pid, "scope_id": scope,
            "expiration_time": time.time() + after if after >= 0 else -1, "signal": sig}
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(line) + "\n")


async def wait_exit(proc: subprocess.Popen[bytes]) -> int:
    """The process's exit, waited for in a thread while the server's loop runs."""
    return await asyncio.to_thread(proc.wait)


async def test_an_expired_timer_kills_its_worker_and_only_that(tmp_path: Path) -> None:
    released, foreign, overrun = sleeper(), sleeper(), sleeper()
    server = FileTimerServer(tmp_path / "timer", lambda: (released.pid, overrun.pid))
    server.start()
    try:
        request(server.path, released.pid, "step", 0.1)
        request(server.path, released.pid, "step", -1)  # released in time
        request(server.path, foreign.pid, "step", 0.1)  # not one of this agent's workers
        request(server.path, overrun.pid, "step", 0.3)
        assert await asyncio.wait_for(wait_exit(overrun), 10) == -signal.SIGKILL
        assert released.poll() is None and foreign.poll() is None
    finally:
        server.close()
        for proc in (released, foreign, overrun):
            proc.kill()
            proc.wait()
    assert not server.path.exists()


async def test_a_timer_without_a_signal_kills_nothing_and_bad_lines_are_ignored(tmp_path: Path) -> None:
    quiet, overrun = sleeper(), sleeper()
    server = FileTimerServer(tmp_path / "timer", lambda: (quiet.pid, overrun.pid))
    server.start()
    try:
        fd = os.open(server.path, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b"not json\n")
        os.close(fd)
        request(server.path, quiet.pid, "step", 0.05, sig=0)
        request(server.path, overrun.pid, "step", 0.3, sig=signal.SIGTERM)
        assert await asyncio.wait_for(wait_exit(overrun), 10) == -signal.SIGTERM
        assert quiet.poll() is None
    finally:
        server.close()
        for proc in (quiet, overrun):
            proc.kill()
            proc.wait()
