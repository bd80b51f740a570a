"""A torch worker: launched as torchelastic says, gloo init, all_reduce of the ranks."""

import os
import sys

import torch
import torch.distributed as dist

assert dist.is_torchelastic_launched(), "is_torchelastic_launched() is False"
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
total = torch.tensor([rank + 1])
dist.all_reduce(total)
expected = world * (world + 1) // 2
dist.destroy_process_group()
print(f"rank {rank}/{world} all_reduce {int(total)} expected {expected}", flush=True)
sys.exit(0 if int(total) == expected else 5)
