"""Elastic training of a small model, the way an elastic job should be written.

Run it under elasticrun (or torchrun) on any number of nodes:

    python -m elasticrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=c10d \
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo examples/train_elastic.py \
        --steps 300 --checkpoint-dir /tmp/demo-ckpt

What makes it elastic:
- it checkpoints atomically every N steps to a shared directory and resumes from the
  newest checkpoint on every (re)start, so a membership change costs at most N steps;
- it shards the data by the current rank and world size, so a new world size simply
  re-shards;
- the learning rate scales with the world size (the global batch grows with it);
- it uses gloo on CPU and nccl on GPU, chosen automatically.

The data is generated (a noisy linear function), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="per-worker batch size")
    p.add_argument("--lr", type=float, default=0.02, help="learning rate for one worker")
    p.add_argument("--checkpoint-dir", default="/tmp/elasticrun-demo-ckpt")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step (to watch it)")
    return p.parse_args()


def make_data(n: int = 4096, dim: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g)
    y = x @ w + 0.01 * torch.randn(n, 1, generator=g)
    return x, y


def save_checkpoint(path: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Write to a temporary file, then rename: a reader never sees half a checkpoint."""
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f"ckpt.pt.tmp.{os.getpid()}"
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, tmp)
    os.replace(tmp, path / "ckpt.pt")


def load_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> int:
    file = path / "ckpt.pt"
    if not file.exists():
        return 0
    state = torch.load(file, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return int(state["step"])


def main() -> None:
    args = parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")

    model = nn.Linear(16, 1).to(device)
    lr = args.lr * world  # a world-size times larger global batch takes a larger step
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ckpt = Path(args.checkpoint_dir)
    step = load_checkpoint(ckpt, model, opt)
    for group in opt.param_groups:
        group["lr"] = lr
    # Every rank starts from rank 0's step and weights, whatever it loaded.
    start = torch.tensor([step], device=device)
    dist.broadcast(start, src=0)
    step = int(start.item())
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    if rank == 0:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        print(f"start at step {step}: world size {world}, lr {lr:.3f}, restart count {restart}", flush=True)

    x, y = make_data()
    shard = torch.arange(rank, len(x), world)  # re-sharded for this world size
    gen = torch.Generator().manual_seed(step * 7919 + rank)
    loss_fn = nn.MSELoss()
    while step < args.steps:
        idx = shard[torch.randint(len(shard), (args.batch_size,), generator=gen)]
        xb, yb = x[idx].to(device), y[idx].to(device)
        opt.zero_grad()
        loss = loss_fn(model(xb), yb)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        step += 1
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"Step #{step}  Loss: {total.item() / world:.5f}  (world size {world})", flush=True)
            if step % args.checkpoint_every == 0 or step == args.steps:
                save_checkpoint(ckpt, step, model, opt)
        time.sleep(args.step_time)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
