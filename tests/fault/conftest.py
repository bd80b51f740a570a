"""Fixtures of the fault-injection suite (tests/fault/).

`reliability` records one row per scenario for RELIABILITY.md. A test calls

    reliability.record(
        scenario="partition one node",        # short name, the row's first column
        injected="cut the veth link of node c for 12 s",
        happened="a, b continued at world 2; c stopped its workers; c rejoined",
        recovery_s=3.4,                       # float seconds or None (not applicable)
        restarts=0,                           # restart budget spent (int) or None
        lost="nothing",                       # what was lost ("nothing", "3 steps", ...)
        **extra,                              # any other JSON-able figures, kept in the row
    )

(once or several times; each call is one row). `reliability.clock()` gives a monotonic
stopwatch: `t = reliability.clock(); ...; t()` is the seconds since. Rows are written
only when the environment variable ELASTICRUN_RELIABILITY_OUT names a file (JSON lines,
appended): `python scripts/reliability.py` sets it, runs `pytest tests/fault` and renders
the rows into RELIABILITY.md. Each row is written when the test ends, with its outcome
("passed", "failed", ...), its node id and its duration; recording never fails a test.

Markers: `soak` marks a long run excluded by default; run it with
`ELASTICRUN_SOAK=1 python -m pytest tests/fault -m soak` (or `-m soak` alone).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

OUT_VAR = "ELASTICRUN_RELIABILITY_OUT"
SOAK_VAR = "ELASTICRUN_SOAK"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"soak: a long fault soak, skipped unless {SOAK_VAR}=1 or -m soak")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(SOAK_VAR) == "1" or "soak" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason=f"soak test: set {SOAK_VAR}=1 or pass -m soak")
    for item in items:
        if item.get_closest_marker("soak") is not None:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[Any]:
    report = yield
    # the worst outcome of setup/call/teardown so far, for the rows written at teardown
    if report.when == "call" or report.failed:
        item.stash[_OUTCOME] = report.outcome if report.when == "call" else f"{report.outcome} ({report.when})"
    return report


_OUTCOME = pytest.StashKey[str]()


class Reliability:
    """Rows of one test for RELIABILITY.md (see the module docstring)."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid
        self.rows: list[dict[str, Any]] = []
        self.started = time.monotonic()

    @staticmethod
    def clock() -> Callable[[], float]:
        t0 = time.monotonic()
        return lambda: round(time.monotonic() - t0, 2)

    def record(
        self,
        *,
        scenario: str,
        injected: str,
        happened: str,
        recovery_s: float | None = None,
        restarts: int | None = None,
        lost: str = "nothing",
        **extra: Any,
    ) -> dict[str, Any]:
        row = {
            "scenario": scenario,
            "injected": injected,
            "happened": happened,
            "recovery_s": None if recovery_s is None else round(float(recovery_s), 2),
            "restarts": restarts,
            "lost": lost,
            **extra,
        }
        self.rows.append(row)
        return row

    def flush(self, outcome: str) -> None:
        out = os.environ.get(OUT_VAR)
        if not out or not self.rows:
            return
        duration = round(time.monotonic() - self.started, 1)
        try:
            with open(Path(out), "a", encoding="utf-8") as f:
                for row in self.rows:
                    f.write(json.dumps({**row, "test": self.nodeid, "outcome": outcome, "test_s": duration}, default=str) + "\n")
        except OSError:
            pass  # recording never fails a test


@pytest.fixture
def reliability(request: pytest.FixtureRequest) -> Iterator[Reliability]:
    rec = Reliability(request.node.nodeid)
    yield rec
    rec.flush(request.node.stash.get(_OUTCOME, "unknown"))
