"""Exit with code argv[1] on global rank argv[2]; every other rank exits 0 (plain python)."""

import os
import sys

code, bad_rank = int(sys.argv[1]), sys.argv[2]
sys.exit(code if os.environ["RANK"] == bad_rank else 0)
