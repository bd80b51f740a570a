"""Worker output: rank prefixes, whole lines, redirects/tee files, the ranks filter."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticrun.agent.output import MAX_LINE, WorkerOutput, _split_lines, plan_streams
from elasticrun.agent.processes import WorkerGroup
from elasticrun.agent.spec import Std
from tests.agent_helpers import make_spec, write_script


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


async def _run_workers(script: Path, plans_for: dict[int, dict], offset: int = 4) -> dict:
    group = await WorkerGroup.start(
        [sys.executable, "-u", str(script)],
        {r: {"RANK": str(offset + r)} for r in plans_for},
    )
    outputs = {}
    try:
        for local_rank, proc in group.procs.items():
            assert proc.stdout is not None and proc.stderr is not None
            outputs[local_rank] = WorkerOutput(
                proc.stdout, proc.stderr, offset + local_rank, plans_for[local_rank]
            )
        await group.wait()
    finally:
        await group.stop(grace=5)
        for output in outputs.values():
            await output.drain(timeout=10)
    return outputs


async def test_console_lines_are_whole_and_prefixed_with_the_global_rank(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = write_script(tmp_path, "chatty.py", _CHATTY)
    spec = make_spec(script, nproc_per_node=2)
    plans = {r: plan_streams(spec, r, tmp_path / str(r)) for r in (0, 1)}
    outputs = await _run_workers(script, plans)
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
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = write_script(tmp_path, "chatty.py", _CHATTY)
    spec = make_spec(
        script, nproc_per_node=2, redirects={0: Std.ALL}, tee={1: Std.ERR}
    )
    for r in (0, 1):
        (tmp_path / str(r)).mkdir()
    plans = {r: plan_streams(spec, r, tmp_path / str(r)) for r in (0, 1)}
    outputs = await _run_workers(script, plans, offset=0)
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
