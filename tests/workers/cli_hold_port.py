"""Hold MASTER_ADDR:MASTER_PORT open (as rank 0 hosting a store would), report it, wait.

argv: <ready file> <go file>. Writes the port to the ready file once listening, then waits
until the go file exists (bounded), and exits 0.
"""

import os
import socket
import sys
import time
from pathlib import Path

ready, go = Path(sys.argv[1]), Path(sys.argv[2])
with socket.create_server((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))):
    tmp = ready.with_suffix(".tmp")
    tmp.write_text(os.environ["MASTER_PORT"])
    tmp.rename(ready)
    deadline = time.monotonic() + 60
    while not go.exists():
        if time.monotonic() > deadline:
            sys.exit(7)
        time.sleep(0.05)
