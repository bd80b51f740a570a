"""Every rank of tests/test_inprocess_parts.py's State.sync() check, one forked process each.

argv: port commits out_dir [survivor_port], commits being one count per rank ("0,3,1": three
ranks); or port `frozen` out_dir port2 port3: a frozen node (`run_frozen`). The ranks fork
from this process once it has imported torch, so the check pays for one import of torch
(and of torch._dynamo) instead of one per rank (most of its time on two cores); any rank
failing ends the others and the exit status is 1. Every rank builds the same model and an Adam
optimizer (its step counters are CPU tensors, its moments tensors), then makes its
state differ: `commits` commits after training steps on rank-specific data (0: a fresh
worker, whose optimizer has no state at all). Each rank writes its state before and
after sync() to out_dir/<rank>.{before,after}.pt for the test to compare.

With survivor_port, ranks 0 and 1 are survivors of an earlier round: they first sync in
a group of two on that port, then each sets its own `tag` and commits once more (same
count, different tag), so the test can see which rank a newcomer got its state from
and that survivors kept their own.
"""

import ctypes
import os
import signal
import sys
import traceback

import torch
import torch.distributed as dist

from elasticrun.worker.elastic import State
from elasticrun.worker.elastic import state as state_module

PR_SET_PDEATHSIG = 1


def run_rank(rank: int, world: int, port: int, commits: int, out: str, survivor_port: int | None) -> None:
    state_module._BUCKET_BYTES = 4096  # several buckets, and tensors bigger than one

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    state = State(model=model, optimizer=optimizer, step=0, best=torch.tensor([float(rank)]), tag=f"rank{rank}")
    torch.manual_seed(100 + rank)
    for _ in range(commits):
        optimizer.zero_grad()
        model(torch.randn(5, 8)).pow(2).sum().backward()
        optimizer.step()
        state.step += 1
        state.best = state.best + 1
        state.commit()

    def snapshot(path: str) -> None:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "step": state.step, "best": state.best, "tag": state.tag, "commits": state.commits}, path)

    if survivor_port is not None and rank < 2:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{survivor_port}", rank=rank, world_size=2)
        state.sync()
        dist.destroy_process_group()
        state.tag = f"survivor{rank}"
        state.commit()
    snapshot(f"{out}/{rank}.before.pt")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    state.sync()
    snapshot(f"{out}/{rank}.after.pt")
    dist.destroy_process_group()


def run_frozen(rank: int, ports: list[int], out: str) -> None:
    """The frozen node, rank 2 of 3: all three sync in round 1 and commit once;
    rank 2 commits one step more (then freezes); ranks 0 and 1 go on in round 2 without
    it and commit once (as many commits as rank 2 now, another state); all three meet in
    round 3."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    state = State(model=model, step=0, tag="start")

    def group(round_number: int, port: int, world: int, ranks: int) -> None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=ranks, world_size=world)
        state._attach(None, round_number)
        state.sync()

    def step(tag: str) -> None:
        with torch.no_grad():
            model.weight.add_(1.0 if tag == "survivors" else 100.0)
        state.step += 1
        state.tag = tag
        state.commit()

    group(1, ports[0], 3, rank)
    step("round 1")
    dist.destroy_process_group()
    if rank == 2:
        step("frozen")  # its last step before it froze: one more than the others
    else:
        group(2, ports[1], 2, rank)
        step("survivors")
        dist.destroy_process_group()
    torch.save({"tag": state.tag, "step": state.step, "weight": model.weight.clone(), "commits": state.commits},
               f"{out}/{rank}.before.pt")
    group(3, ports[2], 3, rank)
    torch.save({"tag": state.tag, "step": state.step, "weight": model.weight.clone(), "commits": state.commits},
               f"{out}/{rank}.after.pt")
    dist.destroy_process_group()


def main() -> int:
    port, out = int(sys.argv[1]), sys.argv[3]
    frozen = sys.argv[2] == "frozen"
    commits = [0, 0, 0] if frozen else [int(c) for c in sys.argv[2].split(",")]
    survivor_port = int(sys.argv[4]) if len(sys.argv) > 4 else None
    # An optimizer's constructor imports torch._dynamo (as long again as torch): once here
    import torch._dynamo  # noqa: F401

    children = []
    parent = os.getpid()
    for rank, count in enumerate(commits):
        pid = os.fork()
        if pid == 0:
            # a rank dies with this process (the test stops only it, by PID)
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:
                os._exit(1)
            try:
                if frozen:
                    run_frozen(rank, [port, *map(int, sys.argv[4:6])], out)
                else:
                    run_rank(rank, len(commits), port, count, out, survivor_port)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)  # never back into the parent's loop
        children.append(pid)
    failed = False
    while children:
        pid, status = os.wait()
        children.remove(pid)
        if status != 0 and not failed:
            failed = True
            for other in children:  # the rest would wait for the failed rank forever
                os.kill(other, signal.SIGKILL)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
