"""Print one line to stdout and one to stderr, naming the attempt and rank (plain python).

With argv[1] == "fail-first", attempt 0 exits 1 after printing (for restart tests).
"""

import os
import sys

rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"out rank={rank} attempt={attempt}", flush=True)
print(f"err rank={rank} attempt={attempt}", file=sys.stderr, flush=True)
if sys.argv[1:] == ["fail-first"] and attempt == "0":
    sys.exit(1)
