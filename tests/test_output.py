"""Worker output: rank prefixes, whole lines, redirects/tee files, the ranks filter;
log files the workers write themselves, so a SIGKILLed agent loses none of their lines;
following a growing file on inotify."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticrun.agent.filetail import FileTail
from elasticrun.agent.output import MAX_LINE, WorkerOutput, _split_lines, plan_streams, worker_stdio
from elasticrun.agent.processes import Warden, WorkerGroup
from elasticrun.agent.spec import Std
from elasticrun.errors import UsageError, WorkerStartError
from tests.support.agent_helpers import (
    kill_and_reap,
    make_spec,
    read_lines_until,
    start_agent_process,
    wait_pid_gone,
    write_script,
)
from tests.support.helpers import ELASTICRUN


@given(st.lists(st.binary(max_size=200), max_size=20))
def test_split_lines_loses_nothing_and_bounds_line_length(chunks: list[bytes]) -> None:
    out: list[bytes] = []
    rest = b""
    chunks = [c for c in chunks if c]  # an empty read means end of file
    for chunk in [*chunks, b""]:
        lines, rest = _split_lines(rest + chunk, eof=not chunk)
        out += lines
    data = b"".join(chunks)
    assert rest == b""
    if data:
        # Every line break of the input is one, except that the last line may lack one.
        expected = data[:-1] if data.endswith(b"\n") else data
        assert b"\n".join(out) == expected


def test_overlong_line_is_cut() -> None:
    lines, rest = _split_lines(b"x" * (2 * MAX_LINE + 5), eof=False)
    assert lines == [b"x" * MAX_LINE] * 2
    assert rest == b"x" * 5


def test_plans_follow_torchrun_redirects_tee_and_filter(tmp_path: Path) -> None:
    spec = make_spec(
        tmp_path / "t.py",
        nproc_per_node=3,
        redirects={0: Std.ALL, 1: Std.ERR},
        tee={1: Std.OUT},
        local_ranks_filter=frozenset({0, 1}),
    )
    p0 = plan_streams(spec, 0, tmp_path / "0")
    p1 = plan_streams(spec, 1, tmp_path / "1")
    p2 = plan_streams(spec, 2, tmp_path / "2")
    assert (p0[Std.OUT].console, p0[Std.OUT].file) == (False, tmp_path / "0/stdout.log")
    assert (p0[Std.ERR].console, p0[Std.ERR].file) == (False, tmp_path / "0/stderr.log")
    assert (p1[Std.OUT].console, p1[Std.OUT].file) == (True, tmp_path / "1/stdout.log")
    assert (p1[Std.ERR].console, p1[Std.ERR].file) == (False, tmp_path / "1/stderr.log")
    assert (p2[Std.OUT].console, p2[Std.OUT].file) == (False, None)  # filtered out
    assert (p2[Std.ERR].console, p2[Std.ERR].file) == (False, None)


_CHATTY = """
import os, sys
rank = os.environ["RANK"]
for i in range(300):
    # Each line is written in pieces, flushed in between, from two processes at once.
    sys.stdout.write(f"r{rank} line {i} ")
    sys.stdout.flush()
    sys.stdout.write("end\\n")
    sys.stdout.flush()
sys.stderr.write("err one\\nerr two, no newline")
"""


async def _run_workers(script: Path, plans_for: dict[int, dict], warden: Warden, offset: int = 4) -> dict:
    with worker_stdio(plans_for) as stdio:
        group = await WorkerGroup.start(
            [sys.executable, "-u", str(script)],
            {r: {"RANK": str(offset + r)} for r in plans_for},
            warden,
            stdio,
        )
    outputs = {}
    try:
        for local_rank, proc in group.procs.items():
            outputs[local_rank] = WorkerOutput((proc.stdout, proc.stderr), offset + local_rank, plans_for[local_rank])
        await group.wait()
    finally:
        await group.stop(grace=5)
        for output in outputs.values():
            await output.drain(timeout=10)
    return outputs


async def test_console_lines_are_whole_and_prefixed_with_the_global_rank(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], warden: Warden
) -> None:
    script = write_script(tmp_path, "chatty.py", _CHATTY)
    spec = make_spec(script, nproc_per_node=2)
    plans = {r: plan_streams(spec, r, tmp_path / str(r)) for r in (0, 1)}
    outputs = await _run_workers(script, plans, warden)
    out, err = capfd.readouterr()
    for rank in (4, 5):
        mine = [line for line in out.splitlines() if line.startswith(f"[{rank}]")]
        assert mine == [f"[{rank}]<stdout>: r{rank} line {i} end" for i in range(300)]
    assert len(out.splitlines()) == 600
    err4 = [line for line in err.splitlines() if line.startswith("[4]")]
    assert err4 == ["[4]<stderr>: err one", "[4]<stderr>: err two, no newline"]
    assert list(outputs[1].stderr_tail) == ["err one", "err two, no newline"]
    assert not list(tmp_path.glob("*/*.log"))  # no redirects, no tee: no files


async def test_redirects_go_to_files_only_and_tee_to_both(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], warden: Warden
) -> None:
    script = write_script(tmp_path, "chatty.py", _CHATTY)
    spec = make_spec(
        script, nproc_per_node=2, redirects={0: Std.ALL}, tee={1: Std.ERR}
    )
    for r in (0, 1):
        (tmp_path / str(r)).mkdir()
    plans = {r: plan_streams(spec, r, tmp_path / str(r)) for r in (0, 1)}
    outputs = await _run_workers(script, plans, warden, offset=0)
    out, err = capfd.readouterr()
    assert "[0]<" not in out + err
    assert out.count("[1]<stdout>: ") == 300
    assert "[1]<stderr>: err one" in err
    stdout0 = (tmp_path / "0/stdout.log").read_text().splitlines()
    assert stdout0 == [f"r0 line {i} end" for i in range(300)]  # unprefixed
    assert (tmp_path / "0/stderr.log").read_text() == "err one\nerr two, no newline"
    assert (tmp_path / "1/stderr.log").read_text() == "err one\nerr two, no newline"
    assert not (tmp_path / "1/stdout.log").exists()
    # The tail is kept for the report even when stderr goes to a file only.
    assert list(outputs[0].stderr_tail) == ["err one", "err two, no newline"]


async def test_a_copy_that_fails_is_reported_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, warden: Warden
) -> None:
    async def broken(self: FileTail, size: int) -> bytes:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(FileTail, "read", broken)
    script = write_script(tmp_path, "chatty.py", _CHATTY)
    spec = make_spec(script, nproc_per_node=1, tee={0: Std.OUT})
    (tmp_path / "0").mkdir()
    outputs = await _run_workers(script, {0: plan_streams(spec, 0, tmp_path / "0")}, warden, offset=0)
    assert "rank 0: its stdout is no longer followed: OSError(5, 'Input/output error')" in caplog.text
    assert "its stderr" not in caplog.text  # the pipe it reads works
    assert len((tmp_path / "0/stdout.log").read_text().splitlines()) == 300  # the file has it all
    assert list(outputs[0].stderr_tail) == ["err one", "err two, no newline"]


#: a worker that writes one line to each stream and exits at once
_QUICK = ("/bin/sh", "-c", 'echo "out $RANK"; echo "err $RANK" >&2')


async def test_no_line_of_a_worker_that_exits_at_once_is_lost_whatever_redirects_and_tee(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], warden: Warden
) -> None:
    """Every --redirects x --tee (0..3 each), several times: each line in its file and
    on the console exactly where torchrun puts it (tee wins over redirects)."""
    for redirect, tee, attempt in itertools.product(range(4), range(4), range(3)):
        spec = make_spec(
            tmp_path / "unused.py", nproc_per_node=2,
            redirects={r: Std(redirect) for r in (0, 1)}, tee={r: Std(tee) for r in (0, 1)},
        )
        root = tmp_path / f"{redirect}{tee}{attempt}"
        plans = {r: plan_streams(spec, r, root / str(r)) for r in (0, 1)}
        for r in (0, 1):
            (root / str(r)).mkdir(parents=True)
        with worker_stdio(plans) as stdio:
            group = await WorkerGroup.start(_QUICK, {r: {"RANK": str(r)} for r in (0, 1)}, warden, stdio)
        outputs = [WorkerOutput((proc.stdout, proc.stderr), r, plans[r]) for r, proc in group.procs.items()]
        await group.wait()
        await group.stop(grace=5)
        for output in outputs:
            await output.drain(timeout=10)
        out, err = capfd.readouterr()
        for std, name, console in ((Std.OUT, "out", out), (Std.ERR, "err", err)):
            shown = bool(tee & std or not redirect & std)
            expected = [f"[{r}]<std{name}>: {name} {r}" for r in (0, 1)]
            assert sorted(console.splitlines()) == (expected if shown else []), (redirect, tee, name)
            for r in (0, 1):
                file = root / str(r) / f"std{name}.log"
                if (redirect | tee) & std:
                    assert file.read_text() == f"{name} {r}\n", (redirect, tee, name)
                else:
                    assert not file.exists()


def test_the_launcher_tees_what_it_also_redirects(tmp_path: Path) -> None:
    """The case a user met: --redirects=3 --tee=3, a worker that exits at once."""
    script = tmp_path / "two.sh"
    script.write_text('#!/bin/sh\necho "out $RANK"\necho "err $RANK" >&2\n')
    script.chmod(0o755)
    done = subprocess.run(
        [*ELASTICRUN, "--standalone", "--nproc-per-node=2", "--no-python",
         "--redirects=3", "--tee=3", f"--log-dir={tmp_path / 'logs'}", str(script)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[0]<stdout>: out 0", "[1]<stdout>: out 1"]
    assert {"[0]<stderr>: err 0", "[1]<stderr>: err 1"} <= set(done.stderr.splitlines())
    assert sorted(p.read_text() for p in (tmp_path / "logs").glob("*/attempt_0/*/std*.log")) == [
        "err 0\n", "err 1\n", "out 0\n", "out 1\n"
    ]


_BURST = """
import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
print(f"ready {os.getpid()}", flush=True)
signal.sigwait({signal.SIGUSR1})  # the agent is frozen now: it reads nothing more
for i in range(500):
    print(f"out {i}", flush=True)
    print(f"err {i}", file=sys.stderr, flush=True)
"""


async def test_a_sigkilled_agent_loses_no_line_its_worker_wrote(tmp_path: Path) -> None:
    script = write_script(tmp_path, "burst.py", _BURST)
    agent = await start_agent_process(script, tmp_path / "logs", tee=int(Std.ALL))
    try:
        assert agent.stdout is not None
        (ready,) = await read_lines_until(agent.stdout, 1, "<stdout>: ready")  # relayed
        worker = int(ready.rsplit(" ", 1)[1])
        # Frozen, the agent reads none of what follows: all of it would still be in a
        # pipe when the agent dies.
        agent.send_signal(signal.SIGSTOP)
        os.kill(worker, signal.SIGUSR1)
        await wait_pid_gone(worker)  # every line written
        agent.kill()
        assert await asyncio.wait_for(agent.wait(), 60) == -signal.SIGKILL
    finally:
        await kill_and_reap(agent)
    (worker_dir,) = (tmp_path / "logs").glob("*/attempt_0/0")
    stdout = (worker_dir / "stdout.log").read_text().splitlines()
    assert stdout == [f"ready {worker}", *(f"out {i}" for i in range(500))]
    stderr = (worker_dir / "stderr.log").read_text().splitlines()
    assert stderr == [f"err {i}" for i in range(500)]


def test_a_log_file_that_cannot_be_opened_fails_the_start_and_leaks_nothing(
    tmp_path: Path,
) -> None:
    spec = make_spec(tmp_path / "t.py", nproc_per_node=2, tee={0: Std.ALL, 1: Std.ALL})
    (tmp_path / "0").mkdir()
    (tmp_path / "1" / "stderr.log").mkdir(parents=True)  # a folder: not writable as a file
    plans = {r: plan_streams(spec, r, tmp_path / str(r)) for r in (0, 1)}
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(UsageError, match=r"cannot write the log file .*/1/stderr\.log: .*\(check --log-dir\)"):
        with worker_stdio(plans):
            pytest.fail("no worker may start")
    assert len(os.listdir("/proc/self/fd")) == fds  # the three files opened are closed


async def test_a_log_file_that_cannot_be_followed_is_a_start_error(tmp_path: Path, warden: Warden) -> None:
    script = write_script(tmp_path, "quiet.py", "")
    spec = make_spec(script, tee={0: Std.ALL})
    (tmp_path / "0").mkdir()
    plans = {0: plan_streams(spec, 0, tmp_path / "0")}
    with worker_stdio(plans) as stdio:
        group = await WorkerGroup.start(list(spec.entrypoint), {0: {}}, warden, stdio)
    try:
        (tmp_path / "0" / "stderr.log").unlink()  # removed as the worker started
        before = _inotify_instances()
        with pytest.raises(WorkerStartError, match=r"cannot follow the log file .*/stderr\.log: No such file"):
            WorkerOutput((group.procs[0].stdout, group.procs[0].stderr), 0, plans[0])
        assert _inotify_instances() == before  # the stdout follower was closed again
    finally:
        await group.stop(grace=5)


async def test_a_followed_file_wakes_its_reader_and_ends_where_finish_found_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "grows.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    tail = FileTail(path)
    try:
        reading = asyncio.create_task(tail.read(100))
        await asyncio.sleep(0)  # one turn of the loop: the read finds nothing and waits
        assert not reading.done()
        os.write(fd, b"one\n")
        assert await asyncio.wait_for(reading, 30) == b"one\n"  # woken by inotify
        os.write(fd, b"two\n")
        tail.finish()
        os.write(fd, b"three\n")  # after finish(): in the file only
        assert await asyncio.wait_for(tail.read(100), 30) == b"two\n"
        assert await asyncio.wait_for(tail.read(100), 30) == b""
    finally:
        tail.close()
        os.close(fd)
    assert path.read_bytes() == b"one\ntwo\nthree\n"


def _inotify_instances() -> int:
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:
            pass  # the listing's own descriptor, closed by now
    return links.count("anon_inode:inotify")


async def test_followed_files_share_one_inotify_instance_closed_with_the_last(
    tmp_path: Path,
) -> None:
    before = _inotify_instances()
    for name in ("a.log", "b.log"):
        (tmp_path / name).touch()
    tails = [FileTail(tmp_path / "a.log"), FileTail(tmp_path / "b.log")]
    try:
        assert _inotify_instances() == before + 1
    finally:
        for tail in tails:
            tail.close()
    assert _inotify_instances() == before
