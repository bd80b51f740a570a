"""The elastic benchmark's worker, the same script under both launchers.

Writes one JSON line per event to $BENCH_EVENTS/<pid>.log (wall-clock `t`):
  start  - first line of the script, before torch is imported
  init   - the gloo process group is up
  step   - one all_reduce and optimizer step done: `step N world W`
  crash  - this worker claimed $BENCH_CRASH_FILE and exits 1 (a one-off failure)
It steps every $BENCH_STEP_INTERVAL seconds (default 0.1) and exits 0 after
$BENCH_MAX_SECONDS (default 300), a safety net only.
"""

import os
import time

from bench_events import T0, event

# isort: split
# bench_events stays above torch's import: importing it stamps the script's start (T0)
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
event("init", rank=rank, world=world)
crash_file = os.environ.get("BENCH_CRASH_FILE", "")
interval = float(os.environ.get("BENCH_STEP_INTERVAL", "0.1"))
deadline = T0 + float(os.environ.get("BENCH_MAX_SECONDS", "300"))
step, t = 0, torch.ones(1)
weight = torch.nn.Parameter(torch.ones(1))
opt = torch.optim.SGD([weight], lr=0.0)  # a step as training makes one (launchers may watch them)
while time.time() < deadline:
    dist.all_reduce(t)
    weight.grad = t
    opt.step()
    step += 1
    event("step", step=step, world=world, rank=rank)
    print(f"{time.time():.3f} step {step} world {world}", flush=True)
    if crash_file:
        try:
            os.rename(crash_file, f"{crash_file}.taken.{os.getpid()}")
        except FileNotFoundError:
            pass
        else:
            event("crash", rank=rank, world=world)
            os._exit(1)
    time.sleep(interval)
dist.destroy_process_group()
