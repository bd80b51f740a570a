"""The steps a node's loss costs a sharded job whose commits outpace the copies to its buddy.

    python bench/bench_node_loss.py                          # this tree, 3 rounds
    python bench/bench_node_loss.py --baseline ../before     # and an earlier checkout, alternating

Two nodes (agents on 127.0.0.1 and 127.0.0.2, one worker each; the store hosted by the
first) run a fixed-size job (`--nnodes=2`) of bench/workers/sharded_steps.py: an
`elastic.ShardedState` of --mb MB per rank (a model and its momentum), committed every
step of about --pace s, so an agent, which looks every 0.5 s, sees several commits a
look. A third agent (127.0.0.3) waits as a spare. Once the second node's worker reports
step --kill-at, that agent and its worker are SIGKILLed; the spare takes the node rank,
and its worker's first line says the step it resumed at and where from (step 0 and
"nothing" when no rank restored: the script would load its own checkpoint, none here).

Per round: the last step the lost node reported, the step the spare resumed at, the
steps lost (the difference), and the seconds from the kill to the spare's first step.
With --baseline (a checkout of an earlier elasticrun: its agents and its worker-side
package), each round runs it too, alternating: before and after in one run.
Nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    LAUNCHERS,
    WORKERS,
    ProcessTracker,
    base_env,
    free_port,
    kill_tree,
    loadavg,
    start_run,
    write_json,
)

WORKER = WORKERS / "sharded_steps.py"
BEGIN = re.compile(r"begin rank=(\d+) restored=(\w+) from=([a-z ]+) step=(\d+)")
#: seconds any one wait of a round may take
WAIT = 180.0


@dataclass
class Round:
    tree: str
    last: int
    resumed: int
    source: str
    seconds: float

    @property
    def lost(self) -> int:
        return self.last - self.resumed


def _wait_for(log: Path, pattern: str, start: int = 0) -> re.Match[str]:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        found = re.search(pattern, text[start:])
        if found:
            return found
        time.sleep(0.05)
    raise TimeoutError(f"{log.name}: no {pattern!r} in {WAIT:g} s")


def _steps(log: Path, rank: int) -> list[int]:
    return [int(s) for s in re.findall(rf"step=(\d+) rank={rank}\b", log.read_text(errors="replace"))]


def one_round(tree: str, baseline: str, args: argparse.Namespace, folder: Path) -> Round:
    tracker = ProcessTracker()
    port, run_id = free_port(), f"loss{time.monotonic_ns() % 10**9}"
    logs = {i: folder / f"{tree}-{run_id}-n{i}.log" for i in (1, 2, 3)}
    env = base_env(**({"PYTHONPATH": baseline} if baseline else {}))
    cwd = {"cwd": Path(baseline)} if baseline else {}  # `python -m` looks in the working folder first
    agents = {}

    def node(i: int) -> None:
        argv = [
            *LAUNCHERS["elasticrun"], "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
            f"--rdzv-conf=is_host={'true' if i == 1 else 'false'}", f"--local-addr=127.0.0.{i}",
            "--shutdown-timeout=5", str(WORKER), f"--mb={args.mb}", f"--pace={args.pace}",
        ]
        agents[i] = tracker.start(argv, env=env, log=logs[i], **cwd).pid

    try:
        node(1)
        node(2)
        rank = int(_wait_for(logs[2], BEGIN.pattern)[1])
        _wait_for(logs[1], r"step=3 rank=")
        node(3)
        _wait_for(logs[3], r"waiting: spare: ")
        _wait_for(logs[2], rf"step={args.kill_at} rank={rank}\b")
        start = logs[3].stat().st_size
        kill_tree(agents[2])
        killed = time.monotonic()
        begun = _wait_for(logs[3], BEGIN.pattern, start)
        resumed = int(begun[4])
        _wait_for(logs[3], rf"step={resumed + 1} rank={begun[1]}\b", start)
        seconds = time.monotonic() - killed
        return Round(tree, max(_steps(logs[2], rank)), resumed, begun[3], seconds)
    finally:
        tracker.stop_all()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=16, help="MB of parameters per rank (as much momentum again)")
    ap.add_argument("--pace", type=float, default=0.05, help="seconds a step takes beyond its compute")
    ap.add_argument("--kill-at", type=int, default=60, help="the step of the lost node's worker that kills it")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", default="", help="a checkout of an earlier elasticrun, run alternately")
    ap.add_argument("--json", help="write the rounds here")
    args = ap.parse_args()
    info, folder = start_run("bench-node-loss-")
    trees = {"this tree": ""} | ({"baseline": str(Path(args.baseline).resolve())} if args.baseline else {})
    rounds = []
    for n in range(args.rounds):
        for tree, baseline in trees.items():
            done = one_round(tree, baseline, args, folder)
            rounds.append(done)
            print(f"round {n + 1} {tree}: lost node at step {done.last}, the spare resumed at step {done.resumed} "
                  f"from {done.source}: {done.lost} steps lost; its first step {done.seconds:.1f} s after the kill "
                  f"(load {loadavg()})", flush=True)
    print(f"\n{args.mb} MB per rank, a commit every step of ~{args.pace * 1000:.0f} ms + compute; logs: {folder}")
    print("| tree | steps lost (each round) | median | restored from | kill to first step, s (median) |")
    print("|---|---|---|---|---|")
    for tree in trees:
        mine = [r for r in rounds if r.tree == tree]
        print(f"| {tree} | {', '.join(str(r.lost) for r in mine)} | {statistics.median(r.lost for r in mine):g} | "
              f"{', '.join(sorted({r.source for r in mine}))} | {statistics.median(r.seconds for r in mine):.1f} |")
    write_json(args.json, {"machine": info, "args": vars(args), "rounds": [vars(r) for r in rounds]})


if __name__ == "__main__":
    main()
