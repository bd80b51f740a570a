"""One rank stuck in a Python function while the others wait in an all-reduce (the
stacks tests).

Every step sums over the group (collective.py: gloo unless ELASTICRUN_TEST_COLLECTIVE
says tcp), calls elasticrun.worker.heartbeat() and prints `step=N <tag>`. From
--stuck-step on, rank --stuck-rank calls load_batch(), which never returns (a data
loader that waits for ever), in the first attempt, and in later ones once the file
--again-file exists; the other ranks wait for it in the all-reduce. The workers end
when any rank sees --stop-file. The first heartbeat comes after the first all-reduce:
until then (importing torch, forming the group, the peers' first tensor operation) the
agent's --progress-start-timeout applies, so the short --progress-timeout is about the
training loop, not about how long those take on a loaded machine. (A thread that beat
meanwhile was not enough: `import torch` holds the interpreter for seconds at a time
under load, and the watchdog took that for a hang.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from collective import join_group
from worker_tag import identity

from elasticrun.worker import heartbeat


def load_batch() -> None:
    while True:
        time.sleep(3600)  # the line the stacks must name


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stuck-rank", type=int, required=True)
    p.add_argument("--stuck-step", type=int, default=3)
    p.add_argument("--again-file", required=True)
    p.add_argument("--stop-file", required=True)
    args = p.parse_args()
    rank, world, tag = identity()
    group = join_group(rank, world)
    again, stop_file = Path(args.again_file), Path(args.stop_file)
    first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
    step = 0
    while True:
        if rank == args.stuck_rank and step >= args.stuck_step and (first or again.exists()):
            print(f"stuck at step={step} {tag}", flush=True)
            load_batch()
        total = group.all_reduce([1.0, 1.0 if stop_file.exists() else 0.0])
        heartbeat()
        print(f"step={step} {tag}", flush=True)
        if total[1] > 0:
            break
        step += 1
        time.sleep(0.05)
    group.close()
    print(f"worker done {tag}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
