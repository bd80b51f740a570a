"""Starting and stopping one node's worker group of 8 (what finding every
descendant costs), this tree against another source tree of elasticrun, interleaved.

    python bench/bench_worker_group.py                                   # this tree, ~1 minute
    git archive 6f32dbe elasticrun | tar -x -C /tmp/er-base              # a tree to compare with
    python bench/bench_worker_group.py --baseline /tmp/er-base --json /tmp/group.json

Each trial is a fresh process that imports elasticrun from one tree (PYTHONPATH), starts
a warden (`Warden.start()`) and then, `--reps` times: `WorkerGroup.start` of 8 workers,
then `stop(grace=5)`; the two are timed apart, on the monotonic clock. Workloads:

  plain  each worker is `sleep 300` (the agent's own cost, nothing for the scan to find)
  tree   each worker is `sh -c 'setsid sleep 301 & exec sleep 300'`: it leaves a process
         in a session of its own, which the stop must find (the stop starts once all 8
         are up)

After each stop the trial counts the processes of the group still alive (the trial is
a child subreaper, so an escaped one is still its descendant), then kills them. Trials
alternate trees (and which goes first) per round. Medians over all reps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, become_subreaper, descendants, fmt, kill_tree, loadavg, median, reap, write_json  # noqa: E402

WORKERS = 8
ARGV = {
    "plain": ["sleep", "300"],
    "tree": ["sh", "-c", "setsid sleep 301 & exec sleep 300"],
}


async def _trial(workload: str, reps: int) -> list[dict[str, float]]:
    import elasticrun
    from elasticrun.agent.processes import Warden, WorkerGroup

    source = Path(os.environ["PYTHONPATH"]).resolve()
    assert Path(elasticrun.__file__).resolve().is_relative_to(source), (elasticrun.__file__, source)
    warden = await Warden.start()
    warden_pid = warden._proc.pid  # the bench's only look inside: the warden is not the group's
    rows = []
    try:
        for _ in range(reps):
            t0 = time.monotonic()
            group = await WorkerGroup.start(ARGV[workload], {r: dict(os.environ) for r in range(WORKERS)}, warden)
            t1 = time.monotonic()
            want = WORKERS * (2 if workload == "tree" else 1)
            while len(_group_pids(warden_pid)) < want:  # the setsid grandchildren are up
                await asyncio.sleep(0.005)
            t2 = time.monotonic()
            await group.stop(grace=5)
            t3 = time.monotonic()
            left = _group_pids(warden_pid)
            for pid in left:
                kill_tree(pid)
            reap()
            rows.append({"start_ms": (t1 - t0) * 1000, "stop_ms": (t3 - t2) * 1000, "left": len(left)})
    finally:
        await warden.close()
    return rows


def _group_pids(warden_pid: int) -> list[int]:
    """Live processes below this trial other than the warden (zombies are not counted)."""
    alive = []
    for pid in descendants(os.getpid()):
        if pid == warden_pid:
            continue
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            alive.append(pid)
    return alive


def _run_trial(tree: Path, workload: str, reps: int) -> list[dict[str, float]]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(
        [sys.executable, __file__, "--trial", workload, "--reps", str(reps)],
        env=env, check=True, capture_output=True, text=True, timeout=600,
    )
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="another source tree (the folder holding elasticrun/)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5, help="start/stop cycles per trial")
    parser.add_argument("--json")
    parser.add_argument("--trial", choices=sorted(ARGV), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trial:
        become_subreaper()
        print(json.dumps(asyncio.run(_trial(args.trial, args.reps))))
        return
    trees = {"this tree": REPO}
    if args.baseline:
        trees["baseline"] = args.baseline
    results: dict[str, dict[str, list[dict[str, float]]]] = {name: {w: [] for w in ARGV} for name in trees}
    print(f"load before: {loadavg()}", flush=True)
    for round_ in range(args.rounds):
        order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
        for workload in ARGV:
            for name in order:
                results[name][workload] += _run_trial(trees[name], workload, args.reps)
    print(f"load after: {loadavg()}")
    print("| tree | workload | cycles | start median ms | stop median ms | stop min-max ms | left after stop |")
    print("|---|---|---|---|---|---|---|")
    for name, by_workload in results.items():
        for workload, rows in by_workload.items():
            stops = [r["stop_ms"] for r in rows]
            print(
                f"| {name} | {workload} | {len(rows)} | {fmt(median(r['start_ms'] for r in rows), 1)} | "
                f"{fmt(median(stops), 1)} | {fmt(min(stops), 1)}-{fmt(max(stops), 1)} | "
                f"{sum(r['left'] for r in rows)} |"
            )
    write_json(args.json, results)


if __name__ == "__main__":
    main()
