"""A restart budget that forgives progress (--forgive-progress): a worker
failure spends a restart only when the workers made no progress since the previous one.

The agent with real worker processes, on the static rendezvous and on the elastic one
over an in-memory store (`--standalone`, the leader's round decision included).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from elasticrun.agent.agent import Action, Agent, Outcome, next_action
from elasticrun.agent.spec import WorkerState
from tests.support.agent_helpers import make_spec, static_for, write_script
from tests.support.helpers import ELASTICRUN

pytestmark = pytest.mark.timeout(120)


def test_policy_forgives_a_failure_after_progress_even_with_the_budget_spent() -> None:
    assert next_action(Outcome.FAILED, 1, 1, progressed=True) is Action.RESTART
    assert next_action(Outcome.BROKEN, 5, 1, progressed=True) is Action.RESTART
    assert next_action(Outcome.FAILED, 1, 1, progressed=False) is Action.FAIL


def _flaky(tmp_path: Path, *, progress: bool, failures: int) -> Path:
    """A worker that fails its first `failures` runs (after a few heartbeats when
    `progress`), then succeeds; each run appends its restart count to `runs`."""
    beat = "for _ in range(3): heartbeat(); time.sleep(0.05)" if progress else "pass"
    return write_script(
        tmp_path,
        "flaky.py",
        f"""
        import os, sys, time
        from elasticrun.worker.progress import heartbeat
        runs = {str(tmp_path / "runs")!r}
        with open(runs, "a") as f:
            f.write(os.environ["TORCHELASTIC_RESTART_COUNT"] + "\\n")
        {beat}
        done = len(open(runs).read().split())
        sys.exit(5 if done <= {failures} else 0)
        """,
    )


async def test_three_failures_spaced_by_progress_survive_one_restart(tmp_path: Path) -> None:
    script = _flaky(tmp_path, progress=True, failures=3)
    spec = make_spec(script, max_restarts=1, forgive_heartbeat=True, log_dir=tmp_path / "logs")
    agent = Agent(spec, static_for(spec))
    result = await agent.run()
    assert result.state is WorkerState.SUCCEEDED, result.message
    assert (tmp_path / "runs").read_text().split() == ["0", "1", "2", "3"]
    events = [json.loads(line) for line in (agent.run_dir / "events.jsonl").read_text().splitlines()]
    assert sum("restarting (forgiven: every worker made progress" in e["detail"] for e in events) == 3


async def test_a_crash_loop_still_stops_after_the_budget(tmp_path: Path) -> None:
    script = _flaky(tmp_path, progress=False, failures=100)
    spec = make_spec(script, max_restarts=1, forgive_heartbeat=True, log_dir=tmp_path / "logs")
    result = await Agent(spec, static_for(spec)).run()
    assert result.state is WorkerState.FAILED and result.exit_code == 1
    assert (tmp_path / "runs").read_text().split() == ["0", "1"]  # two failures, then it stops


async def test_a_window_of_running_counts_as_progress(tmp_path: Path) -> None:
    script = _flaky(tmp_path, progress=True, failures=2)  # 0.15 s of running each time
    spec = make_spec(script, max_restarts=0, forgive_after=0.1, log_dir=tmp_path / "logs")
    result = await Agent(spec, static_for(spec)).run()
    assert result.state is WorkerState.SUCCEEDED, result.message


def _standalone(tmp_path: Path, script: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    argv = [*ELASTICRUN, "--standalone", "--max-restarts=1", f"--log-dir={tmp_path / 'logs'}",
            *flags, str(script)]
    # LOGLEVEL=INFO: the leader's reasons (a forgiven restart) are not headlines
    return subprocess.run(argv, capture_output=True, text=True, timeout=100, env={**os.environ, "LOGLEVEL": "INFO"})


def test_elastic_rounds_count_forgiven_restarts_apart(tmp_path: Path) -> None:
    done = _standalone(tmp_path, _flaky(tmp_path, progress=True, failures=3), "--forgive-progress=heartbeat")
    assert done.returncode == 0, done.stderr[-3000:]
    # TORCHELASTIC_RESTART_COUNT still counts every restart; the budget only the unforgiven
    assert (tmp_path / "runs").read_text().split() == ["0", "1", "2", "3"]
    assert "(forgiven: the workers had made progress)" in done.stderr


def test_elastic_crash_loop_stops_after_two_failures(tmp_path: Path) -> None:
    done = _standalone(tmp_path, _flaky(tmp_path, progress=False, failures=100), "--forgive-progress=heartbeat")
    assert done.returncode == 1, done.stderr[-3000:]
    assert (tmp_path / "runs").read_text().split() == ["0", "1"]


def test_without_the_option_progress_is_not_forgiven(tmp_path: Path) -> None:
    done = _standalone(tmp_path, _flaky(tmp_path, progress=True, failures=3))
    assert done.returncode == 1
    assert (tmp_path / "runs").read_text().split() == ["0", "1"]


def test_bad_value_is_one_usage_line(tmp_path: Path) -> None:
    done = _standalone(tmp_path, tmp_path / "x.py", "--forgive-progress=often")
    assert done.returncode == 2
    assert "--forgive-progress takes heartbeat or a positive number of seconds, got 'often'" in done.stderr
