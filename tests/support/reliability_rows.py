"""RELIABILITY.md's rows, recorded by the tests that show a fault or an attack.

The `reliability` fixture records one row per scenario for RELIABILITY.md. A test calls

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
appended): `python scripts/reliability.py` sets it, runs the tests and renders
the rows into RELIABILITY.md. Each row is written when the test ends, with its outcome
("passed", "failed", ...), its node id and its duration; recording never fails a test.
A test that fails before recording anything still gets a row, saying why it failed.

A row with `part="security"` goes to the security table (an attack or a mistake tried,
what the user sees, what leaked: `lost`). Tests outside tests/fault that record rows are
marked `security`; `python scripts/reliability.py` runs tests/fault and those.
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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "security: records a row of RELIABILITY.md's security table")
    config.addinivalue_line("markers", "fault: a test of tests/fault (marked so by its path)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    fault = Path(__file__).parents[1] / "fault"
    for item in items:
        if fault in item.path.parents:
            item.add_marker(pytest.mark.fault)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[Any]:
    report = yield
    # the worst outcome of setup/call/teardown so far, for the rows written at teardown
    if report.when == "call" or report.failed:
        item.stash[_OUTCOME] = report.outcome if report.when == "call" else f"{report.outcome} ({report.when})"
    if report.failed and _WHY not in item.stash:
        crash = getattr(report.longrepr, "reprcrash", None)
        item.stash[_WHY] = (crash.message if crash is not None else str(report.longrepr)).splitlines()[0][:300]
    return report


_OUTCOME = pytest.StashKey[str]()
_WHY = pytest.StashKey[str]()


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

    def flush(self, outcome: str, why: str = "") -> None:
        out = os.environ.get(OUT_VAR)
        if not out:
            return
        if not self.rows and outcome != "passed":
            # it failed before it could record: the table still shows it, and why
            name = self.nodeid.split("::", 1)[-1]
            self.record(scenario=name, injected="–", happened=f"FAILED: {why}" if why else outcome, lost="?")
        if not self.rows:
            return
        duration = round(time.monotonic() - self.started, 1)
        try:
            with open(Path(out), "a", encoding="utf-8") as f:
                for row in self.rows:
                    record = {**row, "test": self.nodeid, "outcome": outcome, "test_s": duration}
                    f.write(json.dumps(record, default=str) + "\n")
        except OSError:
            pass  # recording never fails a test


@pytest.fixture
def reliability(request: pytest.FixtureRequest) -> Iterator[Reliability]:
    rec = Reliability(request.node.nodeid)
    yield rec
    rec.flush(request.node.stash.get(_OUTCOME, "unknown"), request.node.stash.get(_WHY, ""))
