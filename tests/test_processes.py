"""Worker processes: start (streams as pipes or given files), wait for exits, stop with
escalation, reap, start errors."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from elasticrun.agent.processes import Warden, WorkerGroup
from elasticrun.errors import WorkerStartError
from tests.support.agent_helpers import read_lines_until, wait_pid_gone, write_script


def _argv(script: Path) -> list[str]:
    return [sys.executable, "-u", str(script)]


async def test_success_records_every_exit(tmp_path: Path, warden: Warden) -> None:
    script = write_script(tmp_path, "ok.py", "print('hi')\n")
    group = await WorkerGroup.start(_argv(script), {0: {}, 1: {}}, warden)
    try:
        exits = await group.wait()
    finally:
        await group.stop(grace=5)
    assert sorted(e.local_rank for e in exits) == [0, 1]
    assert all(e.returncode == 0 and not e.failed for e in exits)


async def test_a_stream_given_a_file_descriptor_writes_that_file_the_other_is_a_pipe(
    tmp_path: Path, warden: Warden,
) -> None:
    script = write_script(
        tmp_path, "both.py", "import sys\nprint('to the file')\nprint('to the pipe', file=sys.stderr)\n"
    )
    log = tmp_path / "stdout.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT)
    try:
        group = await WorkerGroup.start(_argv(script), {0: {}}, warden, {0: (fd, asyncio.subprocess.PIPE)})
    finally:
        os.close(fd)  # the worker has its own copy
    try:
        proc = group.procs[0]
        assert proc.stdout is None and proc.stderr is not None
        assert await asyncio.wait_for(proc.stderr.read(), 60) == b"to the pipe\n"
        await group.wait()
    finally:
        await group.stop(grace=5)
    assert log.read_text() == "to the file\n"


async def test_a_failure_returns_at_once_and_stop_terminates_the_rest(
    tmp_path: Path, warden: Warden,
) -> None:
    script = write_script(
        tmp_path,
        "w.py",
        """
        import os, sys, time
        if os.environ["ROLE"] == "fail":
            sys.exit(7)
        time.sleep(300)
        """,
    )
    group = await WorkerGroup.start(
        _argv(script), {0: {"ROLE": "sleep"}, 1: {"ROLE": "fail"}}, warden
    )
    try:
        exits = await group.wait()
        assert [(e.local_rank, e.returncode, e.failed) for e in exits] == [(1, 7, True)]
    finally:
        await group.stop(grace=10)
    sleeper = group.exits[0]
    assert sleeper.returncode == -signal.SIGTERM
    assert sleeper.stopped and not sleeper.failed


_IGNORES_SIGTERM = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(f"ready {child.pid}", flush=True)
time.sleep(300)
"""


async def test_stop_escalates_to_sigkill_and_kills_the_whole_process_group(
    tmp_path: Path, warden: Warden,
) -> None:
    script = write_script(tmp_path, "stubborn.py", _IGNORES_SIGTERM)
    group = await WorkerGroup.start(_argv(script), {0: {}}, warden)
    try:
        proc = group.procs[0]
        assert proc.stdout is not None
        (line,) = await read_lines_until(proc.stdout, 1, "ready")
        grandchild = int(line.split()[1])
    finally:
        await group.stop(grace=0.2)
    assert group.exits[0].returncode == -signal.SIGKILL
    await wait_pid_gone(grandchild)


async def test_stop_still_kills_and_reaps_when_cancelled(tmp_path: Path, warden: Warden) -> None:
    script = write_script(tmp_path, "stubborn.py", _IGNORES_SIGTERM)
    group = await WorkerGroup.start(_argv(script), {0: {}}, warden)
    proc = group.procs[0]
    assert proc.stdout is not None
    await read_lines_until(proc.stdout, 1, "ready")
    stopping = asyncio.create_task(group.stop(grace=300))
    await asyncio.sleep(0)  # let stop() send SIGTERM and begin its grace period
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    assert proc.returncode == -signal.SIGKILL
    assert group.exits[0].stopped


async def test_missing_executable_is_a_start_error(tmp_path: Path, warden: Warden) -> None:
    with pytest.raises(WorkerStartError, match="no-such-binary"):
        await WorkerGroup.start([str(tmp_path / "no-such-binary")], {0: {}}, warden)


async def test_exit_is_seen_while_a_child_holds_the_pipes_and_stop_kills_it(
    tmp_path: Path, warden: Warden,
) -> None:
    script = write_script(
        tmp_path,
        "daemon.py",
        """
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        print(f"child {child.pid}", flush=True)
        """,
    )
    group = await WorkerGroup.start(_argv(script), {0: {}}, warden)
    try:
        proc = group.procs[0]
        assert proc.stdout is not None
        (line,) = await read_lines_until(proc.stdout, 1, "child")
        exits = await group.wait()  # the child still holds stdout and stderr open
        assert [(e.returncode, e.failed) for e in exits] == [(0, False)]
    finally:
        await group.stop(grace=5)
    await wait_pid_gone(int(line.split()[1]))
