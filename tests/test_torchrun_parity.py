"""The same command under torchrun and under elasticrun: same worker environment, same exit
codes, and torch's own distributed setup works in our workers.

torchrun is `python -m torch.distributed.run` of the installed torch (2.13). Each
comparison runs both launchers at once, with a plain-python probe as the worker.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.test_cli import (
    WORKERS,
    clean_env,
    finish,
    free_port,
    read_probes,
    start_cli,
    stop,
)

PROBE = WORKERS / "cli_env_probe.py"
EXIT_RANK = WORKERS / "cli_exit_rank.py"
GLOO = WORKERS / "cli_gloo_check.py"
TORCHRUN = "torch.distributed.run"

pytestmark = pytest.mark.timeout(90)

#: the variables the launchers set for a worker
COMPARED_PREFIXES = ("RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC_", "GROUP_", "ROLE_", "LOCAL_")
#: different on every run by nature: a free port, a fresh run id, a temporary folder
PER_RUN = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
#: documented in elasticrun/agent/env.py: our workers create their own store each round,
#: and torchrun's own signal list only reaches its workers by inheritance
DOCUMENTED = {"TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_SIGNALS_TO_HANDLE"}


def launcher_vars(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(COMPARED_PREFIXES)}


def run_both(
    theirs: list[object], ours: list[object]
) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """torchrun with `theirs` and elasticrun with `ours`, at the same time."""
    procs = [start_cli(theirs, module=TORCHRUN), start_cli(ours)]
    try:
        return finish(procs[0], timeout=60), finish(procs[1], timeout=60)
    finally:
        for proc in procs:
            stop(proc)


def assert_same_worker_env(
    torchrun_out: Path, ours_out: Path, nproc: int
) -> tuple[dict[int, dict[str, str]], dict[int, dict[str, str]]]:
    theirs, ours = read_probes(torchrun_out), read_probes(ours_out)
    assert sorted(theirs) == sorted(ours) == list(range(nproc))
    for rank in range(nproc):
        t, o = launcher_vars(theirs[rank]), launcher_vars(ours[rank])
        assert {k: v for k, v in o.items() if k not in PER_RUN | DOCUMENTED} == {
            k: v for k, v in t.items() if k not in PER_RUN | DOCUMENTED
        }, f"rank {rank}"
        # the per-run values are there in both, of the same shape
        for env in (t, o):
            assert PER_RUN <= env.keys()
            assert env["MASTER_PORT"].isdigit()
            assert env["TORCHELASTIC_RUN_ID"]
            assert re.search(rf"/attempt_0/{rank}/error\.json$", env["TORCHELASTIC_ERROR_FILE"])
        assert o["MASTER_PORT"] == ours[0]["MASTER_PORT"]
        assert o["TORCHELASTIC_RUN_ID"] == ours[0]["TORCHELASTIC_RUN_ID"]
        # the documented differences, exactly
        assert t["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert o["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert "TORCHELASTIC_SIGNALS_TO_HANDLE" not in o
        # and the user's environment passes through unchanged
        assert ours[rank]["PARITY_MARK"] == theirs[rank]["PARITY_MARK"] == "kept"
    return theirs, ours


def test_standalone_worker_environment_matches_torchrun(tmp_path: Path) -> None:
    out_t, out_o = tmp_path / "torchrun", tmp_path / "elasticrun"
    out_t.mkdir()
    out_o.mkdir()
    args = ["--standalone", "--nproc-per-node", "2", PROBE]
    procs = [
        start_cli([*args, out_t], module=TORCHRUN, env=clean_env(PARITY_MARK="kept")),
        start_cli([*args, out_o], env=clean_env(PARITY_MARK="kept")),
    ]
    try:
        results = [finish(p, timeout=60) for p in procs]
    finally:
        for proc in procs:
            stop(proc)
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    theirs, ours = assert_same_worker_env(out_t, out_o, 2)
    # spelled out, so a change on either side shows here by name
    assert {k: v for k, v in launcher_vars(ours[1]).items() if k not in PER_RUN} == {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "1", "ROLE_WORLD_SIZE": "2",
        "ROLE_NAME": "default", "MASTER_ADDR": "localhost", "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
    assert ours[1]["OMP_NUM_THREADS"] == theirs[1]["OMP_NUM_THREADS"] == "1"


def test_static_backend_without_standalone_matches_torchrun(tmp_path: Path) -> None:
    """The default backend (static) with --master-port: same variables, same port given."""
    out_t, out_o = tmp_path / "torchrun", tmp_path / "elasticrun"
    out_t.mkdir()
    out_o.mkdir()
    # torchrun's static agent listens on its master port itself: one port each
    port_t, port_o = free_port(), free_port()
    env = clean_env(PARITY_MARK="kept")
    procs = [
        start_cli(["--nproc-per-node", "2", "--master-port", port_t, "--max-restarts", "2", PROBE,
                   out_t], module=TORCHRUN, env=env),
        start_cli(["--nproc_per_node", "2", "--master_port", port_o, "--max_restarts", "2", PROBE,
                   out_o], env=env),
    ]
    try:
        results = [finish(p, timeout=60) for p in procs]
    finally:
        for proc in procs:
            stop(proc)
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    theirs, ours = assert_same_worker_env(out_t, out_o, 2)
    for rank in (0, 1):
        assert theirs[rank]["MASTER_PORT"] == str(port_t)
        assert ours[rank]["MASTER_PORT"] == str(port_o)
        assert ours[rank]["MASTER_ADDR"] == theirs[rank]["MASTER_ADDR"] == "127.0.0.1"
        assert ours[rank]["TORCHELASTIC_RUN_ID"] == theirs[rank]["TORCHELASTIC_RUN_ID"] == "none"
        assert ours[rank]["TORCHELASTIC_MAX_RESTARTS"] == "2"


@pytest.mark.parametrize(("how", "reported"), [("3", "exit code 3"), ("SIGKILL", "SIGKILL")])
def test_a_failing_worker_gives_torchruns_exit_code(how: str, reported: str) -> None:
    args = ["--standalone", "--nproc-per-node", "2", EXIT_RANK, how, "1"]
    theirs, ours = run_both(args, args)
    assert theirs.returncode == 1, theirs.stderr
    assert ours.returncode == theirs.returncode, ours.stderr
    # the root cause names how the worker ended
    assert reported in ours.stderr
    assert "Traceback" not in ours.stderr


def test_a_successful_job_exits_0_as_torchrun() -> None:
    args = ["--standalone", "--nproc-per-node", "2", EXIT_RANK, "3", "none"]
    theirs, ours = run_both(args, args)
    assert theirs.returncode == ours.returncode == 0, (theirs.stderr, ours.stderr)


def test_torch_sees_torchelastic_and_runs_gloo_all_reduce() -> None:
    proc = start_cli(["--standalone", "--nproc-per-node", "2", GLOO])
    try:
        result = finish(proc, timeout=80)
    finally:
        stop(proc)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "[0]<stdout>: rank 0/2 all_reduce 3 expected 3" in lines, result.stdout
    assert "[1]<stdout>: rank 1/2 all_reduce 3 expected 3" in lines, result.stdout
