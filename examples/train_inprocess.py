"""In-process elastic training of the model of train_elastic.py: the workers keep running.

Run it under elasticrun with `--elastic-mode=in-process` on any number of nodes:

    python -m elasticrun --elastic-mode=in-process --nnodes=1:4 --nproc-per-node=1 \
        --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo \
        examples/train_inprocess.py --steps 300

What makes it elastic without restarts (see docs/in-process.md):
- what must survive a membership change lives in an `elastic.State`: the model, the
  optimizer (its momentum too) and the step counter;
- `state.commit()` after every step keeps an in-memory copy; a change is noticed there,
  and a step that a lost peer broke rolls back to it;
- `@elastic.run` calls `train()` again after every change, with the process group
  re-formed at the new size: everything that depends on the world size (the data shard,
  the learning rate) is derived at its top. A new node's workers receive the state from
  a survivor, not from a checkpoint file.

Without `--elastic-mode=in-process` (elasticrun's default restart mode) each round runs
the script in fresh workers, and `state.commit()` copies the state into host memory the
agent keeps: a restarted worker resumes at its last commit (`state.restored_from` "own
memory"; a new node's ranks get it from a survivor), with no file read. Under torchrun
it runs once at a fixed size. The data is generated (a noisy linear function), so
nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from elasticrun.worker import elastic


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="per-worker batch size")
    p.add_argument("--lr", type=float, default=0.02, help="learning rate for one worker")
    p.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step (to watch it)")
    return p.parse_args()


def make_data(n: int = 4096, dim: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g)
    y = x @ w + 0.01 * torch.randn(n, 1, generator=g)
    return x, y


def main() -> None:
    args = parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)

    model = nn.Linear(16, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    state = elastic.State(model=model, optimizer=opt, step=0)
    x, y = make_data()
    loss_fn = nn.MSELoss()

    @elastic.run(backend=backend)
    def train(state: elastic.State) -> None:
        # A new round: the group has its new size, the state is the last commit.
        rank, world = dist.get_rank(), dist.get_world_size()
        lr = args.lr * world  # a world-size times larger global batch takes a larger step
        for group in opt.param_groups:
            group["lr"] = lr
        shard = torch.arange(rank, len(x), world)  # re-sharded for this world size
        print(f"rank {rank} pid {os.getpid()}: round at step {state.step}, world size {world}, lr {lr:.3f}", flush=True)
        while state.step < args.steps:
            gen = torch.Generator().manual_seed(state.step * 7919 + rank)
            idx = shard[torch.randint(len(shard), (args.batch_size,), generator=gen)]
            xb, yb = x[idx].to(device), y[idx].to(device)
            opt.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            state.step += 1
            state.commit()
            if rank == 0:
                print(f"Step #{state.step}  Loss: {total.item() / world:.5f}  (world size {world})", flush=True)
            time.sleep(args.step_time)

    train(state)  # returns once every rank reached --steps; the group is gone then


if __name__ == "__main__":
    main()
