"""The Python API with a function entrypoint: `elasticrun.launch(fn)` against torch's
`elastic_launch(LaunchConfig(...), fn)()`, side by side, in one run.

    python bench/bench_api.py                  # N=5 per launcher, ~1 minute
    python bench/bench_api.py --reps 3 --json /tmp/api.json

Each trial is a fresh process (bench/workers/api_call.py) that launches 2 workers on this
host, each returning a value; torch's with the c10d backend on a free loopback port and
spawn, ours `standalone=True`. Timed: the launch call alone, inside that process (from
just before the call to its return with the values), and the whole process (Popen to
exit, interpreter start and imports included). Trials alternate launchers (and which
goes first) after one untimed warm-up of each.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import WORKERS, base_env, fmt, free_port, loadavg, median, ratio, start_run, write_json  # noqa: E402

CAP_S = 120.0


def trial(which: str) -> tuple[float, float]:
    """(launch call seconds, process seconds)."""
    argv = [sys.executable, str(WORKERS / "api_call.py"), which, "2", str(free_port())]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=CAP_S, env=base_env(LOGLEVEL="WARNING"))
    total = time.perf_counter() - started
    if done.returncode != 0 or "values [(0, 0), (1, 10)]" not in done.stdout:
        raise SystemExit(f"{which} failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-3000:]}")
    call = float(next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("seconds ")))
    return call, total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    info, _ = start_run("bench_api")
    for which in ("elasticrun", "torch"):
        trial(which)  # warm-up, untimed
    results: dict[str, list[tuple[float, float]]] = {"elasticrun": [], "torch": []}
    for rep in range(args.reps):
        order = ("elasticrun", "torch") if rep % 2 == 0 else ("torch", "elasticrun")
        for which in order:
            results[which].append(trial(which))
    calls = {w: median(c for c, _ in r) for w, r in results.items()}
    totals = {w: median(t for _, t in r) for w, r in results.items()}
    print(f"load {loadavg()}")
    print("| measure | elasticrun.launch | torch elastic_launch | ours / torch |")
    print("|---|---|---|---|")
    print(f"| launch call, median s | {fmt(calls['elasticrun'])} | {fmt(calls['torch'])} | "
          f"{ratio(calls['elasticrun'], calls['torch'])} |")
    print(f"| whole process, median s | {fmt(totals['elasticrun'])} | {fmt(totals['torch'])} | "
          f"{ratio(totals['elasticrun'], totals['torch'])} |")
    write_json(args.json, {"machine": info, "reps": args.reps, "results": results})


if __name__ == "__main__":
    main()
