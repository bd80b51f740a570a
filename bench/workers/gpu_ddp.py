"""bench/gpu_check.py's worker for the waits row: a plain DDP script on nccl, timed by the boot.

Nothing of elasticrun in its training: a model in `DistributedDataParallel` on the GPU (nccl; on a
CPU node, gloo and the CPU), --steps optimizer steps. The worker boot times each step
(from the optimizer's step) and each wait in DDP's gradient all-reduce: on nccl with
CUDA events on the stream, read once the GPU has passed them, never by synchronising.
At the end it prints the summary the boot writes for the agent:

    steps file: {"pid": 4242, "source": "optimizer", "steps": 59, "compute": 0.031, "wall": 0.032, ...}
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from gpu_device import join_group
from torch.nn.parallel import DistributedDataParallel

from elasticrun.worker import steptime


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    device = join_group()
    cuda = device.type == "cuda"
    width = 4096 if cuda else 256
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(8))).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    batch = torch.randn(1024, width, device=device)
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = ddp(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        loss.item()  # a script's logging: the host waits for its GPU here
    # what the boot's recorder writes into the steps file the agent reads (the boot takes
    # the file's name out of the script's environment; the recorder is there only under it)
    recorder = steptime._recorder
    summary = recorder.summary(time.time()) if recorder is not None else {}
    print(f"steps file: {json.dumps(summary)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
