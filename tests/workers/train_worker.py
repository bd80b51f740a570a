"""A tiny training worker for the end-to-end elastic tests (gloo, or its socket stand-in:
collective.py).

Each step does one all_reduce (the step's "gradient" and a stop flag) and prints

    step=12 rank=0 world=3 group_rank=0 restart=0 round=2 pid=1234

then sleeps briefly, so a job runs until the test tells it otherwise: it ends (exit 0,
on every rank at the same step) after --steps steps, or as soon as any rank sees the
file --stop-file. Failures on demand: --fail-rank R --fail-step S makes rank R raise at
step S (a traceback, exit 1), every time, or only once with --fail-marker M (the first
failure creates M). A bad node: with --crash-dir D, every worker of the node whose id
(ELASTICRUN_NODE_ID) names a file in D raises at every step from --fail-step on, every
time (the test marks the node; every node runs the same command, as the job spec must
match). SIGTERM is reported ("worker got SIGTERM ...") and ends it (143).

A collective that breaks because a peer vanished is reported ("collective failed: ...")
and the worker then waits, up to --broken-wait seconds, for its agent to stop it: a
peer's disappearance is a membership change the agent handles, not a failure of ours.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from collective import CollectiveFailed, join_group
from worker_tag import identity


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--stop-file", default="")
    p.add_argument("--sleep", type=float, default=0.1)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=0)
    p.add_argument("--fail-marker", default="")
    p.add_argument("--crash-dir", default="")
    p.add_argument("--broken-wait", type=float, default=60.0)
    args = p.parse_args()

    rank, world, tag = identity()

    def on_sigterm(signum: int, frame: object) -> None:
        os.write(1, f"worker got SIGTERM {tag}\n".encode())
        os._exit(143)

    signal.signal(signal.SIGTERM, on_sigterm)

    group = join_group(rank, world)
    print(f"worker started {tag}", flush=True)
    stop_file = Path(args.stop_file) if args.stop_file else None
    node = os.environ.get("ELASTICRUN_NODE_ID", "?")
    bad = Path(args.crash_dir) / node if args.crash_dir else None
    for step in range(args.steps):
        if bad is not None and step >= args.fail_step and bad.exists():
            raise RuntimeError(f"injected crash on bad node {node} at step {step} {tag}")
        if rank == args.fail_rank and step == args.fail_step:
            marker = Path(args.fail_marker) if args.fail_marker else None
            if marker is None or not marker.exists():
                if marker is not None:
                    marker.touch()
                raise RuntimeError(f"injected failure at step {step} {tag}")
        stop = 1.0 if stop_file is not None and stop_file.exists() else 0.0
        try:
            t = group.all_reduce([1.0, stop])
        except CollectiveFailed as e:
            print(f"collective failed at step {step} {tag}: {e}", flush=True)
            time.sleep(args.broken_wait)
            return 1
        print(f"step={step} {tag} sum={int(t[0])}", flush=True)
        if t[1] > 0:
            break
        time.sleep(args.sleep)
    print(f"worker done {tag}", flush=True)
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
