"""A worker without torch for job-control tests: prints numbered ticks until told to stop.

    tick=N rank=R world=W

every --every seconds; exits 0 once the file --stop-file exists. With --save-seconds S
it takes S seconds to "save" on SIGTERM, then writes <stop-file>.saved.<node id> and
exits 0 (a checkpoint written in the grace period). TICK_SAVE_SECONDS in the environment
sets it for one node only (a job's command is the same on every node).
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--stop-file", required=True)
p.add_argument("--every", type=float, default=0.2)
p.add_argument("--save-seconds", type=float, default=os.environ.get("TICK_SAVE_SECONDS"))
args = p.parse_args()
rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]


def save(signum: int, frame: object) -> None:
    time.sleep(args.save_seconds)
    Path(f"{args.stop_file}.saved.{os.environ['ELASTICRUN_NODE_ID']}").touch()
    sys.exit(0)


if args.save_seconds is not None:
    signal.signal(signal.SIGTERM, save)
tick = 0
while not Path(args.stop_file).exists():
    tick += 1
    print(f"tick={tick} rank={rank} world={world}", flush=True)
    time.sleep(args.every)
