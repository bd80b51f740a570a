"""The agent's side of torchrun's file timer, without torch: requests through the FIFO,
expiry, release, and only the agent's own workers signalled; a path that exists already
refused, and only the FIFO the agent made ever removed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from elasticrun.agent.filetimer import FileTimerServer
from elasticrun.errors import UsageError

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


def _plant(tmp_path: Path, kind: str) -> tuple[Path, Callable[[], object]]:
    """Something of `kind` at a path, and a snapshot of it (and of what a link points at)."""
    path = tmp_path / "timer"
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    if kind == "regular file":
        path.write_text("keep me too\n")
    elif kind in ("symbolic link", "dangling symbolic link"):
        path.symlink_to(target if kind == "symbolic link" else tmp_path / "nowhere")
    elif kind == "folder":
        path.mkdir()
        (path / "inside").write_text("keep me too\n")
    elif kind == "character device":  # /dev/null's own numbers, on a node of the test's
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("making a device node needs root (CAP_MKNOD)")
    else:  # a FIFO someone else made
        os.mkfifo(path, 0o600)

    def snapshot() -> object:
        info = os.lstat(path)
        inside = sorted(p.name for p in path.iterdir()) if kind == "folder" else None
        content = path.read_text() if kind == "regular file" else None
        link = os.readlink(path) if "link" in kind else None
        return (info.st_ino, info.st_mode, inside, content, link, target.read_text())

    return path, snapshot


@pytest.mark.parametrize(
    "kind", ["regular file", "symbolic link", "dangling symbolic link", "folder", "FIFO", "character device"]
)
async def test_a_path_that_exists_is_refused_in_one_line_and_left_as_it_was(tmp_path: Path, kind: str) -> None:
    """torchrun's server removes whatever is at the path (TORCHELASTIC_TIMER_FILE=/dev/null
    deletes /dev/null); ours makes its own FIFO, so any existing path is refused. The
    device is a node of the test's own with /dev/null's numbers: the machine's /dev/null
    is never named (were the timer wrong, the test would delete it)."""
    path, snapshot = _plant(tmp_path, kind)
    before = snapshot()
    server = FileTimerServer(path, lambda: ())
    with pytest.raises(UsageError) as refused:
        server.start()
    message = str(refused.value)
    assert "\n" not in message and f"TORCHELASTIC_TIMER_FILE={path}" in message, message
    expected = {"dangling symbolic link": "a symbolic link"}.get(kind, f"a {kind}")
    assert f": {expected} is there already" in message, message
    server.close()  # what the agent's cleanup does after a failed start
    assert snapshot() == before


async def test_at_exit_only_the_fifo_it_made_is_removed(tmp_path: Path) -> None:
    server = FileTimerServer(tmp_path / "timer", lambda: ())
    made = server.start()
    assert stat.S_ISFIFO(os.lstat(server.path).st_mode) and os.lstat(server.path).st_ino == made.st_ino
    server.path.unlink()  # someone put a file of theirs in its place meanwhile
    server.path.write_text("not the FIFO\n")
    server.close()
    assert server.path.read_text() == "not the FIFO\n"
