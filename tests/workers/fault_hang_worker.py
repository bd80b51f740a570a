"""A worker that hangs once: alive, no progress (for the progress-watchdog test).

Every step it calls elasticrun.worker.heartbeat() and prints `step=N pid=P`. At step
--hang-step of the first attempt (the marker file --marker does not exist yet) it
creates the marker and sleeps for ever without heartbeats, as a worker stuck in a
collective or a deadlock would. In a later attempt it runs --steps steps and exits 0.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from elasticrun.worker import heartbeat


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--hang-step", type=int, default=3)
    p.add_argument("--marker", required=True)
    args = p.parse_args()
    marker = Path(args.marker)
    for step in range(args.steps):
        if step == args.hang_step and not marker.exists():
            marker.touch()
            print(f"hanging at step={step} pid={os.getpid()}", flush=True)
            while True:
                time.sleep(3600)
        heartbeat()
        print(f"step={step} pid={os.getpid()}", flush=True)
        time.sleep(0.05)
    print(f"worker done pid={os.getpid()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
