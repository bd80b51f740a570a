"""`elasticrun.launch`: the launcher as a library, with function and script entrypoints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import elasticrun
from elasticrun.errors import EXIT_TRAINING_FAILED, UsageError
from tests.support import api_targets
from tests.support.helpers import free_port
from tests.test_cli import SPEAK, clean_env

pytestmark = pytest.mark.timeout(90)

REPO = Path(__file__).resolve().parents[1]


def test_a_function_returns_each_ranks_value() -> None:
    values = elasticrun.launch(api_targets.square_rank, 10, standalone=True, nproc_per_node=3)
    assert values == {
        rank: {"value": rank * rank + 10, "world": "3", "local": str(rank)} for rank in range(3)
    }


def test_a_script_runs_with_its_arguments(tmp_path: Path) -> None:
    script = tmp_path / "touch.py"
    script.write_text("import os, sys\nopen(os.path.join(sys.argv[1], 'rank' + os.environ['RANK']), 'w').close()\n")
    assert elasticrun.launch(str(script), tmp_path, standalone=True, nproc_per_node=2) == {0: None, 1: None}
    assert sorted(p.name for p in tmp_path.glob("rank*")) == ["rank0", "rank1"]


def test_a_failure_carries_the_root_cause_report() -> None:
    with pytest.raises(elasticrun.WorkersFailed) as failed:
        elasticrun.launch(api_targets.fail_on_rank, 1, standalone=True, nproc_per_node=2)
    report = failed.value.report
    assert report is not None and failed.value.exit_code == EXIT_TRAINING_FAILED
    assert report.root_cause.global_rank == 1
    assert "ValueError: rank 1 gives up" in report.root_cause.traceback
    assert "Root cause" in str(failed.value)


def test_a_failure_names_the_function_and_shows_the_users_frames_only() -> None:
    with pytest.raises(elasticrun.WorkersFailed) as failed:
        elasticrun.launch(api_targets.fail_on_rank, 0, standalone=True, nproc_per_node=1)
    report = failed.value.report
    assert report is not None
    assert report.text.splitlines()[1].endswith("failed: tests.support.api_targets:fail_on_rank")
    frames = [line for line in report.root_cause.traceback.splitlines() if line.lstrip().startswith("File ")]
    assert len(frames) == 1 and "api_targets.py" in frames[0] and "in fail_on_rank" in frames[0], frames
    assert report.root_cause.traceback_source.endswith("error.json")  # torch's error file format


QUIET = """\
import logging, sys
import elasticrun
from tests.support import api_targets
for ask in (False, True):
    if ask:
        print("--- logging configured", file=sys.stderr, flush=True)
        logging.basicConfig(level=logging.INFO)
    try:
        elasticrun.launch(api_targets.fail_on_rank, 0, standalone=True, nproc_per_node=1)
    except elasticrun.WorkersFailed as e:
        print(e.report.root_cause.global_rank)
"""


def test_the_library_prints_nothing_of_its_own_unless_asked(tmp_path: Path) -> None:
    """The failure is raised, not also printed; the agent's lines appear once the
    application configures logging. The workers' own output is theirs, and shown."""
    script = tmp_path / "quiet.py"
    script.write_text(QUIET)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env=clean_env(PYTHONPATH=str(REPO)), cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, "0\n0\n"), done.stderr
    unasked, asked = done.stderr.split("--- logging configured\n")
    assert [line for line in unasked.splitlines() if not line.startswith("[0]<stderr>: ")] == [], unasked
    assert "ValueError: rank 0 gives up" in unasked  # the worker's own stderr
    assert "Root cause (first failure):" in asked and "workers init -> failed" in asked, asked


def test_restarts_and_the_values_of_the_attempt_that_succeeded() -> None:
    values = elasticrun.launch(api_targets.fail_first_attempt, standalone=True, nproc_per_node=2, max_restarts=1)
    assert values == {0: "attempt 1", 1: "attempt 1"}


def test_an_elastic_c10d_rendezvous() -> None:
    values = elasticrun.launch(
        api_targets.square_rank, 0, nnodes="1:2", nproc_per_node=2, rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id="api", rdzv_conf={"last_call_timeout": 0.1},
    )
    assert {rank: v["value"] for rank, v in values.items()} == {0: 0, 1: 1}


def test_a_function_of_the_launching_script(tmp_path: Path) -> None:
    """Defined in __main__, found by the workers as multiprocessing's spawn finds it."""
    script = tmp_path / "main.py"
    script.write_text(
        "import os, elasticrun\n"
        "def hello(name):\n"
        "    return f'hello {name} from {os.environ[\"RANK\"]}'\n"
        "if __name__ == '__main__':\n"
        "    print(sorted(elasticrun.launch(hello, 'api', standalone=True, nproc_per_node=2).items()))\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env=clean_env(PYTHONPATH=str(REPO)), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[(0, 'hello api from 0'), (1, 'hello api from 1')]"


def test_bad_input_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="unknown flag 'nprocs'"):
        elasticrun.launch(api_targets.square_rank, 0, standalone=True, nprocs=2)
    with pytest.raises(UsageError, match="top level"):
        elasticrun.launch(lambda: 0, standalone=True)
    with pytest.raises(UsageError, match="--nnodes must be N or MIN:MAX"):
        elasticrun.launch(str(SPEAK), standalone=True, nnodes="x")


def test_a_training_script_loads_neither_the_api_nor_the_launcher() -> None:
    code = ("import sys, elasticrun.worker\n"
            "print(sorted(m for m in sys.modules if m.startswith(('elasticrun.api', 'elasticrun.launcher'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                          env=clean_env(PYTHONPATH=str(REPO)))
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
