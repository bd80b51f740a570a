"""The in-process benchmark's worker: one script under torchrun, restart mode and
in-process mode (it trains through `elasticrun.worker.elastic.run`, which under torchrun
and restart mode just makes the group from the environment and runs once).

A real training step: an MLP of 4.2M parameters (1024-2048-1024, 17 MB of weights), SGD
with momentum, gradients averaged over the group, a checkpoint by rank 0 every 20 steps
(weights, optimizer, step; written atomically) that a fresh process loads at start, as
restart-based recovery needs. Event lines as bench/workers/elastic_loop.py's:
  start  - first line of the script, before torch is imported
  init   - the training function was entered (group up, state synced)
  step   - one step done, with the world size
and `ckpt_load` (seconds spent loading the checkpoint at start).
"""

import os
import time

from bench_events import T0, event

# isort: split
# bench_events stays above torch's import: importing it stamps the script's start (T0)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from elasticrun.worker import elastic  # noqa: E402

CKPT = os.path.join(os.environ["BENCH_CKPT_DIR"], "ckpt.pt")
interval = float(os.environ.get("BENCH_STEP_INTERVAL", "0.1"))
deadline = T0 + float(os.environ.get("BENCH_MAX_SECONDS", "300"))

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
state = elastic.State(model=model, optimizer=optimizer, step=0)
if os.path.exists(CKPT):
    t = time.time()
    saved = torch.load(CKPT, weights_only=False)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    state.step = saved["step"]
    state.commit()
    event("ckpt_load", s=time.time() - t, step=state.step)


@elastic.run(backend="gloo")
def train(state):
    rank, world = dist.get_rank(), dist.get_world_size()
    event("init", rank=rank, world=world, step=state.step)
    while time.time() < deadline:
        x = torch.randn(32, 1024)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        optimizer.step()
        state.step += 1
        event("step", step=state.step, world=world, rank=rank)
        if rank == 0 and state.step % 20 == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": state.step},
                       CKPT + ".tmp")
            os.replace(CKPT + ".tmp", CKPT)
        state.commit()
        time.sleep(interval)


train(state)
