"""bench/gpu_check.py, the check a session with a lent GPU runs: it parses, and every
row runs here in its CPU variant (no GPU on these machines), each bounded, the rows
that need a GPU skipped, so that the GPU session finds a script that works."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticrun.agent.gpu import open_gpus

pytestmark = pytest.mark.timeout(600)

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
ROWS = ["nproc-gpu", "health", "reclaim", "inprocess", "lightning", "state", "waits", "standby"]


def check(*args: str, timeout: float = 60, tmp: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TMPDIR=str(tmp)) if tmp is not None else None  # where its logs go
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_help_and_dry_run_name_every_row_within_11_minutes() -> None:
    helped = check("--help")
    assert helped.returncode == 0 and all(row in helped.stdout for row in ROWS)
    dry = check("--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert [line.split()[0] for line in dry.stdout.splitlines()[:-1]] == ROWS
    total = float(re.fullmatch(r"in all at most (\d+) s", dry.stdout.splitlines()[-1]).group(1))
    assert total < 11 * 60
    bad = check("--rows", "reclaim,nosuchrow")
    assert bad.returncode == 2 and "unknown ['nosuchrow']" in bad.stderr


@pytest.mark.slow  # every row's CPU variant, one after another; the dry run above checks the script
def test_every_row_runs_here(tmp_path: Path) -> None:
    gpus = open_gpus()
    try:
        has_gpu = gpus.count > 0
    finally:
        gpus.close()
    out = tmp_path / "rows.json"
    done = check("--json", str(out), timeout=9 * 60, tmp=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ROWS
    expected = {row: "ok" for row in ROWS} | ({} if has_gpu else {"nproc-gpu": "skipped"})
    assert {name: r["status"] for name, r in rows.items()} == expected, done.stdout
    # each row printed its line as it ended, then the table, then where the logs are
    for row in ROWS:
        assert re.search(rf"^\[{row}\] {expected[row]} \(\d+ s\): ", done.stdout, re.M), done.stdout
    assert re.search(r"^ROW +STATUS +SECONDS +FIGURE$", done.stdout, re.M)
    logs = Path(re.search(r"^logs: (.*)$", done.stdout, re.M).group(1))
    assert logs.parent == tmp_path and (logs / "reclaim" / "reclaim.log").exists()
    if not has_gpu:
        assert "the next worker ran" in rows["reclaim"]["figure"]
        assert rows["inprocess"]["figure"].startswith("gloo group broken")
        assert "resumed from step 20" in rows["lightning"]["figure"]
        assert "exactly from own memory" in rows["state"]["figure"]
        assert "DDP steps timed from the optimizer (gloo)" in rows["waits"]["figure"]
        assert "warm (the standby)" in rows["standby"]["figure"]


def test_a_gpu_with_a_cpu_build_of_torch_fails_the_torch_rows_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a GPU session would meet with the wrong torch: one line, no time lost."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # its dataclasses look their module up
    monkeypatch.setattr(sys, "path", list(sys.path))  # it puts bench/ first, for bench/common.py
    spec.loader.exec_module(module)
    gpu = module.Gpu(1, "NVIDIA H100 80GB HBM3", software="python 3.11.7, torch 2.13.0+cpu, CUDA None")
    ctx = module.Context(gpu, tmp_path, time.monotonic() + 60)
    for row in (module.row_reclaim, module.row_inprocess, module.row_lightning):
        with pytest.raises(module.RowFailed, match=r"this torch cannot use it .*: install a CUDA build of torch"):
            row(ctx)
    assert ctx.tracker.procs == []  # nothing was started
