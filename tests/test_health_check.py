"""The operator's health check (`--health-check`): one run bounded and judged, its
watch, the examples of docs/deployment.md, and real agents that keep a node out
before it joins or make it leave, quarantined, when its check starts failing."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from elasticrun.agent.health_check import REASON_LIMIT, CheckResult, HealthCheck, Verdict, last_line
from elasticrun.errors import EXIT_INFRASTRUCTURE
from tests.support.elastic_cluster import RDZV_CONF, Cluster, pid_alive, run_id
from tests.support.helpers import ELASTICRUN, eventually, wait_until

pytestmark = pytest.mark.timeout(120)

TICKER = Path(__file__).resolve().parent / "workers" / "tick_worker.py"
DEPLOYMENT = Path(__file__).resolve().parents[1] / "docs" / "deployment.md"


def check(command: str, timeout: float = 30.0) -> HealthCheck:
    return HealthCheck(command, timeout, dict(os.environ))


async def test_a_check_that_exits_0_passes_with_its_last_line() -> None:
    result = await check("echo first; echo '  ib0 up 200Gb/s  '; echo").run()
    assert (result.verdict, result.reason, result.ok) == (Verdict.PASSED, "ib0 up 200Gb/s", True)
    assert (await check("true").run()).reason == ""


async def test_a_failing_check_says_how_it_ended_and_its_last_line() -> None:
    failed = await check("echo checking; echo 'eth0 is down' >&2; exit 3").run()
    assert (failed.verdict, failed.reason) == (Verdict.FAILED, "health check failed (exit code 3): eth0 is down")
    silent = await check("exit 1").run()
    assert silent.reason == "health check failed (exit code 1): no output"
    crashed = await check("echo about to crash; kill -SEGV $$").run()
    assert crashed.reason.startswith("health check failed (SIGSEGV (-11)")
    assert crashed.reason.endswith(": about to crash")


async def test_a_check_past_its_timeout_is_killed_and_fails(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    result = await check(f"echo $$ > {pid_file}; exec sleep 300", timeout=0.5).run()
    assert (result.verdict, result.reason) == (Verdict.TIMED_OUT, "health check timed out after 0.5s: no output")
    assert not result.ok
    if pid_file.exists():  # it got that far: it was SIGKILLed (its end follows the signal)
        await eventually(lambda: not pid_alive(int(pid_file.read_text())), 10)


async def test_a_cancelled_check_takes_its_whole_process_group_with_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    command = f"sleep 300 & echo $! > {pid_file}.new; mv {pid_file}.new {pid_file}; wait"
    run = asyncio.ensure_future(check(command).run())
    await eventually(pid_file.exists, 30)
    grandchild = int(pid_file.read_text())
    assert pid_alive(grandchild)
    run.cancel()  # the round ended while the check ran
    with pytest.raises(asyncio.CancelledError):
        await run
    await eventually(lambda: not pid_alive(grandchild), 10)  # SIGKILLed: its end follows the signal


async def test_output_is_kept_to_its_tail_and_a_flood_does_not_stall_the_check() -> None:
    result = await check("yes 'a long line of noise' | head -n 1000000; echo the last line").run()
    assert (result.verdict, result.reason) == (Verdict.PASSED, "the last line")
    long = await check(f"printf '%0{REASON_LIMIT * 3}d\\n' 7; exit 1").run()
    assert len(long.reason) < REASON_LIMIT + 50 and long.reason.endswith("...")


async def test_a_daemon_holding_the_output_does_not_hold_the_verdict(tmp_path: Path) -> None:
    """A process that left the check's group (setsid) keeps the output pipe open: the
    verdict is the check's exit all the same, not the timeout."""
    pid_file = tmp_path / "daemon"
    try:
        daemon = f"setsid sh -c 'echo $$ > {pid_file}; exec sleep 300' &"
        left = f"until [ -s {pid_file} ]; do sleep 0.01; done"  # it left the group: it is no part of the check's
        result = await check(f"{daemon} {left}; echo started it", timeout=60).run()
        assert (result.verdict, result.reason) == (Verdict.PASSED, "started it")
    finally:
        await eventually(lambda: pid_file.exists() and pid_file.read_text().strip(), 30)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_last_line_is_one_printable_line() -> None:
    assert last_line(b"a\nb\n\n  \n") == "b"
    assert last_line(b"") == ""
    assert last_line(b"bad \x1b[31mcolour\xff\n") == "bad ?[31mcolour\ufffd"


async def test_the_watch_returns_the_first_failing_run_and_reports_every_run(tmp_path: Path) -> None:
    flag = tmp_path / "down"
    seen: list[CheckResult] = []
    command = f"test ! -e {flag} || {{ echo 'eth0 is down'; exit 1; }}"
    watch = asyncio.ensure_future(check(command).watch(0.01, seen.append))
    await eventually(lambda: len(seen) >= 2, 30)
    assert all(r.ok for r in seen) and not watch.done()
    flag.touch()
    result = await asyncio.wait_for(watch, 30)
    assert result.reason == "health check failed (exit code 1): eth0 is down" and seen[-1] is result


# --- the examples of docs/deployment.md -------------------------------------------------------


def documented_checks() -> dict[str, str]:
    """The example checks of deployment.md's "Health checks", by what they check."""
    text = DEPLOYMENT.read_text()
    part = text[text.index("## Health checks"):]
    part = part[: part.index("\n## ")]
    commands = re.findall(r"^--health-check='(.*)'$", part, flags=re.M)
    assert len(commands) == 3, commands
    return dict(zip(("nic", "scratch", "mount"), commands, strict=True))


def interfaces(state: str) -> list[str]:
    net = Path("/sys/class/net")
    return [p.name for p in sorted(net.iterdir()) if (p / "operstate").read_text().strip() == state]


async def test_the_nic_example() -> None:
    nic = documented_checks()["nic"]
    assert "ib0" in nic
    up, down = interfaces("up"), interfaces("down")
    if up:
        assert (await check(nic.replace("ib0", up[0])).run()).ok
    if down:
        assert (await check(nic.replace("ib0", down[0])).run()).reason.endswith(f": {down[0]} is down")
    missing = await check(nic.replace("ib0", "nosuchnic9")).run()
    assert missing.reason.startswith("health check failed (exit code 1): nosuchnic9 is cat: ")


async def test_the_scratch_example(tmp_path: Path) -> None:
    scratch = documented_checks()["scratch"]
    assert "/scratch" in scratch
    assert (await check(scratch.replace("/scratch", str(tmp_path))).run()).ok
    assert list(tmp_path.iterdir()) == []  # it cleaned up after itself
    gone = await check(scratch.replace("/scratch", str(tmp_path / "missing"))).run()
    assert gone.verdict is Verdict.FAILED and "No such file or directory" in gone.reason
    assert gone.reason.startswith("health check failed (exit code 1): dd: ")


async def test_the_mount_example(tmp_path: Path) -> None:
    mount = documented_checks()["mount"]
    assert "/shared" in mount and "nfs4" in mount
    assert (await check(mount.replace("/shared", "/proc").replace("nfs4", "proc")).run()).ok
    absent = await check(mount.replace("/shared", str(tmp_path))).run()
    assert absent.reason == f"health check failed (exit code 1): {tmp_path} is not mounted as nfs4 (not mounted)"
    other = await check(mount.replace("/shared", "/proc")).run()
    assert other.reason == "health check failed (exit code 1): /proc is not mounted as nfs4 (proc)"


# --- real agents ----------------------------------------------------------------------------


def status(endpoint: str, rid: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ELASTICRUN, "status", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rid}", *flags],
        capture_output=True, text=True, timeout=60,
    )


def test_a_failing_check_keeps_the_node_out_before_it_joins(cluster: Cluster) -> None:
    agent = cluster.launch("agent", "--standalone",
        "--health-check=echo checking /scratch; echo '/scratch is read-only' >&2; exit 1",
        str(TICKER), "--stop-file", str(cluster.stop_file),
    )
    assert agent.wait_exit() == EXIT_INFRASTRUCTURE
    assert agent.text().rstrip().endswith(
        "elasticrun: error: this node does not join: health check failed (exit code 1): /scratch is read-only"
    )
    assert "workers" not in agent.text()  # no worker ever started
    cluster.assert_no_orphans()


def test_a_check_that_starts_failing_makes_its_node_leave_and_stay_out(cluster: Cluster, c10d_store: str) -> None:
    rid, down = run_id(), cluster.tmp / "eth0-down"
    sick = "health check failed (exit code 1): eth0 is down"

    def agent(name: str, addr: int, health_check: str):
        return cluster.launch(name, "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={c10d_store}", f"--rdzv-id={rid}", f"--rdzv-conf={RDZV_CONF},is_host=false",
            f"--local-addr=127.0.0.{addr}", "--shutdown-timeout=5", f"--log-dir={cluster.tmp / 'logs'}",
            f"--health-check={health_check}", "--health-interval=0.2",
            str(TICKER), "--stop-file", str(cluster.stop_file), "--every", "0.05",
        )

    a = agent("a", 2, "true")
    b = agent("b", 3, f"test ! -e {down} || {{ echo checking eth0; echo 'eth0 is down'; exit 1; }}")
    for p in (a, b):
        p.wait_for(r"tick=\d+ rank=\d world=2")
    b_id = b.wait_for(r"INFO (\S+)\] health check passed").group(1)
    mark = a.mark()
    down.touch()  # node b's link goes down while it trains
    assert b.wait_exit() == EXIT_INFRASTRUCTURE
    b.wait_for(rf"workers healthy -> stopped: {re.escape(sick)}$")
    # the others go on at once, without it, and say why it left
    left = rf"workers healthy -> stopped: round \d+: {b_id} left; quarantined {b_id} for 60s \({re.escape(sick)}\)$"
    a.wait_for(left, start=mark)
    a.wait_for(r"tick=\d+ rank=0 world=1", start=mark)
    # it stays out, its agent gone: status names it, with the reason
    job = json.loads(status(c10d_store, rid, "--json").stdout)
    [held] = [e for e in job["quarantine"] if e["node_id"] == b_id]
    assert held["quarantined"] and not held["registered"] and held["reason"] == sick
    assert b_id not in job["job"]["nodes"]
    table = status(c10d_store, rid).stdout
    assert re.search(rf"^{re.escape(b_id)} \(gone\) .*  {re.escape(sick)}$", table, flags=re.M), table
    cluster.stop_training()
    assert a.wait_exit() == 0, a.text()[-3000:]
    cluster.assert_no_orphans()


def test_health_check_timeout_is_checked(cluster: Cluster) -> None:
    agent = cluster.launch("agent", "--standalone", "--health-check=true", "--health-check-timeout=0",
        str(TICKER), "--stop-file", str(cluster.stop_file),
    )
    assert agent.wait_exit() == 2
    assert "elasticrun: error: --health-check-timeout must be a positive number of seconds, got 0.0" in agent.text()
    wait_until(lambda: not cluster.alive(), 30, "the agent's end")
