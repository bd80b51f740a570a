#!/usr/bin/env python3
"""Rerun the fault-injection suite and write RELIABILITY.md from what it recorded.

    python scripts/reliability.py            # pytest tests/fault, then RELIABILITY.md
    python scripts/reliability.py --soak     # also the long soak (marker `soak`)
    python scripts/reliability.py --rows rows.jsonl --output /tmp/R.md   # render only
    python scripts/reliability.py --soak --save-rows rows.jsonl           # keep the rows too
    python scripts/reliability.py -- -k churn                            # pass to pytest
    python scripts/reliability.py --part security   # only the security rows, spliced into RELIABILITY.md

Each test of tests/fault/ (and each test marked `security`) that takes the
`reliability` fixture records one row per scenario (see tests/support/reliability_rows.py); this
script points ELASTICRUN_RELIABILITY_OUT at a fresh file, runs pytest, and renders the
rows: the faults (what was injected, what happened, the time to recover, the restarts
used, anything lost) as one table, the attacks and mistakes (what was tried, what the
user sees, what leaked) as another, under one screen of headlines (each kind of fault:
how many ended as designed, the time to recover, and torchrun's time for the same fault
where BENCHMARKS.md measured one). It exits with pytest's status, so a failing scenario
fails the command (its row is still written, marked). The workers all_reduce with gloo
here. The rows of a run begin with one that says which run it was (command, time,
commit, pytest's summary): rendered again with --rows, they still name the run that
measured them.

With `--part security`, only the test files that record security rows run (a fraction
of the suite), and only the Security section of the existing file is rewritten, under
a line naming that run; its rows' figures and the headline count of scenarios follow.
The faults' rows stay those of the last full run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TITLE = """\
# Reliability

What elasticrun does under injected faults, in one screen; how it is measured, and every
scenario, below.
"""

INTRO = """\
## How it is measured

What elasticrun does under injected faults, measured by the fault-injection suite in
[tests/fault/](tests/fault/): real agents, workers, store servers and network
namespaces, no mocks. Each row is one scenario of one test run; the table below is
written by

    {command}

and by nothing else: rerun it to check the figures (it exits non-zero when a scenario
fails). Times are wall-clock seconds on the machine named below, under the load of the
suite itself; they are records, not assertions (the tests assert behaviour only).
"Time to recover" is from the fault to the first training step of the job at its new
size (for churn, the mean time of one membership round). "Restarts used" counts
`--max-restarts` spent. The long churn soak is not part of the default run: add
`--soak` (or run `ELASTICRUN_SOAK=1 python -m pytest tests/fault -m soak`).

[Security](#security), below the faults, lists the attacks and mistakes tried against
a job, what the user sees, and what leaked.
"""


@dataclass(frozen=True)
class Headline:
    """One line of the headlines.

    The rows whose scenario matches `scenarios`, their `figure` (seconds), and
    torchrun's time for the same fault in BENCHMARKS.md.
    """

    what: str
    scenarios: str
    figure: str = "recovery_s"
    #: (torchrun's seconds, what it is: its date and the command that measured it)
    anchor: tuple[float, str] | None = None


_ELASTIC = "`python bench/bench_elastic.py --reps 3 --cap 90`"
HEADLINES = (
    Headline("a node's agent SIGKILLed: the job steps at its new size", r"agent_kill",
             anchor=(43.37, "2026-11-24, `python bench/bench_elastic.py --reps 3 --cap 60 --only kill spare ...`")),
    Headline("a node leaves (SIGTERM)", r"agent_term",
             anchor=(48.30, f"without its shared store, 2026-11-21, {_ELASTIC}")),
    Headline("a worker dies", r"worker_kill",
             anchor=(6.15, f"a worker crash, without its shared store, 2026-11-21, {_ELASTIC}")),
    Headline("a node joins", r": join$", anchor=(8.03, f"scale-up, without its shared store, 2026-11-21, {_ELASTIC}")),
    Headline("a node is drained", r"nemesis.*: drain$"),
    Headline("an agent frozen (SIGSTOP), then let go", r"agent_freeze|^frozen agent"),
    Headline("a node cut off by the network", r"^partition"),
    Headline("the store stalls, blips or restarts empty", r"store_(stall|blip|restart)|^store (stalls|restarts)"),
    Headline("the agent hosting the store dies: its survivors have exited", r"store host lost \(store-hosting agent\)",
             figure="exit_s",
             anchor=(3.26, "2026-11-23, `python bench/bench_elastic.py --reps 3 --only host-kill --cap 60`")),
    Headline("50 and 400 membership changes in a row: one round", r"^churn"),
)

COLUMNS = ("Scenario", "Injected", "What happened", "Time to recover", "Restarts used", "Lost", "Test")
SECURITY_COLUMNS = ("Attack or mistake", "Tried", "What the user sees", "Leaked", "Test")
#: row fields shown in the table; the rest go to the figures below it
SHOWN = {"scenario", "injected", "happened", "recovery_s", "restarts", "lost", "test", "outcome", "test_s", "part"}


def run_suite(pytest_args: list[str], rows: Path, soak: bool, paths: list[str] | None = None) -> tuple[int, str, float]:
    # the training workers all_reduce with gloo, as a user's job does (the test suite's
    # default is a socket stand-in that saves the CPU of importing torch: tests/workers/collective.py)
    env = dict(os.environ, ELASTICRUN_RELIABILITY_OUT=str(rows), ELASTICRUN_TEST_COLLECTIVE="gloo")
    if soak:
        env["ELASTICRUN_SOAK"] = "1"
    argv = [
        sys.executable, "-m", "pytest", *(paths or ["tests"]), "-m", "fault or security", "-q",
        "-p", "no:cacheprovider", *pytest_args,
    ]
    print("+", " ".join(argv), flush=True)
    began = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sys.stdout.write(proc.stdout)
    summary = next(
        (ln.strip("= ") for ln in reversed(proc.stdout.splitlines()) if re.search(r"\d+ (passed|failed|error)", ln)), ""
    )
    return proc.returncode, summary, time.monotonic() - began


def load_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _cell(value: object) -> str:
    text = "–" if value is None or value == "" else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _recovery(value: object) -> str:
    return "–" if value is None else f"{float(value):.1f} s"


def _test(row: dict) -> str:
    name = row.get("test", "?").split("/")[-1]
    mark = "" if row.get("outcome") == "passed" else f" **{str(row.get('outcome', '?')).upper()}**"
    return f"`{name}`{mark} ({row.get('test_s', '?')} s)"


def _figures(row: dict) -> str:
    extra = {k: v for k, v in row.items() if k not in SHOWN}
    parts = []
    for key, value in extra.items():
        if isinstance(value, dict):
            value = json.dumps(value, separators=(",", ":"))
        parts.append(f"{key}={value}")
    return ", ".join(parts)


def this_run(command: str, summary: str) -> dict:
    """The row that says which run the rows are of: this one, now."""
    commit = _git("rev-parse", "--short", "HEAD") or "?"
    dirty = " (with uncommitted changes)" if _git("status", "--porcelain", "--untracked-files=no") else ""
    return {
        "part": "run",
        "command": command,
        "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": f"`{commit}`{dirty}",
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "summary": summary,
    }


def headlines(rows: list[dict], when: str) -> list[str]:
    """One screen of headlines, a line per kind of fault.

    Per kind of fault: the scenarios that ended as designed, the time to recover, and
    torchrun's time for the same fault where BENCHMARKS.md has one.
    """
    faults = [row for row in rows if row.get("part") != "security"]
    passed = sum(row.get("outcome") == "passed" for row in rows)
    lost = [re.search(r"(\d+) of (\d+) log lines", str(row.get("lost", ""))) for row in faults]
    lines = [(int(m[1]), int(m[2])) for m in lost if m]
    table = [["scenarios, faults and attacks, that ended as designed", f"{passed} of {len(rows)}", "–", "–", when],
             ["log lines lost (the runs' lines, SIGKILLed nodes' included)",
              f"{sum(a for a, _ in lines):,} of {sum(b for _, b in lines):,}", "–", "–", when]]
    for line in HEADLINES:
        matched = [row for row in faults if re.search(line.scenarios, str(row.get("scenario", "")))]
        times = [float(row[line.figure]) for row in matched if isinstance(row.get(line.figure), (int, float))]
        if not matched or not times:
            continue
        ok = sum(row.get("outcome") == "passed" for row in matched)
        faults_n = sum(int(row.get("faults", row.get("changes", 1))) for row in matched)
        ours = (
            f"{statistics.median(times):.1f} s (max {max(times):.1f}); {ok} of {_plural(len(matched), 'scenario')} "
            f"as designed, {_plural(faults_n, 'fault')}"
        )
        anchor = ratio = "–"
        if line.anchor is not None:
            seconds, where = line.anchor
            anchor, ratio = f"torchrun {seconds:.2f} s ({where})", f"{statistics.median(times) / seconds:.2f}"
        table.append([line.what, ours, anchor, ratio, when])
    out = ["## Headlines", ""]
    out += _plain_table(("what", "ours: time to recover, median (max)", "anchor", "ratio", "date"), table)
    out += [
        "",
        "Ours from the run below (the rows it names); torchrun's from BENCHMARKS.md's runs,",
        "with torchrun's defaults and gloo workers, while this suite runs shorter leases",
        "(`heartbeat_timeout=2`): a ratio is an order of magnitude, not a like-for-like figure.",
        "",
    ]
    return out


def render(rows: list[dict], *, command: str, summary: str, elapsed: float | None) -> str:
    run = next((row for row in rows if row.get("part") == "run"), None) or this_run(command, summary)
    rows = [row for row in rows if row.get("part") != "run"]
    out = [TITLE, *headlines(rows, run["when"].split(" ")[0]), INTRO.format(command=run["command"])]
    out.append(f"Run: {run['when']}, commit {run['commit']}; {run['machine']}.")
    if run["summary"]:
        out.append(f"pytest: {run['summary']}.")
    faults = [row for row in rows if row.get("part") != "security"]
    attacks = [row for row in rows if row.get("part") == "security"]
    out += _table(COLUMNS, [
        [row.get("scenario"), row.get("injected"), row.get("happened"), _recovery(row.get("recovery_s")),
         row.get("restarts"), row.get("lost"), row]
        for row in faults
    ])
    out += ["", "## Security", ""]
    out += _table(SECURITY_COLUMNS, [
        [row.get("scenario"), row.get("injected"), row.get("happened"), row.get("lost"), row] for row in attacks
    ])
    out += ["", "## Figures", "", "Everything else each row recorded, as the test wrote it:", ""]
    for row in rows:
        figures = _figures(row)
        if figures:
            out.append(f"- **{_cell(row.get('scenario'))}**: {figures}")
    return "\n".join(out).rstrip() + "\n"


def security_tests() -> list[str]:
    """The test files that record security rows: the only ones `--part security` runs."""
    return sorted(
        str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
        if 'part="security"' in path.read_text(encoding="utf-8")
    )


def splice_security(old: str, rows: list[dict]) -> str:
    """`old` (a RELIABILITY.md) with its security rows replaced by `rows` (a `--part security` run's).

    The Security section, the security rows' figures and the headline count of
    scenarios are made anew; the rest stays the last full run's."""
    run = next(row for row in rows if row.get("part") == "run")
    attacks = [row for row in rows if row.get("part") == "security"]
    head, found, rest = old.partition("\n## Security\n")
    table, figures_found, figures = rest.partition("\n## Figures\n")
    if not found or not figures_found:
        raise SystemExit("the output has no Security and Figures sections to replace: run the whole suite first")
    old_rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| Attack")]
    old_names = {_cells(line)[0] for line in old_rows}
    old_passed = sum("**" not in _cells(line)[-1] for line in old_rows)
    counted = re.search(r"(\| scenarios, faults and attacks, that ended as designed \| )(\d+) of (\d+)", head)
    if counted is not None:
        passed = int(counted[2]) - old_passed + sum(row.get("outcome") == "passed" for row in attacks)
        total = int(counted[3]) - len(old_rows) + len(attacks)
        head = head[:counted.start()] + f"{counted[1]}{passed} of {total}" + head[counted.end():]
    section = [
        "", f"These rows: `{run['command']}`, {run['when']}, commit {run['commit']}; {run['machine']}"
        + (f"; pytest: {run['summary']}" if run["summary"] else "") + ".", "",
    ]
    section += _table(SECURITY_COLUMNS, [
        [row.get("scenario"), row.get("injected"), row.get("happened"), row.get("lost"), row] for row in attacks
    ])
    kept = [line for line in figures.splitlines()
            if not (line.startswith("- **") and line[4:].partition("**:")[0] in old_names)]
    kept = [line for line in kept if line.strip()]
    news = [f"- **{_cell(row.get('scenario'))}**: {_figures(row)}" for row in attacks if _figures(row)]
    return "\n".join([head, "## Security", *section, "", "## Figures", "", *kept[:1], "", *kept[1:], *news]) + "\n"


def _cells(line: str) -> list[str]:
    """The cells of a markdown table's line (pipes escaped as \\| stay in their cell)."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def _plain_table(columns: tuple[str, ...], rows: list[list[object]]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + [
        "| " + " | ".join(_cell(c) for c in cells) + " |" for cells in rows
    ]


def _table(columns: tuple[str, ...], rows: list[list[object]]) -> list[str]:
    """A markdown table; each row's last cell is its recorded row, shown as its test."""
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for *cells, row in rows:
        assert isinstance(row, dict)
        out.append("| " + " | ".join(_cell(c) for c in cells) + f" | {_test(row)} |")
    if not rows:
        out.append("| (no rows recorded) |" + " |" * (len(columns) - 1))
    return out


def _git(*argv: str) -> str:
    try:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--output", type=Path, default=ROOT / "RELIABILITY.md", help="the markdown file to write")
    p.add_argument("--rows", type=Path, help="render these recorded rows (JSON lines) instead of running the suite")
    p.add_argument("--save-rows", type=Path, help="also keep the rows of this run here (JSON lines), to render again")
    p.add_argument("--soak", action="store_true", help="include the long soak tests (marker soak)")
    p.add_argument("--part", choices=("security",),
                   help="rerun only the tests that record this part's rows and rewrite only its section of --output")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = p.parse_args()

    # the checkout's environment (scripts/setup.sh), as every command of the project
    command = ".venv/bin/python scripts/reliability.py" + (" --soak" if args.soak else "")
    command += f" --part {args.part}" if args.part else ""
    if args.rows is not None:
        rows = load_rows(args.rows)
        code, summary, elapsed = 0, "", None
        command += f" --rows {args.rows}"  # unless the rows name their run
    else:
        with tempfile.TemporaryDirectory(prefix="reliability-") as tmp:
            path = Path(tmp) / "rows.jsonl"
            paths = security_tests() if args.part == "security" else None
            code, summary, elapsed = run_suite(args.pytest_args, path, args.soak, paths)
            rows = load_rows(path)
        if args.pytest_args:
            command += " -- " + " ".join(args.pytest_args)
        rows.insert(0, this_run(command, summary))
        if args.save_rows is not None:
            args.save_rows.write_text("".join(json.dumps(row) + "\n" for row in rows))
    if args.part == "security":
        args.output.write_text(splice_security(args.output.read_text(encoding="utf-8"), rows))
    else:
        args.output.write_text(render(rows, command=command, summary=summary, elapsed=elapsed))
    print(f"wrote {args.output} ({len(rows)} rows); pytest exit status {code}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
