"""The stacks benchmark's worker: one rank stuck in a function, the others in an all-reduce.

gloo, one all_reduce every $BENCH_STEP_INTERVAL seconds (default 0.05), a heartbeat()
each step (and from a thread while torch loads and the group forms: the watchdog is
about the loop). In the first attempt, rank $BENCH_STUCK_RANK calls load_batch() at step
$BENCH_STUCK_STEP and never returns; the others wait for it in the all-reduce. Later
attempts step until $BENCH_MAX_SECONDS (default 300), a safety net only.
"""

import os
import threading
import time

from bench_events import T0, event

from elasticrun.worker import heartbeat

formed = threading.Event()


def beat_until_formed():
    while not formed.wait(0.2):
        heartbeat()


threading.Thread(target=beat_until_formed, daemon=True).start()

from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", timeout=timedelta(seconds=120))
formed.set()
rank, world = dist.get_rank(), dist.get_world_size()
event("init", rank=rank, world=world)
stuck_rank = int(os.environ.get("BENCH_STUCK_RANK", "1"))
stuck_step = int(os.environ.get("BENCH_STUCK_STEP", "5"))
first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
interval = float(os.environ.get("BENCH_STEP_INTERVAL", "0.05"))
deadline = T0 + float(os.environ.get("BENCH_MAX_SECONDS", "300"))


def load_batch():
    event("stuck", rank=rank, world=world)
    while True:
        time.sleep(3600)


step, t = 0, torch.ones(1)
while time.time() < deadline:
    if first and rank == stuck_rank and step == stuck_step:
        load_batch()
    heartbeat()
    dist.all_reduce(t)
    step += 1
    event("step", step=step, world=world, rank=rank)
    time.sleep(interval)
dist.destroy_process_group()
