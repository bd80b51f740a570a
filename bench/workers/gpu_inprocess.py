"""bench/gpu_check.py's worker for the in-process row: a group aborted and re-formed in place.

Run with `--elastic-mode=in-process --nproc-per-node=1`: one rank, nccl on a GPU (gloo
on a CPU node). Each step all-reduces a tensor on the device and commits. At step
--abort-at of the first round the rank aborts its own group, as the wrapper's
`GroupSession.interrupt()` does when a peer is lost (ProcessGroup.abort, ncclCommAbort;
a job of one rank has no peer to lose, and nccl cannot put two ranks on one GPU); on
gloo, whose abort does not fail the next collective, it raises instead. The next
collective fails, the wrapper rolls the state back to the last commit and reports the
round broken, the agent opens the next round, and the wrapper makes a new group in the
same process. Lines the check reads:

    restart 0 starts at step 0, pid 4242, backend nccl, at 1767000000.123456
    aborting the group at step 10, at 1767000001.234567
    abort returned at 1767000001.244567            (nccl only)
    restart 1 starts at step 10, pid 4242, backend nccl, at 1767000002.000000
    step 11 done at 1767000002.345678
    done at step 30, pid 4242
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from elasticrun.worker import elastic


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--abort-at", type=int, default=10)
    args = p.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    weights = torch.zeros(1024, device=device)
    state = elastic.State(weights=weights, step=0)
    aborted = False  # the process's own memory, not the state's: a rollback keeps it

    @elastic.run(backend=backend)
    def train(state: elastic.State) -> None:
        nonlocal aborted
        print(f"restart {os.environ['TORCHELASTIC_RESTART_COUNT']} starts at step {state.step}, pid {os.getpid()}, "
              f"backend {dist.get_backend()}, at {time.time():.6f}", flush=True)
        first = True
        while state.step < args.steps:
            if state.step == args.abort_at and not aborted:
                aborted = True
                print(f"aborting the group at step {state.step}, at {time.time():.6f}", flush=True)
                if backend == "nccl":
                    world = dist.group.WORLD
                    assert world is not None  # the wrapper made it
                    world.abort()
                    print(f"abort returned at {time.time():.6f}", flush=True)
                else:
                    raise RuntimeError("the group is broken (gloo stands in for an aborted nccl group)")
            grad = torch.ones(1024, device=device)
            dist.all_reduce(grad)
            weights.add_(grad, alpha=-0.01)
            state.step += 1
            state.commit()
            if first and aborted:
                print(f"step {state.step} done at {time.time():.6f}", flush=True)
            first = False

    train(state)
    print(f"done at step {state.step}, pid {os.getpid()}", flush=True)


if __name__ == "__main__":
    main()
