"""Use torch's file timer as a torchrun worker would: rank 1 overruns a 1 s timer (and is
killed, so "survived" never prints), rank 0 keeps within its timer and exits 0.

Rank 1 starts its timer only once rank 0 has said so (a file in the folder argv[1]):
on a loaded machine rank 0 may still be importing torch a second after rank 1 started,
and the group stopped for rank 1's kill would take rank 0 with it before it printed."""

import os
import sys
import time
from pathlib import Path

from torch.distributed.elastic import timer

timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
done = Path(sys.argv[1]) / "rank0-done"
if os.environ["RANK"] == "1":
    deadline = time.monotonic() + 60
    while not done.exists():
        if time.monotonic() > deadline:
            sys.exit("rank 0 never finished its fast step")
        time.sleep(0.01)
    with timer.expires(after=1, scope="slow step"):
        time.sleep(60)
    print("survived", flush=True)
    sys.exit(0)
with timer.expires(after=60, scope="fast step"):
    pass
print("fast step done", flush=True)
done.touch()
