"""Use torch's file timer as a torchrun worker would: rank 1 overruns a 1 s timer (and is
killed, so "survived" never prints), rank 0 keeps within its timer and exits 0.

Rank 1 starts its timer only once rank 0 is done: on a loaded machine rank 0 may still
be importing torch a second after rank 1 started, and the group stopped for rank 1's
kill would take rank 0 with it before it printed. argv[1] is a FIFO the test made:
rank 1's read of it ends when rank 0, done, has opened and closed it."""

import os
import sys
import time
from pathlib import Path

from torch.distributed.elastic import timer

timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
rank0_done = Path(sys.argv[1])
if os.environ["RANK"] == "1":
    rank0_done.read_bytes()  # returns at rank 0's close
    with timer.expires(after=1, scope="slow step"):
        time.sleep(60)
    print("survived", flush=True)
    sys.exit(0)
with timer.expires(after=60, scope="fast step"):
    pass
print("fast step done", flush=True)
rank0_done.write_bytes(b"")
