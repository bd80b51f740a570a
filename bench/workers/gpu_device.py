"""What bench/gpu_check.py's GPU workers share: their device and their process group."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def join_group() -> torch.device:
    """This worker's GPU (its LOCAL_RANK's) in an nccl group; the CPU and gloo on a node without one."""
    if not torch.cuda.is_available():
        dist.init_process_group("gloo")
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    return device
