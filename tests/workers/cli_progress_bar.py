"""Draw a progress bar on stderr with \r, as tqdm does: frame 1, then (once <go> exists)
frame 2 and the newline that ends it (plain python). argv: <go file>."""

import sys
import time
from pathlib import Path

go = Path(sys.argv[1])
sys.stderr.write("\rstep 1/2 [#    ]")
sys.stderr.flush()
deadline = time.monotonic() + 60
while not go.exists():
    if time.monotonic() > deadline:
        sys.exit(7)
    time.sleep(0.02)
sys.stderr.write("\rstep 2/2 [#####]\n")
sys.stderr.flush()
print("done", flush=True)
