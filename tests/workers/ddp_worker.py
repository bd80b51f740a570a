"""A plain DDP (or FSDP2) training script, as users write them: nothing of elasticrun in it.

A small MLP wrapped in `DistributedDataParallel` on gloo, real compute (no sleep), one
optimizer step per step, and a line per step

    step=12 rank=0 world=2 round=1 node=host_4242

that the tests wait for. It ends (exit 0) once
a rank sees --stop-file; SIGTERM ends it at once (143).

`--fsdp` shards the model with FSDP2's `fully_shard` instead of DDP; `--batchnorm` adds a
BatchNorm layer (buffers, which DDP broadcasts from rank 0 before each forward). A node whose id
(ELASTICRUN_NODE_ID) names a file in `--slow-dir` computes three times as much per step
(two more forward and backward passes through a local copy of the model: real compute,
no sleep, no collective); every node runs the same command, as the job spec must match. `--steps N` ends it after
N steps.

Faults on demand, each at step --fault-step on global rank --fault-rank:
- `--stuck`: the rank sleeps in its data path, outside any collective, while the others
  wait for it in DDP's gradient all-reduce;
- `--mismatch`: the rank calls `broadcast` while the others call `all_reduce`: they can
  never meet.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

#: large against the model: a step is mostly compute (about 40 ms on a free core), not gloo
BATCH = 1024


def load_batch(step: int, stuck: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if stuck:
        while True:
            time.sleep(1)
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 256, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stop-file", default="")
    p.add_argument("--fault-rank", type=int, default=-1)
    p.add_argument("--fault-step", type=int, default=5)
    p.add_argument("--stuck", action="store_true")
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--slow-dir", default="")
    p.add_argument("--batchnorm", action="store_true")
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--mismatch", action="store_true")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    def mlp() -> nn.Module:
        # BatchNorm's running statistics are buffers: DDP broadcasts them from rank 0 at every forward
        norm = [nn.BatchNorm1d(512)] if args.batchnorm else []
        return nn.Sequential(nn.Linear(256, 512), *norm, nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    model, extra = mlp(), mlp()  # extra: a local copy, for the slow rank's compute (no collective)
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stop = Path(args.stop_file) if args.stop_file else None
    node = os.environ.get("ELASTICRUN_NODE_ID", "?")
    slow = Path(args.slow_dir) / node if args.slow_dir else None
    tag = f"rank={rank} world={world} round={os.environ.get('ELASTICRUN_ROUND', '0')} node={node}"
    flag = torch.zeros(1)
    step = 0
    while True:
        step += 1
        fault = rank == args.fault_rank and step == args.fault_step
        if args.mismatch and step == args.fault_step:
            if fault:
                dist.broadcast(flag, src=0)
            else:
                dist.all_reduce(flag)
        x, y = load_batch(step, stuck=fault and args.stuck)
        for _ in range(2 if slow is not None and slow.exists() else 0):  # the slow rank's extra compute
            nn.functional.cross_entropy(extra(x), y).backward()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        flag.fill_(1.0 if stop is not None and stop.exists() else 0.0)
        dist.all_reduce(flag)
        print(f"step={step} {tag} loss={loss.item():.4f}", flush=True)
        if flag.item() > 0 or step == args.steps:
            dist.destroy_process_group()
            return 0


if __name__ == "__main__":
    raise SystemExit(main())
