"""A restart-mode job whose ShardedState is re-sharded when the world size changes (tests/test_state_restart.py).

A vector of --numel values is split over the ranks in contiguous slices: rank r of world
W holds [r*n/W, (r+1)*n/W). Each step adds 1 to every value, so at step s the value at i
is i + s. Each rank keeps its slice and the step in an `elastic.ShardedState`, commits each
step and prints `step=S rank=R world=W`. Started afresh, it stops stepping at --hold-at
(so that the test changes the world at a known step). When the function starts it prints

    begin rank=R world=W restored=False earlier=2/7 lost=[] step=7 intact=True from=nothing

`earlier` is the state's EarlierShards (world size/commits, or none). With one whose
shards are all held, the rank gathers the old slices that overlap its own, builds its
slice from them and resumes at their step (`intact`: exactly the values of that step);
otherwise it starts from step 0. It ends at --steps (exit 0).
"""

from __future__ import annotations

import argparse
import signal


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--numel", type=int, default=1200)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--hold-at", type=int, default=6)
    p.add_argument("--stop-file")  # given to every worker of tests/support/elastic_cluster.py's agents
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    from elasticrun.worker import elastic

    def bounds(rank: int, world: int) -> tuple[int, int]:
        return rank * args.numel // world, (rank + 1) * args.numel // world

    state = elastic.ShardedState(shard=torch.zeros(0, dtype=torch.int64), step=0)

    @elastic.run(backend="gloo")
    def train(state: elastic.ShardedState) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        lo, hi = bounds(rank, world)
        earlier = state.earlier
        fresh = not state.restored and earlier is None
        if not state.restored:
            state.shard, state.step = torch.arange(lo, hi, dtype=torch.int64), 0
            if earlier is not None and not earlier.lost:
                spans = {r: bounds(r, earlier.world) for r in range(earlier.world)}
                needed = [r for r, (a, b) in spans.items() if max(a, lo) < min(b, hi)]
                shards = earlier.gather(needed)
                old = torch.cat([shards[r]["shard"] for r in sorted(shards)])
                start = spans[min(shards)][0]
                state.shard = old[lo - start : hi - start].clone()
                state.step = shards[min(shards)]["step"]
        intact = torch.equal(state.shard, torch.arange(lo, hi, dtype=torch.int64) + state.step)
        said = "none" if earlier is None else f"{earlier.world}/{earlier.commits}"
        lost = [] if earlier is None else list(earlier.lost)
        print(f"begin rank={rank} world={world} restored={state.restored} earlier={said} lost={lost} "
              f"step={state.step} intact={intact} from={state.restored_from}", flush=True)
        while state.step < args.steps:
            while fresh and state.step >= args.hold_at:
                signal.pause()  # the test changes the world now: the agent stops this worker
            state.shard += 1
            state.step += 1
            flag = torch.ones(1)
            dist.all_reduce(flag)  # in step with the others, as training is
            state.commit()
            print(f"step={state.step} rank={rank} world={world}", flush=True)

    train(state)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
