"""Use torch's file timer as a torchrun worker would: rank 1 overruns a 1 s timer (and is
killed, so "survived" never prints), rank 0 keeps within its timer and exits 0."""

import os
import sys
import time

from torch.distributed.elastic import timer

timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
if os.environ["RANK"] == "1":
    with timer.expires(after=1, scope="slow step"):
        time.sleep(60)
    print("survived", flush=True)
    sys.exit(0)
with timer.expires(after=60, scope="fast step"):
    pass
print("fast step done", flush=True)
