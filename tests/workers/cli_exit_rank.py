"""On global rank argv[2], exit with code argv[1] (or kill itself with that signal name,
e.g. SIGKILL); every other rank exits 0 (plain python), or with argv[3] `wait` waits to
be stopped (so that the failure always finds it running)."""

import os
import signal
import sys
import time

how, bad_rank = sys.argv[1], sys.argv[2]
if os.environ["RANK"] == bad_rank:
    if how.startswith("SIG"):
        os.kill(os.getpid(), signal.Signals[how])
    sys.exit(int(how))
if sys.argv[3:] == ["wait"]:
    time.sleep(120)
