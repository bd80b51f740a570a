"""Nothing of a worker's tree outlives its agent: grandchildren, shell pipelines,
daemons that double-forked into a process group of their own, a helper started in a
session of its own (setsid()), and a daemon that double-forked into a session of its
own, whether the agent is SIGKILLed, SIGTERMed, or ends normally after its worker
exited; and a session whose id was reused is left alone.

The bound: what escaped the worker's session (setsid) is gone within
3 s of the agent's SIGKILL, and of a normal stop. The SIGKILL test asserts it; after a
stop, the agent exits only once everything is gone, so the tests check that nothing is
left the moment it has exited."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from elasticrun.agent.cgroups import Cgroup
from elasticrun.agent.sessions import MARK_VAR, Mark, Session, kill_sessions, process_start
from tests.support.agent_helpers import REPO, kill_and_reap, read_lines_until, wait_pid_gone, write_script
from tests.support.elastic_cluster import pid_alive
from tests.support.helpers import ELASTICRUN, wait_until
from tests.support.reliability_rows import Reliability

# The worker starts a grandchild, a shell pipeline (its shell and two members), a daemon
# that double-forks and leaves the worker's process group but not its session, a helper
# in a session of its own (subprocess's start_new_session: setsid()), and a daemon that
# double-forks into a session of its own (its parent exits at once: init adopts it).
# Each writes its pid to fd 9 once it runs; the worker prints them all, then blocks or
# exits as argv[1] says.
_TREE = """
import os, subprocess, sys, time
r, w = os.pipe()
os.dup2(w, 9)
me = "echo $$ >&9"
subprocess.Popen(["sh", "-c", f"{me}; exec sleep 301"], pass_fds=(9,))
subprocess.Popen(
    ["sh", "-c", f"{me}; sh -c '{me}; exec sleep 302' | sh -c '{me}; exec sleep 303'"], pass_fds=(9,)
)
if os.fork() == 0:
    if os.fork() == 0:
        os.setpgid(0, 0)
        os.write(w, f"{os.getpid()}\\n".encode())
        time.sleep(304)
    os._exit(0)
subprocess.Popen(["sh", "-c", f"{me}; exec sleep 305"], pass_fds=(9,), start_new_session=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, f"{os.getpid()}\\n".encode())
        time.sleep(306)
    os._exit(0)
pids = []
with os.fdopen(r) as lines:
    while len(pids) < 7:
        pids.append(int(lines.readline()))
print("tree", os.getpid(), *pids, flush=True)
if sys.argv[1] == "block":
    time.sleep(300)
"""


@asynccontextmanager
async def _agent_with_tree(
    tmp_path: Path, mode: str, tree: str = _TREE
) -> AsyncIterator[tuple[asyncio.subprocess.Process, list[int]]]:
    """A real agent (`python -m elasticrun --standalone`) whose worker built the tree;
    yields the agent and the tree's pids, the worker's first. Kills what is left after."""
    script = write_script(tmp_path, "tree.py", tree)
    with (tmp_path / "agent.log").open("wb") as log:
        agent = await asyncio.create_subprocess_exec(
            *ELASTICRUN, "--standalone", "--nproc-per-node=1",
            f"--log-dir={tmp_path / 'logs'}", str(script), mode,
            stdout=asyncio.subprocess.PIPE, stderr=log, env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
    pids: list[int] = []
    try:
        assert agent.stdout is not None
        (line,) = await read_lines_until(agent.stdout, 1, "<stdout>: tree")
        pids = [int(p) for p in line.split()[2:]]
        yield agent, pids
    finally:
        await kill_and_reap(agent)
        for pid in pids:  # the old code's orphans; nothing with the fix
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


async def _all_gone(pids: list[int]) -> None:
    for pid in pids:
        await wait_pid_gone(pid, timeout=30)


def _none_left(pids: list[int]) -> None:
    """Nothing of the tree runs (the agent has exited: it stops everything first)."""
    assert [pid for pid in pids if pid_alive(pid)] == []


_TRIED = (
    "its worker started a grandchild sleep, a shell pipeline, a daemon that double-forked into a process group "
    "of its own, a helper in a session of its own (setsid) and a daemon that double-forked into a session of "
    "its own; "
)


@pytest.mark.security
async def test_a_sigkilled_agent_leaves_nothing_of_its_workers_trees(tmp_path: Path, reliability: Reliability) -> None:
    async with _agent_with_tree(tmp_path, "block") as (agent, pids):
        clock = reliability.clock()
        agent.kill()
        assert await asyncio.wait_for(agent.wait(), 60) == -signal.SIGKILL
        await _all_gone(pids)
        gone = clock()
    assert gone < 3.0, f"the tree took {gone} s to go"  # the bound
    reliability.record(
        part="security",
        scenario="an agent SIGKILLed under its workers",
        injected=_TRIED + "then the agent got SIGKILL",
        happened=f"every process of the tree ({len(pids)}) ended {gone:.2f} s after the kill (the agent's warden "
        "killed the worker's session and every process with the agent's mark when the agent's pipe closed)",
        lost="nothing (no process left)",
    )


@pytest.mark.security
async def test_a_sigtermed_agent_stops_its_workers_trees(tmp_path: Path, reliability: Reliability) -> None:
    async with _agent_with_tree(tmp_path, "block") as (agent, pids):
        agent.terminate()
        assert await asyncio.wait_for(agent.wait(), 60) == 128 + signal.SIGTERM  # docs/cli.md#exit-codes
        _none_left(pids)
    reliability.record(
        part="security",
        scenario="an agent SIGTERMed under its workers",
        injected=_TRIED + "then the agent got SIGTERM",
        happened=f"the agent stopped the whole session ({len(pids)} processes) and exited 1, as torchrun does",
        lost="nothing (no process left)",
    )


@pytest.mark.security
async def test_what_an_exited_worker_left_running_ends_with_the_job(tmp_path: Path, reliability: Reliability) -> None:
    async with _agent_with_tree(tmp_path, "exit") as (agent, pids):
        assert await asyncio.wait_for(agent.wait(), 60) == 0
        _none_left(pids)
    reliability.record(
        part="security",
        scenario="a worker that exits and leaves processes running",
        injected=_TRIED + "then the worker exited 0",
        happened=f"the job succeeded (exit 0) and the {len(pids) - 1} processes it left ended with it",
        lost="nothing (no process left)",
    )


def test_a_session_whose_id_was_reused_is_left_alone(tmp_path: Path) -> None:
    leader = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        ours = Session.of_leader(leader.pid)
        assert ours.leader_start is not None
        # A session of the same id, led by a process that started at another time.
        assert kill_sessions([Session(leader.pid, ours.leader_start + 1)], limit=10) == []
        assert leader.poll() is None
        assert kill_sessions([ours], limit=10) == []
        assert leader.wait(timeout=30) == -signal.SIGKILL
    finally:
        leader.kill()
        leader.wait()


@pytest.mark.parametrize("leader_start", ["known", "unknown"])
def test_a_session_whose_leader_ended_is_still_killed(tmp_path: Path, leader_start: str) -> None:
    """The members of a session outlive its leader; the number cannot be reused while they live."""
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 300 & echo $!"], stdout=subprocess.PIPE, start_new_session=True, text=True
    )
    try:
        assert leader.stdout is not None
        member = int(leader.stdout.readline())
        session = Session.of_leader(leader.pid)
        assert leader.wait(timeout=30) == 0
        if leader_start == "unknown":
            session = Session(leader.pid, None)
        assert kill_sessions([session], limit=10) == []
        assert not pid_alive(member)
    finally:
        leader.kill()
        leader.wait()


def test_what_left_the_session_is_found_by_the_mark_or_its_parent() -> None:
    """A marked process in a session of its own is found by its mark; its child, in yet
    another session and with its environment replaced (`setsid env -i`), by its parent;
    an unmarked process of another session is left alone."""
    mark = Mark(secrets.token_hex(8), born_after=process_start(os.getpid()))
    marked = subprocess.Popen(
        ["sh", "-c", "setsid env -i sleep 301 & echo $!; exec sleep 302"],
        env=dict(os.environ, **{MARK_VAR: mark.value}), stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    stranger = subprocess.Popen(["sleep", "303"], start_new_session=True)
    try:
        assert marked.stdout is not None
        child = int(marked.stdout.readline())
        cmdline = Path(f"/proc/{child}/cmdline")
        wait_until(lambda: cmdline.read_bytes().startswith(b"sleep\0"), 30, "the child's exec of sleep")
        assert MARK_VAR.encode() not in Path(f"/proc/{child}/environ").read_bytes()
        assert kill_sessions([], limit=10, mark=mark) == []
        assert marked.wait(timeout=30) == -signal.SIGKILL
        assert not pid_alive(child)
        assert stranger.poll() is None
    finally:
        for proc in (marked, stranger):
            proc.kill()
            proc.wait()


# The escape sessions.py cannot see: a daemon that double-forks, calls
# setsid() and replaces its environment with an empty one (no mark), its parent gone.
# The worker prints its pid once it runs the new program.
_ESCAPE = """
import os, sys, time
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, f"{os.getpid()}\\n".encode())
        os.execve("/bin/sleep", ["sleep", "308"], {})
    os._exit(0)
os.close(w)
pid = int(os.fdopen(r).readline())
while not open(f"/proc/{pid}/cmdline", "rb").read().startswith(b"sleep"):
    time.sleep(0.01)
print("tree", os.getpid(), pid, flush=True)
time.sleep(300)
"""


def _cgroups_writable() -> bool:
    probe = Cgroup.make(f"elasticrun-probe-{secrets.token_hex(4)}")
    if probe is None:
        return False
    probe.remove(1.0)
    return True


@pytest.mark.security
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
async def test_a_cleared_environment_escapes_nothing_where_cgroups_are_writable(
    tmp_path: Path, sig: signal.Signals, reliability: Reliability
) -> None:
    if not _cgroups_writable():
        pytest.skip("no writable cgroup v2 hierarchy here: what left the session and cleared its environment "
                    "outlives its agent (docs/concepts.md says so)")
    async with _agent_with_tree(tmp_path, "block", _ESCAPE) as (agent, pids):
        escaped = pids[1]
        assert MARK_VAR.encode() not in Path(f"/proc/{escaped}/environ").read_bytes()
        clock = reliability.clock()
        agent.send_signal(sig)
        code = await asyncio.wait_for(agent.wait(), 60)
        if sig is signal.SIGKILL:
            assert code == -signal.SIGKILL
            await wait_pid_gone(escaped, timeout=3.0)  # the bound
        else:  # a stop: the agent exits only once its workers' cgroup is empty
            assert code == 128 + signal.SIGTERM and not pid_alive(escaped)
        gone = clock()
    reliability.record(
        part="security",
        scenario=f"an agent {sig.name}ed under a daemon that cleared its environment",
        injected="its worker started a daemon that double-forked, called setsid() and exec'd with an empty "
        f"environment (no mark, no session, its parent gone); then the agent got {sig.name}",
        happened=f"the daemon ended {gone:.2f} s after the signal: the worker group's cgroup (v2) held it, "
        + ("and the agent's warden killed the cgroup (cgroup.kill) when the agent's pipe closed"
           if sig is signal.SIGKILL else "and the agent's stop killed the cgroup before it exited 143"),
        lost="nothing (no process left)",
    )
