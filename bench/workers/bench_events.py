"""Event lines of the benchmarks' workers; import it first (it notes the script's start).

One JSON line per event to $BENCH_EVENTS/<pid>.log with its wall-clock time `t`; the
`start` event (before torch is imported) is written on import.
"""

import json
import os
import time

T0 = time.time()
_out = open(os.path.join(os.environ["BENCH_EVENTS"], f"{os.getpid()}.log"), "a", buffering=1)
_node = os.environ.get("BENCH_NODE", "?")


def event(kind, **fields):
    _out.write(json.dumps({"t": time.time(), "ev": kind, "node": _node, "pid": os.getpid(), **fields}) + "\n")


event("start", t_script=T0, world=int(os.environ.get("WORLD_SIZE", "0")), rank=int(os.environ.get("RANK", "-1")),
      restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
