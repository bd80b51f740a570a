"""A worker without torch for job-control tests: prints numbered ticks until told to stop.

    tick=N rank=R world=W

every --every seconds; exits 0 once the file --stop-file exists.
"""

import argparse
import os
import time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--stop-file", required=True)
p.add_argument("--every", type=float, default=0.2)
args = p.parse_args()
rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
tick = 0
while not Path(args.stop_file).exists():
    tick += 1
    print(f"tick={tick} rank={rank} world={world}", flush=True)
    time.sleep(args.every)
