"""Cyclic garbage collection tuned for elasticrun's own long-running processes.

Why: the agent that hosts the store (or `elasticrun store serve`) holds every client's
streams, and grpc.aio keeps ~75 GC-tracked objects per open stream: ~175,000 for 1,000
nodes, each with a lease keep-alive stream and a watch. With CPython's default
thresholds (700, 10, 10) the collector runs a young collection every few hundred
allocations — several inside each fan-out of a change to 1,000 watchers — and, under
keep-alive traffic alone, full collections over all of those objects (88–131 ms each,
three in a 35-second run) during which no watcher is served. That was the tail of the
store's notification latency (`bench/bench_store.py --only-scale`, BENCHMARKS.md).

Almost nothing these processes allocate is cyclic garbage (reference counting frees it
at once), so collecting far less often costs no measurable memory: a young collection
every 50,000 allocations instead of 700, a full one after every 100 young ones as
before (so about 70 times rarer). What was imported before the loop starts lives as
long as the process and is frozen out of every collection. Worker processes are
separate programs and keep their own settings.
"""

from __future__ import annotations

import gc

#: Allocations between young collections (CPython's default is 700).
YOUNG_THRESHOLD = 50_000


def settle_gc() -> None:
    """Apply the settings above to this process; call it once, before the loop starts.

    No collection before the freeze: importing leaves no cyclic garbage behind (a
    collection at that point finds nothing and costs ~10 ms of every agent's start)."""
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, 10, 10)
