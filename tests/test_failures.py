"""The failure report, from exit records, error files and stderr tails."""

from __future__ import annotations

from pathlib import Path

from elasticrun.agent.failures import (
    ErrorFile,
    WorkerFailure,
    describe_exit,
    make_failure,
    make_report,
    parse_error_file,
    traceback_from_stderr,
)
from elasticrun.agent.processes import WorkerExit

# Written by torch 2.13's @record for `raise ValueError("boom here")`.
TORCH_ERROR_FILE = (
    '{"message": {"message": "ValueError: boom here", "extraInfo": {"py_callstack": '
    '"Traceback (most recent call last):\\n  File \\"/tmp/probe/rec.py\\", line 4, in '
    'main\\n    raise ValueError(\\"boom here\\")\\nValueError: boom here\\n", '
    '"timestamp": "1795282986"}}}'
)


def test_exit_descriptions_name_signals_and_their_usual_cause() -> None:
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-9) == "SIGKILL (-9), often the out-of-memory killer"
    assert describe_exit(-11).startswith("SIGSEGV (-11)")
    assert describe_exit(-10) == "SIGUSR1 (-10)"
    assert describe_exit(-200) == "signal 200 (-200)"


def test_error_file_in_torch_format_is_parsed() -> None:
    parsed = parse_error_file(TORCH_ERROR_FILE)
    assert parsed is not None
    assert parsed.message == "ValueError: boom here"
    assert parsed.traceback.startswith("Traceback (most recent call last):")
    assert parsed.traceback.endswith("ValueError: boom here\n")
    assert parse_error_file('{"message": "plain"}') == ErrorFile("plain", "")
    assert parse_error_file("not json") is None
    assert parse_error_file("[1, 2]") is None


def test_stderr_traceback_keeps_chained_exceptions_and_drops_earlier_noise() -> None:
    lines = [
        "warning: something",
        "Traceback (most recent call last):",
        '  File "old.py", line 1, in <module>',
        "KeyError: 'logged earlier'",
        "epoch 3",
        "Traceback (most recent call last):",
        '  File "t.py", line 2, in load',
        "OSError: disk",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "Traceback (most recent call last):",
        '  File "t.py", line 5, in <module>',
        "RuntimeError: cannot load",
    ]
    text = traceback_from_stderr(lines)
    assert text.startswith("Traceback (most recent call last):\n  File \"t.py\", line 2")
    assert text.endswith("RuntimeError: cannot load")
    assert "logged earlier" not in text
    plain = [f"line {i}" for i in range(50)]
    assert traceback_from_stderr(plain) == "\n".join(plain[-20:])


def _failure(local_rank: int, t: float, returncode: int, tail: list[str],
             error: ErrorFile | None = None) -> WorkerFailure:
    return make_failure(
        WorkerExit(local_rank, pid=100 + local_rank, returncode=returncode, time=t,
                   stopped=False),
        node_id="hostA_1",
        node_rank=2,
        rank_offset=8,
        error_file=Path(f"/logs/attempt_0/{local_rank}/error.json"),
        error=error,
        stderr_tail=tail,
    )


def test_report_root_cause_is_the_earliest_failure_with_its_traceback() -> None:
    late = _failure(0, 1000.5, 1, ["Traceback (most recent call last):", "X: late"])
    early = _failure(3, 1000.2, -9, ["loading data"])
    recorded = _failure(
        1, 1000.3, 1, ["noise"], parse_error_file(TORCH_ERROR_FILE)
    )
    report = make_report([late, early, recorded], title="job 'j' failed: train.py")
    assert report.root_cause == early
    assert report.others == (recorded, late)
    text = report.text
    assert "job 'j' failed: train.py" in text
    assert "rank      : 11 (local rank 3)" in text
    assert "node      : 2 (hostA_1)" in text
    assert "exit      : SIGKILL (-9), often the out-of-memory killer" in text
    assert "traceback (from stderr):\n    loading data" in text
    assert "rank 9 (local rank 1, node 2): exit code 1 at " in text
    assert "rank 8 (local rank 0, node 2): exit code 1 at " in text
    assert recorded.traceback_source == "/logs/attempt_0/1/error.json"
    assert "raise ValueError" in recorded.traceback
