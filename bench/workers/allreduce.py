"""A worker that joins a gloo process group, all_reduces one tensor, and leaves."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(4)
dist.all_reduce(t)
assert int(t[0]) == dist.get_world_size()
dist.destroy_process_group()
