"""A plain gloo training loop with a slow node on demand, for the straggler tests.

Nothing of elasticrun in it: the worker boot times its steps (every `optimizer.step()`)
and its waits (`torch.distributed.all_reduce`). Each step "computes" for --step-time
seconds (a sleep), or --slow-factor times that on a node whose id (ELASTICRUN_NODE_ID)
names a file in --slow-dir: every node runs the same command, as the job spec must
match, and the test marks the slow node. Then one all_reduce of the gradient and a
stop flag, an optimizer step, and a line

    step=12 rank=0 world=2 round=1 node=host_4242

It ends (exit 0, every rank at the same step) after --steps steps or once a rank sees
--stop-file; SIGTERM ends it at once (143). A collective that breaks (a peer's agent
stopped it) waits to be stopped by its own agent.

A liar on demand: a worker whose node id names a file in --lie-dir does its step's
compute inside `elasticrun.worker.steptime.waiting()`, so that its node reports almost
no compute and its honest peers look slow (the attack on the straggler check).

A hang on demand: a worker whose node id names a file in --hang-dir (only global rank
--hang-rank, if given) removes the file and then sleeps without end after its step
--hang-step, in Python, outside any collective (its peers wait for it in the next
all_reduce); started again, it trains on.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from elasticrun.worker.steptime import waiting  # only a liar uses it


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--slow-dir", default="")
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument("--stop-file", default="")
    p.add_argument("--lie-dir", default="")
    p.add_argument("--hang-dir", default="")
    p.add_argument("--hang-step", type=int, default=3)
    p.add_argument("--hang-rank", type=int, default=-1)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))

    node = os.environ.get("ELASTICRUN_NODE_ID", "?")
    slow = Path(args.slow_dir) / node if args.slow_dir else None
    hang = Path(args.hang_dir) / node if args.hang_dir else None
    lies = bool(args.lie_dir) and (Path(args.lie_dir) / node).exists()
    stop = Path(args.stop_file) if args.stop_file else None
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    weight = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([weight], lr=0.01)
    tag = f"rank={rank} world={world} round={os.environ.get('ELASTICRUN_ROUND', '0')} node={node}"
    for step in range(args.steps):
        factor = args.slow_factor if slow is not None and slow.exists() else 1.0
        with waiting("all_reduce") if lies else contextlib.nullcontext():
            time.sleep(args.step_time * factor)  # the step's own compute
        weight.grad = torch.ones(4)
        flags = torch.tensor([1.0 if stop is not None and stop.exists() else 0.0])
        try:
            dist.all_reduce(weight.grad)
            dist.all_reduce(flags)
        except RuntimeError as e:
            print(f"collective failed at step {step} {tag}: {e}", flush=True)
            time.sleep(60)
            return 1
        optimizer.step()
        print(f"step={step} {tag}", flush=True)
        hangs_here = hang is not None and args.hang_rank in (-1, rank)
        if step == args.hang_step and hangs_here and hang is not None and hang.exists():
            hang.unlink()
            print(f"hanging after step={step} {tag}", flush=True)
            while True:
                time.sleep(1)
        if flags.item() > 0:
            break
    print(f"worker done {tag}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
