"""bench/gpu_check.py's worker for the state row: a restart-mode state on the GPU, its commit's cost, its restore.

Run with `--nproc-per-node=1 --max-restarts=1` (restart mode). A model of --mb MB of
float32 parameters and SGD with momentum (as much state again) in an `elastic.State`,
on the GPU (nccl; on a CPU node, gloo and the CPU), a batch sized so that a training
step takes about --step-ms. The first attempt times --rounds rounds of --steps steps
without a commit and with `commit()` after each, alternating (the GPU synchronised only
at the end of each round: a commit's copy runs on a side stream while the next step
computes, and only the optimizer's step waits for it), then commits two more steps,
saying so, and SIGKILLs itself right after the second (whose copy may be in flight:
then the first is restored). The next attempt is restored by `@elastic.run`
before the function runs (no file read), timed from the call to the function's first
line (the group exists already), then saves the state with `torch.save` to --disk-dir and
times `torch.load` onto the device with `load_state_dict`, as a script's own
checkpoint would restore. Lines the check reads:

    state 1024 MB on cuda:0, a step 98.1 ms (batch 4096)
    steps without a commit 98.3 ms, with commit() 99.0 ms
    committed step 40 checksum 123456789
    restored=True from=own memory step=40 checksum=123456789 in 0.512 s
    torch.load of the same state 1.234 s
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from gpu_device import join_group

from elasticrun.worker import elastic


def checksum(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """An exact sum of the state's bits (as int32 words): equal only if every value is."""
    tensors = [*model.state_dict().values(), *(s["momentum_buffer"] for s in optimizer.state.values())]
    return sum(int(t.detach().view(torch.int32).sum(dtype=torch.int64)) for t in tensors)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=512, help="MB of parameters (the state is twice that)")
    p.add_argument("--step-ms", type=float, default=100.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--disk-dir", type=Path, required=True)
    args = p.parse_args()
    device = join_group()
    cuda = device.type == "cuda"
    width = 2048 if cuda else 256
    layers = max(1, (args.mb << 20) // (width * width * 4))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers))).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-7, momentum=0.9)
    state = elastic.State(model=model, optimizer=optimizer, step=0)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def train_step(batch: torch.Tensor) -> None:
        optimizer.zero_grad()
        model(batch).sum().backward()
        optimizer.step()
        state.step += 1

    def timed(batch: torch.Tensor, steps: int, commit: bool) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            train_step(batch)
            if commit:
                state.commit()
        sync()
        return (time.perf_counter() - start) / steps

    called = time.perf_counter()

    @elastic.run
    def train(state: elastic.State) -> None:
        entered = time.perf_counter() - called
        if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
            print(f"restored={state.restored} from={state.restored_from} step={state.step} "
                  f"checksum={checksum(model, optimizer)} in {entered:.3f} s", flush=True)
            saved = args.disk_dir / "state.pt"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, saved)
            os.sync()
            sync()
            start = time.perf_counter()
            loaded = torch.load(saved, map_location=device)
            model.load_state_dict(loaded["model"])
            optimizer.load_state_dict(loaded["optimizer"])
            sync()
            print(f"torch.load of the same state {time.perf_counter() - start:.3f} s", flush=True)
            saved.unlink()
            return
        rows = 8
        while True:  # a batch whose step takes about --step-ms
            batch = torch.randn(rows, width, device=device)
            timed(batch, 1, False)
            took = timed(batch, 2, False) * 1e3
            if took >= args.step_ms or rows >= 1 << 16:
                break
            rows = max(rows + 1, int(rows * min(4.0, args.step_ms / max(took, 1e-3))))
        print(f"state {2 * layers * width * width * 4 >> 20} MB on {device}, a step {took:.1f} ms (batch {rows})",
              flush=True)
        without, with_commit = [], []
        for _ in range(args.rounds):
            without.append(timed(batch, args.steps, False))
            with_commit.append(timed(batch, args.steps, True))
        print(f"steps without a commit {statistics.median(without) * 1e3:.1f} ms, "
              f"with commit() {statistics.median(with_commit) * 1e3:.1f} ms", flush=True)
        for _ in range(2):  # killed right after the second: its copy may be in flight, then the first is restored
            train_step(batch)
            state.commit()
            print(f"committed step {state.step} checksum {checksum(model, optimizer)}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    train(state)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
