"""Warm restarts (elasticrun.agent.standby): a worker that was a standby starts as a cold one.

Real launchers, agents and workers. One job serves the first three tests: its first
round starts cold (no standby yet), the test kills a ready standby and waits for its
replacement, edits the script, and lets the round fail; the next round starts warm.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.agent_helpers import REPO, kill_and_reap, read_lines_until, wait_pid_gone
from tests.support.helpers import free_port
from tests.test_cli import clean_env

pytestmark = pytest.mark.timeout(150)

SCRIPT = REPO / "tests" / "workers" / "start_facts.py"
READY = "standby workers ready"
#: what differs between two rounds of one job whatever the start: the round's values
ROUND_KEYS = {"TORCHELASTIC_RESTART_COUNT", "MASTER_PORT", "ELASTICRUN_ROUND"}


def standby_pids(line: str) -> dict[int, int]:
    """`standby workers ready (local rank: pid 0: 123, 1: 456)` -> {0: 123, 1: 456}."""
    return {int(r): int(p) for r, p in re.findall(r"(\d+): (\d+)", line.split("pid", 1)[1])}


async def launch(tmp_path: Path, script: Path, *flags: str, path: str = str(REPO)) -> asyncio.subprocess.Process:
    """The job of start_facts.py, on one node (`--standalone` unless `flags` name a rendezvous)."""
    rdzv = [] if any(f.startswith("--rdzv-backend") for f in flags) else ["--standalone"]
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "elasticrun", *rdzv, "--nproc-per-node=2", "--max-restarts=1",
        f"--log-dir={tmp_path / 'logs'}", *flags, str(script), str(tmp_path), str(tmp_path / "go"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        # PWD as a shell that started the launcher in tmp_path has it: a cold worker's
        # command passes through /bin/sh where it joins its cgroup, and sh puts right a
        # PWD that is not the working folder; a warm worker's environment is the agent's
        env=clean_env(LOGLEVEL="DEBUG", PYTHONPATH=path, PWD=str(tmp_path)), cwd=tmp_path,
        start_new_session=True,
    )


@dataclass
class WarmJob:
    """What the shared job did and left."""

    facts: dict[tuple[int, int], dict[str, object]]
    #: what torch showed each worker in its group (start_facts.py's torch_<restart>_<rank>.json)
    torch_facts: dict[tuple[int, int], dict[str, object]]
    killed: int
    replacements: dict[int, int]
    stderr: str
    exit_code: int
    #: processes of the job's command still alive once its launcher exited
    left: list[int]


@pytest.fixture(scope="module")
def warm_job(tmp_path_factory: pytest.TempPathFactory) -> WarmJob:
    return asyncio.run(_warm_job(tmp_path_factory.mktemp("warm")))


async def _warm_job(tmp_path: Path) -> WarmJob:
    script = tmp_path / "start_facts.py"
    shutil.copy(SCRIPT, script)
    proc = await launch(tmp_path, script)
    try:
        assert proc.stderr is not None
        (line,) = await read_lines_until(proc.stderr, 1, READY, timeout=90)
        first = standby_pids(line)
        os.kill(first[1], signal.SIGKILL)  # before its use: replaced, said once
        await read_lines_until(proc.stderr, 1, "before its round: starting another", timeout=30)
        (line,) = await read_lines_until(proc.stderr, 1, READY, timeout=90)
        replacements = standby_pids(line)
        script.write_text(script.read_text().replace("VERSION = 1 ", "VERSION = 2 "))
        (tmp_path / "go").touch()
        async with asyncio.timeout(90):
            _, rest = await proc.communicate()
    finally:
        await kill_and_reap(proc)
    facts = {
        (restart, rank): json.loads((tmp_path / f"facts_{restart}_{rank}.json").read_text())
        for restart in (0, 1)
        for rank in (0, 1)
    }
    torch_facts = {
        (restart, rank): json.loads((tmp_path / f"torch_{restart}_{rank}.json").read_text())
        for restart in (0, 1)
        for rank in (0, 1)
    }
    left = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if _runs_in(pid, tmp_path)]
    return WarmJob(facts, torch_facts, first[1], replacements, rest.decode(), proc.returncode or 0, left)


def _child_running(pid: int, parent: int, name: bytes) -> bool:
    """Whether process `pid` is a child of `parent` with `name` among its arguments."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[1]) == parent and name in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return False


def _runs_in(pid: int, folder: Path) -> bool:
    """Whether process `pid` runs the job's command (its argv names `folder`)."""
    try:
        return str(folder).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _normalised_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v.replace("attempt_0", "attempt_N").replace("attempt_1", "attempt_N") for k, v in env.items()
            if k not in ROUND_KEYS}


async def test_warm_worker_starts_as_a_cold_one(warm_job: WarmJob) -> None:
    assert warm_job.exit_code == 0, warm_job.stderr
    for rank in (0, 1):
        cold, warm = warm_job.facts[0, rank], warm_job.facts[1, rank]
        assert (cold["preloaded"], warm["preloaded"]) == (False, True)  # the first round has no standby
        assert _normalised_env(warm["env"]) == _normalised_env(cold["env"])  # type: ignore[arg-type]
        assert warm["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"  # type: ignore[index]
        assert "ELASTICRUN_STANDBY" not in warm["env"]  # type: ignore[operator]
        for name in cold:
            if name not in ("preloaded", "version", "pid", "env", "cgroup_raw"):
                assert warm[name] == cold[name], name
    for restart in (0, 1):  # a group's workers share its cgroup, warm as cold
        assert warm_job.facts[restart, 0]["cgroup_raw"] == warm_job.facts[restart, 1]["cgroup_raw"]


async def test_torchs_launcher_checks_see_the_same_warm_as_cold(warm_job: WarmJob) -> None:
    """What PyTorch's launcher tests check a worker sees (is_torchelastic_launched, rank,
    world, LOCAL_RANK, an env:// group's all-reduce), warm as cold."""
    for rank in (0, 1):
        cold, warm = warm_job.torch_facts[0, rank], warm_job.torch_facts[1, rank]
        assert cold == warm == {
            "torchelastic_launched": True, "rank_world": [rank, 2], "local_rank": rank,
            "sum_of_ranks": 3, "backend": "gloo",
        }


async def test_nothing_is_left_when_the_job_ends(warm_job: WarmJob) -> None:
    assert warm_job.left == []


async def test_edited_script_runs_its_new_version(warm_job: WarmJob) -> None:
    assert [warm_job.facts[1, r]["version"] for r in (0, 1)] == [2, 2]
    assert [warm_job.facts[0, r]["version"] for r in (0, 1)] == [1, 1]


async def test_killed_standby_is_replaced(warm_job: WarmJob) -> None:
    assert warm_job.killed != warm_job.replacements[1]
    assert {r: warm_job.facts[1, r]["pid"] for r in (0, 1)} == warm_job.replacements
    assert warm_job.stderr.count("before its round: starting another") == 0  # said once, before the round


async def test_non_python_command_starts_cold(tmp_path: Path) -> None:
    script = tmp_path / "fail_once.sh"
    script.write_text('echo "rank $RANK restart $TORCHELASTIC_RESTART_COUNT"; [ "$TORCHELASTIC_RESTART_COUNT" = 1 ]\n')
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "elasticrun", "--standalone", "--nproc-per-node=1", "--max-restarts=1",
        f"--log-dir={tmp_path / 'logs'}", "--no-python", "/bin/sh", str(script),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=clean_env(LOGLEVEL="DEBUG", PYTHONPATH=str(REPO)), start_new_session=True,
    )
    try:
        async with asyncio.timeout(60):
            out, err = await proc.communicate()
    finally:
        await kill_and_reap(proc)
    assert proc.returncode == 0, err.decode()
    assert "rank 0 restart 0" in out.decode() and "rank 0 restart 1" in out.decode()
    assert err.decode().count("workers start cold") == 1, err.decode()
    assert "standby workers" not in err.decode()


async def test_status_shows_standbys_and_agent_sigkill_leaves_none(tmp_path: Path) -> None:
    script = tmp_path / "start_facts.py"
    shutil.copy(SCRIPT, script)
    endpoint = f"127.0.0.1:{free_port()}"
    proc = await launch(tmp_path, script, "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=warm")
    try:
        assert proc.stderr is not None
        (line,) = await read_lines_until(proc.stderr, 1, READY, timeout=90)
        standbys = standby_pids(line)

        async def standby_shown() -> str:
            status = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "elasticrun", "status", f"--rdzv-endpoint={endpoint}", "--rdzv-id=warm",
                "--json", stdout=asyncio.subprocess.PIPE, env=clean_env(PYTHONPATH=str(REPO)),
            )
            out, _ = await status.communicate()
            (node,) = json.loads(out)["nodes"]
            return str((node["status"] or {}).get("standby"))

        async with asyncio.timeout(30):  # the node publishes its status a moment after the change
            while (shown := await standby_shown()) != "ready":
                assert shown in ("off", "starting"), shown
        workers = [json.loads((tmp_path / f"facts_0_{r}.json").read_text())["pid"] for r in (0, 1)]
        environ = Path(f"/proc/{standbys[0]}/environ").read_bytes().split(b"\0")
        (socket_path,) = [v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"ELASTICRUN_STANDBY=")]
        (warden,) = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                     if _child_running(pid, proc.pid, b"elasticrun.agent.warden")]
        os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()
        for pid in [*standbys.values(), *workers, warden]:
            await wait_pid_gone(pid, timeout=30)
        assert not Path(socket_path).parent.exists()  # the warden removed the standbys' socket
    finally:
        await kill_and_reap(proc)


async def run_past_standbys(tmp_path: Path, *flags: str, path: str = str(REPO)) -> tuple[int, bytes, bytes]:
    """Run start_facts.py's job with `flags`; once its standbys are ready, let it end.

    Its exit code, stdout and the rest of its stderr."""
    script = tmp_path / "start_facts.py"
    shutil.copy(SCRIPT, script)
    proc = await launch(tmp_path, script, *flags, path=path)
    try:
        assert proc.stderr is not None
        await read_lines_until(proc.stderr, 1, READY, timeout=90)
        (tmp_path / "go").touch()
        async with asyncio.timeout(90):
            out, rest = await proc.communicate()
    finally:
        await kill_and_reap(proc)
    return proc.returncode or 0, out, rest


@pytest.mark.slow  # a standby of its own, its script's CUDA faked; the other standby tests stay
async def test_standby_that_initialised_cuda_is_not_used(tmp_path: Path) -> None:
    workers = REPO / "tests" / "workers"
    code, _, rest = await run_past_standbys(
        tmp_path, "--warm-imports=torch,cuda_touched", path=f"{REPO}{os.pathsep}{workers}"
    )
    assert code == 0, rest.decode()
    assert "cannot be used (it initialised CUDA)" in rest.decode()
    started = [json.loads((tmp_path / f"facts_1_{r}.json").read_text()) for r in (0, 1)]
    assert [f["preloaded"] for f in started] == [False, False]  # cold, as the first round


def test_the_boot_and_the_agent_agree_on_the_standby_variables() -> None:
    """Read from the boot's source: importing it would run it in this process."""
    from elasticrun.agent import standby
    from elasticrun.agent.boot import BOOT_DIR

    tree = ast.parse((BOOT_DIR / "sitecustomize.py").read_text())
    constants = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id.isupper()
    }
    for name in ("STANDBY_ENV", "WARM_IMPORTS_ENV", "WARM_NICE_ENV"):
        assert constants[name] == getattr(standby, name), name


async def test_warm_worker_writes_its_log_files_and_the_console(tmp_path: Path) -> None:
    """--tee: a warm worker's stdout and stderr are its attempt's log files, followed to the console."""
    code, out, rest = await run_past_standbys(tmp_path, "--tee=3")
    assert code == 0, rest.decode()
    for rank in (0, 1):
        facts = json.loads((tmp_path / f"facts_1_{rank}.json").read_text())
        assert facts["preloaded"] is True
        stdout, stderr = facts["stdio"][1], facts["stdio"][2]
        assert stdout["kind"] == stderr["kind"] == "file"
        assert stdout["target"].endswith(f"attempt_1/{rank}/stdout.log"), stdout
        assert stderr["target"].endswith(f"attempt_1/{rank}/stderr.log"), stderr
        line = f"rank {rank} version 1 preloaded True"
        assert line in Path(stdout["target"]).read_text()
        assert f"[{rank}]<stdout>: {line}" in out.decode()
