"""Print one line to stdout and one to stderr, naming the attempt and rank (plain python).

With argv `fail-first <dir>`, attempt 0 fails once every rank has printed: each rank
marks <dir>/printed_<rank>, and rank 0 exits 1 when all marks are there (for restarts).
"""

import os
import sys
import time
from pathlib import Path

rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"out rank={rank} attempt={attempt}", flush=True)
print(f"err rank={rank} attempt={attempt}", file=sys.stderr, flush=True)
if sys.argv[1:2] == ["fail-first"] and attempt == "0":
    marks = Path(sys.argv[2])
    (marks / f"printed_{rank}").touch()
    if rank == "0":
        deadline = time.monotonic() + 30
        while len(list(marks.glob("printed_*"))) < int(os.environ["WORLD_SIZE"]):
            if time.monotonic() > deadline:
                sys.exit(7)
            time.sleep(0.02)
        sys.exit(1)
