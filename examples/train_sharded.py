"""A sharded job: each rank holds a slice of the model, kept across restarts and re-sharded at a new size.

Run it under elasticrun (restart mode, the default) on any number of nodes:

    python -m elasticrun --nnodes=1:4 --nproc-per-node=2 \
        --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=sharded \
        examples/train_sharded.py --steps 300

The model is a linear regression whose weights are split over the ranks by feature, as
tensor parallelism splits a layer: rank r of world W holds the weights of features
[r*F/W, (r+1)*F/W) and their momentum, and nothing else. A step computes each rank's
part of the prediction, all-reduces the parts, and updates the rank's own slice. What
survives (see docs/in-process.md, "Restart mode"):

- the slices and the step live in an `elastic.ShardedState`; `state.commit(every=...)`
  copies each rank's slice into host memory its agent keeps, so a worker that dies
  (killed, out of memory) is restarted at its last commit, with no file read
  (`state.restored`, from "own memory");
- when the world size changes (a node joins or is lost), no rank has a commit of its new
  rank and size: `state.earlier` offers the last commit the group holds, made at the old
  size, and each rank gathers the old slices that overlap its new one
  (`state.earlier.gather`); a slice that went with a lost node (`state.earlier.lost`)
  cannot be rebuilt, and the job starts again from its initial weights (a real job
  loads its own checkpoint there).

The data is generated (a noisy linear function), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from elasticrun.worker import elastic

FEATURES = 64


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--batch-size", type=int, default=64, help="samples per step (every rank sees the same)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--commit-every", type=int, default=5, help="steps between commits to host memory")
    p.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step (to watch it)")
    return p.parse_args()


def bounds(rank: int, world: int) -> tuple[int, int]:
    """The features rank `rank` of `world` holds."""
    return rank * FEATURES // world, (rank + 1) * FEATURES // world


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's samples, the same on every rank (each uses its own features of them)."""
    truth = torch.linspace(-1, 1, FEATURES)
    g = torch.Generator().manual_seed(step)
    x = torch.randn(size, FEATURES, generator=g)
    return x, x @ truth + 0.01 * torch.randn(size, generator=g)


def resharded(earlier: elastic.EarlierShards, lo: int, hi: int) -> tuple[dict[str, torch.Tensor], int]:
    """This rank's slice [lo, hi) of every sharded tensor, cut from the old ranks' slices that overlap it."""
    spans = {r: bounds(r, earlier.world) for r in range(earlier.world)}
    shards = earlier.gather([r for r, (a, b) in spans.items() if max(a, lo) < min(b, hi)])
    first = min(shards)
    start = spans[first][0]
    cut = {
        name: torch.cat([shards[r][name] for r in sorted(shards)])[lo - start : hi - start].clone()
        for name in ("weights", "momentum")
    }
    return cut, shards[first]["step"]


def main() -> None:
    args = parse_args()
    state = elastic.ShardedState(weights=torch.zeros(0), momentum=torch.zeros(0), step=0)

    @elastic.run(backend="gloo")
    def train(state: elastic.ShardedState) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        lo, hi = bounds(rank, world)
        if state.restored:
            how = f"its own commit ({state.restored_from})"
        elif state.earlier is not None and not state.earlier.lost:
            cut, state.step = resharded(state.earlier, lo, hi)
            state.weights, state.momentum = cut["weights"], cut["momentum"]
            how = f"the slices of world size {state.earlier.world}, re-sharded"
        else:
            state.weights, state.momentum, state.step = torch.zeros(hi - lo), torch.zeros(hi - lo), 0
            how = "the start" if state.earlier is None else f"the start: slices {list(state.earlier.lost)} were lost"
        if rank == 0:
            print(f"world size {world}: resumed at step {state.step} from {how}", flush=True)
        while state.step < args.steps:
            x, y = batch(state.step, args.batch_size)
            mine = x[:, lo:hi]
            prediction = mine @ state.weights
            dist.all_reduce(prediction)  # the parts of every rank's features
            error = prediction - y
            grad = mine.T @ error / args.batch_size
            state.momentum = args.momentum * state.momentum + grad
            state.weights = state.weights - args.lr * state.momentum
            state.step += 1
            state.commit(every=args.commit_every)
            if rank == 0 and state.step % 20 == 0:
                print(f"step {state.step}  loss {float((error**2).mean()):.5f}  (world size {world})", flush=True)
            time.sleep(args.step_time)

    train(state)


if __name__ == "__main__":
    main()
