"""The leader's policy, decide_round(), on its own: its CPU time per decision at a job's size.

    python bench/bench_round_policy.py                 # 1,000, 5,000, 10,000 nodes, a few seconds
    python bench/bench_round_policy.py --sizes 10000 --reps 50

A decision reads every registered node, so the leader's CPU grows with the job; it
decides at most once per four times a decision's cost (leader.py, _DECIDE_REST), so
this figure is also about a fifth of the longest a rested leader waits before it
decides again. Two views of N registered nodes and no round, as the leader sees a
forming job: one short of min (the decision waits) and at min = max (it forms the
round). The time is the thread's CPU time (`time.thread_time`), as the leader measures
its own; the median of --reps decisions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from common import machine, write_json  # noqa: E402

from elasticrun.rendezvous.records import NodeInfo  # noqa: E402
from elasticrun.rendezvous.round_policy import decide_round  # noqa: E402
from elasticrun.rendezvous.settings import RendezvousSettings  # noqa: E402
from elasticrun.rendezvous.view import SeenNode, View  # noqa: E402


def registered(count: int) -> dict[str, SeenNode]:
    """`count` nodes as the leader holds them: each seen a moment after the last."""
    def info(i: int) -> NodeInfo:
        return NodeInfo(node_id=f"node{i:05d}", host=f"host{i}", addr=f"10.{i // 62_500}.{i // 250 % 250}.{i % 250}",
                        nproc=8, pid=1000 + i, started_at=0.0)

    return {f"node{i:05d}": SeenNode(info=info(i), seen_at=float(i) / 1000) for i in range(count)}


def per_decision(view: View, settings: RendezvousSettings, reps: int) -> tuple[float, str]:
    """(median CPU seconds of one decision, what it decided)."""
    times, reason = [], ""
    for _ in range(reps):
        started = time.thread_time()
        reason = decide_round(view, settings, 1e6).reason
        times.append(time.thread_time() - started)
    return statistics.median(times), reason


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="*", default=[1000, 5000, 10000])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    info = machine()
    print(f"machine: {info}\n\n| nodes | waiting for one more, ms | forming, ms |\n|---|---|---|", flush=True)
    results = []
    for size in args.sizes:
        view = View(nodes=registered(size), round=None)
        waiting, why = per_decision(view, RendezvousSettings("bench", size + 1, size + 1, last_call=0.5), args.reps)
        forming, formed = per_decision(view, RendezvousSettings("bench", size, size, last_call=0.5), args.reps)
        assert why.startswith("waiting for nodes") and formed.startswith("formed with"), (why, formed)
        results.append({"nodes": size, "waiting_ms": waiting * 1e3, "forming_ms": forming * 1e3})
        print(f"| {size:,} | {waiting * 1e3:.2f} | {forming * 1e3:.2f} |", flush=True)
    write_json(args.json, {"machine": info, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
