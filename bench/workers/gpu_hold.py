"""bench/gpu_check.py's worker for the reclaim and standby rows: hold memory, be killed, start again.

The first attempt (TORCHELASTIC_RESTART_COUNT=0) allocates --gib GiB on its GPU (in RAM
on a CPU node), touches all of it, says so with its pid, and waits to be SIGKILLed.
The next attempt says when it started and its pid (its first line, before torch is
imported: what the check times is the agent's, not torch's import; a warm standby has
imported torch already), how much of the GPU is free, and when its first work on the
device was done, then exits 0.
"""

from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402
import os  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--gib", type=float, required=True)
args = p.parse_args()

if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
    print(f"next worker started at {STARTED:.6f} (pid {os.getpid()})", flush=True)
    import torch

    device = "cpu"
    if torch.cuda.is_available():
        device = "cuda"
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        free, total = torch.cuda.mem_get_info()
        print(f"next worker sees {free / 2**30:.1f} of {total / 2**30:.1f} GiB free", flush=True)
    (torch.ones(1024, 1024, device=device) @ torch.ones(1024, 1024, device=device)).sum().item()
    print(f"next worker's first work on {device} done at {time.time():.6f}", flush=True)
    raise SystemExit(0)

size = int(args.gib * 2**30)
import torch  # noqa: E402

if torch.cuda.is_available():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    held = torch.ones(size // 4, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
else:
    held = torch.ones(size // 4, dtype=torch.float32)
print(f"holding {held.numel() * 4 / 2**30:.1f} GiB on {held.device}, pid {os.getpid()}", flush=True)
while True:
    time.sleep(60)
