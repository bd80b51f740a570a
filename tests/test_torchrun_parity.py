"""The same command under torchrun and under elasticrun: what the workers see (environment,
argv, interpreter, devices), what the console and the log folder show (prefixes, the
filtered files), exit codes, and torch's own worker-side features (the file timer, gloo).

torchrun is `python -m torch.distributed.run` of the installed torch (2.13). Each
comparison runs both launchers at once, with a plain-python probe as the worker. Where
elasticrun differs on purpose the test says so and asserts both sides (docs/migration.md
lists every torchrun flag and variable with its behaviour here).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_cli import (
    SPEAK,
    WORKERS,
    clean_env,
    finish,
    free_port,
    read_probes,
    start_cli,
    stop,
    wait_for_file,
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
#: documented in elasticrun/agent/env.py: our workers create their own store each round
DOCUMENTED = {"TORCHELASTIC_USE_AGENT_STORE"}


def launcher_vars(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(COMPARED_PREFIXES)}


def run_both(
    theirs: list[object], ours: list[object], *, env: dict[str, str] | None = None, cwd: Path | None = None
) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """torchrun with `theirs` and elasticrun with `ours`, at the same time."""
    procs = [start_cli(theirs, module=TORCHRUN, env=env, cwd=cwd), start_cli(ours, env=env, cwd=cwd)]
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
        assert o["TORCHELASTIC_SIGNALS_TO_HANDLE"] == t["TORCHELASTIC_SIGNALS_TO_HANDLE"]
        # and the user's environment passes through unchanged
        assert ours[rank]["PARITY_MARK"] == theirs[rank]["PARITY_MARK"] == "kept"
    return theirs, ours


def test_standalone_worker_environment_matches_torchrun(tmp_path: Path) -> None:
    out_t, out_o = tmp_path / "by-torchrun", tmp_path / "by-elasticrun"
    out_t.mkdir()
    out_o.mkdir()
    args = ["--standalone", "--nproc-per-node", "2", PROBE]
    results = run_both([*args, out_t], [*args, out_o], env=clean_env(PARITY_MARK="kept"))
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    theirs, ours = assert_same_worker_env(out_t, out_o, 2)
    # spelled out, so a change on either side shows here by name
    assert {k: v for k, v in launcher_vars(ours[1]).items() if k not in PER_RUN} == {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "1", "ROLE_WORLD_SIZE": "2",
        "ROLE_NAME": "default", "MASTER_ADDR": "localhost", "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    }
    assert ours[1]["OMP_NUM_THREADS"] == theirs[1]["OMP_NUM_THREADS"] == "1"


def test_static_backend_without_standalone_matches_torchrun(tmp_path: Path) -> None:
    """The default backend (static) with --master-port: same variables, same port given."""
    out_t, out_o = tmp_path / "by-torchrun", tmp_path / "by-elasticrun"
    out_t.mkdir()
    out_o.mkdir()
    # torchrun's static agent listens on its master port itself: one port each
    port_t, port_o = free_port(), free_port()
    env = clean_env(PARITY_MARK="kept")
    results = run_both(
        ["--nproc-per-node", "2", "--master-port", port_t, "--max-restarts", "2", PROBE, out_t],
        ["--nproc_per_node", "2", "--master_port", port_o, "--max_restarts", "2", PROBE, out_o],
        env=env,
    )
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


# --- flags that change how a worker starts: the same under both launchers ---------------

ARGV_PROBE = WORKERS / "cli_argv_probe.py"


def run_both_probes(
    tmp_path: Path, args: list[object], env: dict[str, str] | None = None, nproc: int = 2
) -> tuple[dict[int, dict[str, object]], dict[int, dict[str, object]]]:
    """`args` then an output folder, under torchrun and under elasticrun; what each rank wrote."""
    outs = tmp_path / "by-torchrun", tmp_path / "by-elasticrun"
    for out in outs:
        out.mkdir()
    results = run_both([*args, outs[0]], [*args, outs[1]], env=env, cwd=tmp_path)
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    found = read_probes(outs[0]), read_probes(outs[1])
    assert sorted(found[0]) == sorted(found[1]) == list(range(nproc))
    return found


@pytest.mark.parametrize("target", ["app", "sub/probe.py"])
def test_run_path_as_torchrun(tmp_path: Path, target: str) -> None:
    """--run-path: runpy.run_path semantics. A folder with __main__.py runs (from its
    folder), and a script does not get its own folder first on sys.path, as `python
    script` would give it: the launcher's is (here the working folder)."""
    for folder, name in (("app", "__main__.py"), ("sub", "probe.py")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text(ARGV_PROBE.read_text())
    theirs, ours = run_both_probes(tmp_path, ["--standalone", "--nproc-per-node", "2", "--run-path", target])
    for rank in (0, 1):
        assert ours[rank]["name"] == theirs[rank]["name"] == "__main__"
        # sys.argv is [script, *args] (the output folders differ by name)
        assert ours[rank]["argv"][0] == theirs[rank]["argv"][0] == target  # type: ignore[index]
        expected = "app" if target == "app" else str(tmp_path)
        assert ours[rank]["path0"] == theirs[rank]["path0"] == expected, (ours[rank], theirs[rank])


def test_python_exec_is_the_workers_interpreter_as_under_torchrun(tmp_path: Path) -> None:
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(f'#!/bin/sh\nWRAPPED_BY=wrapper exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    env = clean_env(PYTHON_EXEC=str(wrapper))
    theirs, ours = run_both_probes(tmp_path, ["--standalone", "--nproc-per-node", "2", ARGV_PROBE], env)
    assert {r["wrapped"] for r in theirs.values()} == {r["wrapped"] for r in ours.values()} == {"wrapper"}


@pytest.mark.parametrize("visible", [None, "5,7"])
def test_virtual_local_rank_as_torchrun(tmp_path: Path, visible: str | None) -> None:
    """LOCAL_RANK=0 and one device each: the local rank's entry of CUDA_VISIBLE_DEVICES."""
    env = clean_env() if visible is None else clean_env(CUDA_VISIBLE_DEVICES=visible)
    theirs, ours = run_both_probes(
        tmp_path, ["--standalone", "--nproc-per-node", "2", "--virtual-local-rank", ARGV_PROBE], env
    )
    for rank in (0, 1):
        seen = [(r[rank]["local_rank"], r[rank]["cuda_visible_devices"]) for r in (theirs, ours)]
        assert seen[0] == seen[1] == ("0", (visible or "0,1").split(",")[rank]), seen


def test_a_bad_flag_is_a_usage_error_under_both() -> None:
    args = ["--no-such-flag", "--standalone", EXIT_RANK, "0", "none"]
    theirs, ours = run_both(args, args)
    assert theirs.returncode == ours.returncode == 2, (theirs.stderr, ours.stderr)


def test_the_prefix_template_gives_torchruns_console_lines() -> None:
    """TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE with --tee (where torchrun prefixes): the
    same lines on stdout and on stderr."""
    env = clean_env(TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[${role_name}${rank}|${local_rank}]: ")
    args = ["--standalone", "--nproc-per-node", "2", "--tee", "3", SPEAK]
    theirs, ours = run_both(args, args, env=env)
    assert theirs.returncode == ours.returncode == 0, (theirs.stderr, ours.stderr)

    def worker_lines(text: str) -> list[str]:
        return sorted(line for line in text.splitlines() if " rank=" in line)

    assert worker_lines(ours.stdout) == worker_lines(theirs.stdout) == [
        "[default0|0]: out rank=0 attempt=0", "[default1|1]: out rank=1 attempt=0",
    ]
    assert worker_lines(ours.stderr) == worker_lines(theirs.stderr) == [
        "[default0|0]: err rank=0 attempt=0", "[default1|1]: err rank=1 attempt=0",
    ]


def test_the_file_timer_kills_a_worker_that_overruns_as_torchrun(tmp_path: Path) -> None:
    """TORCHELASTIC_ENABLE_FILE_TIMER=1 and torch's FileTimerClient in the worker: the
    overrunning worker is SIGKILLed. (torchrun's agent then SIGKILLs itself; ours fails
    the attempt as for any killed worker: exit 1 with the failure report.)"""
    env = clean_env(TORCHELASTIC_ENABLE_FILE_TIMER="1")
    fifos = tmp_path / "torchrun-rank0-done", tmp_path / "elasticrun-rank0-done"  # the two run at once
    for fifo in fifos:
        os.mkfifo(fifo)
    args = ["--standalone", "--nproc-per-node", "2", WORKERS / "cli_file_timer.py"]
    theirs, ours = run_both([*args, fifos[0]], [*args, fifos[1]], env=env)
    for result in (theirs, ours):
        assert "survived" not in result.stdout
        assert "fast step done" in result.stdout
    assert theirs.returncode == -9, theirs.stderr
    assert ours.returncode == 1, ours.stderr
    assert "file timer 'slow step' of worker pid" in ours.stderr and "SIGKILL" in ours.stderr
    assert "worker rank 1: its file timer 'slow step' expired: sent SIGKILL" in ours.stderr, ours.stderr


def test_the_health_check_port_answers_as_under_torchrun() -> None:
    """torchrun's health check server is a stub in PyTorch's build: nothing listens."""
    env = clean_env(TORCHELASTIC_HEALTH_CHECK_PORT=str(free_port()))
    args = ["--standalone", WORKERS / "cli_health_port.py"]
    theirs, ours = run_both(args, args, env=env)
    assert theirs.returncode == ours.returncode == 0, (theirs.stderr, ours.stderr)
    assert theirs.stdout.strip() == "health check port refused"
    assert ours.stdout.strip() == "[0]<stdout>: health check port refused"
    assert "no health check server started" in ours.stderr


def test_duplicate_filters_write_torchruns_filtered_files(tmp_path: Path) -> None:
    """The tee'd lines that match, with their prefix, in <attempt>/filtered_std*.log."""
    env = clean_env(TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[${rank}]: ")
    logs = tmp_path / "by-torchrun", tmp_path / "by-elasticrun"
    args = ["--standalone", "--nproc-per-node", "2", "--tee", "3",
            "--duplicate-stdout-filters", "rank=1,no,,such", "--duplicate-stderr-filters", "err rank"]
    theirs, ours = run_both([*args, "--log-dir", logs[0], SPEAK], [*args, "--log-dir", logs[1], SPEAK], env=env)
    assert theirs.returncode == ours.returncode == 0, (theirs.stderr, ours.stderr)
    for name, expected in (("filtered_stdout.log", ["[1]: out rank=1 attempt=0"]),
                           ("filtered_stderr.log", ["[0]: err rank=0 attempt=0", "[1]: err rank=1 attempt=0"])):
        found = [sorted(next(log.glob(f"*/attempt_0/{name}")).read_text().splitlines()) for log in logs]
        assert found[0] == found[1] == expected, found


def test_a_signalled_agent_exits_128_plus_n_where_torchrun_exits_1(tmp_path: Path) -> None:
    """The one exit code that differs on purpose (docs/cli.md#exit-codes): both stop
    their workers on SIGTERM; torchrun exits 1, elasticrun 143, retryable for a scheduler."""
    wait = tmp_path / "wait.py"
    wait.write_text("import pathlib, sys, time\npathlib.Path(sys.argv[1]).write_text('up')\ntime.sleep(60)\n")
    procs = []
    for name, module in (("torchrun", TORCHRUN), ("elasticrun", "elasticrun")):
        (tmp_path / f"by-{name}").mkdir()
        procs.append(start_cli(["--standalone", wait, tmp_path / f"by-{name}" / "ready"], module=module))
    try:
        for name, proc in zip(("torchrun", "elasticrun"), procs, strict=True):
            wait_for_file(tmp_path / f"by-{name}" / "ready", proc)
            os.kill(proc.pid, signal.SIGTERM)
        theirs, ours = (finish(p, timeout=60) for p in procs)
    finally:
        for proc in procs:
            stop(proc)
    assert theirs.returncode == 1, theirs.stderr
    assert ours.returncode == 128 + signal.SIGTERM, ours.stderr


def status_events(stderr: str) -> list[tuple[object, ...]]:
    """torchrun's event log lines (the console handler writes them to stderr), without
    the pids (torchrun records none for workers that did not fail)."""
    import json

    found = []
    for line in stderr.splitlines():
        if line.startswith('{"name": "torchelastic.worker.status.'):
            event = json.loads(line)
            meta = event["metadata"]
            detail = json.loads(meta["metadata"])
            detail.pop("worker_pid", None)
            found.append((event["name"], event["source"], meta["global_rank"], meta["group_rank"], meta["role"],
                          meta["rdzv_backend"] == "static", json.dumps(detail, sort_keys=True)))
    return sorted(found, key=str)


@pytest.mark.parametrize("fails", [False, True])
def test_event_log_handler_records_torchruns_status_events(fails: bool) -> None:
    """--event-log-handler=console: the same events through torch's own event log. One
    difference on purpose: when the workers failed, torchrun's agent event still says
    SUCCEEDED (its run returned), ours FAILED. The rank that does not fail waits to be
    stopped: whether it is still running when the failure is seen decides its event
    (FAILED with its SIGTERM exit, or TERMINATED), under torchrun as here."""
    args = ["--standalone", "--nproc-per-node", "2", "--event-log-handler", "console",
            EXIT_RANK, *(("3", "1", "wait") if fails else ("0", "1"))]
    theirs, ours = run_both(args, args)
    assert theirs.returncode == ours.returncode == (1 if fails else 0), (theirs.stderr, ours.stderr)
    mine, torchruns = status_events(ours.stderr), status_events(theirs.stderr)
    if fails:
        agent_end = [e for e in torchruns if e[1] == "AGENT" and e[0].endswith(".SUCCEEDED")]
        torchruns = [e for e in torchruns if e not in agent_end]
        assert len(agent_end) == 1
        assert ("torchelastic.worker.status.FAILED", "AGENT") in {(e[0], e[1]) for e in mine}
        mine = [e for e in mine if not (e[1] == "AGENT" and e[0].endswith(".FAILED"))]
    assert mine == torchruns and len(mine) >= 6, (mine, torchruns)


def test_an_event_log_handler_torch_does_not_know_is_a_usage_error() -> None:
    result = finish(start_cli(["--standalone", "--event-log-handler", "nowhere", EXIT_RANK, "0", "1"]))
    assert result.returncode == 2, result.stderr
    assert "--event-log-handler: torch knows no handler 'nowhere'" in result.stderr


CUSTOM_LOGS_SPECS = '''
import os
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, LogsDest


class FlatLogs(DefaultLogsSpecs):
    """Every worker's stdout to <log_dir>/flat/rank<local rank>.out, stderr to the console."""

    def reify(self, envs):
        folder = os.path.join(self.root_log_dir, "flat")
        os.makedirs(folder, exist_ok=True)
        ranks = sorted(envs)
        outs = {r: os.path.join(folder, f"rank{r}.out") for r in ranks}
        errors = {r: os.path.join(folder, f"error{r}.json") for r in ranks}
        for r in ranks:
            envs[r]["TORCHELASTIC_ERROR_FILE"] = errors[r]
        return LogsDest(outs, {r: "" for r in ranks}, {}, {}, errors)
'''


#: the agent's own files in its run folder, which torchrun has no counterpart of: its
#: event log, and each worker's stack file (the stacks a hang or `elasticrun stacks` captured)
AGENT_FILES = ("events.jsonl", "stacks")


@pytest.mark.parametrize("name", ["default", "flat"])
def test_logs_specs_lays_out_the_logs_as_under_torchrun(tmp_path: Path, name: str) -> None:
    """torch's own `default` entry point, and one of a package's (a dist-info on the path)."""
    plugin = tmp_path / "plugin"
    (plugin / "flat_logs-1.0.dist-info").mkdir(parents=True)
    (plugin / "flat_logs.py").write_text(CUSTOM_LOGS_SPECS)
    info = plugin / "flat_logs-1.0.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flat-logs\nVersion: 1.0\n")
    (plugin / "flat_logs-1.0.dist-info" / "entry_points.txt").write_text(
        "[torchrun.logs_specs]\nflat = flat_logs:FlatLogs\n")
    env = clean_env(PYTHONPATH=f"{plugin}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    logs = tmp_path / "by-torchrun", tmp_path / "by-elasticrun"
    args = ["--standalone", "--nproc-per-node", "2", "--redirects", "1", "--logs-specs", name]
    theirs, ours = run_both([*args, "--log-dir", logs[0], SPEAK], [*args, "--log-dir", logs[1], SPEAK], env=env)
    assert theirs.returncode == ours.returncode == 0, (theirs.stderr, ours.stderr)

    def files(root: Path) -> dict[str, str]:
        found = {}
        for path in sorted(root.rglob("*")):
            if path.is_file() and path.name not in AGENT_FILES:
                # the run's own folder name differs by nature (a fresh run id)
                found[str(path.relative_to(root)).split("/", 1)[-1] if name == "default" else
                      str(path.relative_to(root))] = path.read_text()
        return found

    assert files(logs[1]) == files(logs[0]) and files(logs[0]), (files(logs[0]), files(logs[1]))
    shown = "attempt_0/1/stdout.log" if name == "default" else "flat/rank1.out"
    assert "out rank=1 attempt=0" in files(logs[1])[shown]
