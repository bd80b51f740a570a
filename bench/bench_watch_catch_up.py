"""How long a watch that catches up through a long history holds the store's loop.

    python bench/bench_watch_catch_up.py                  # 300,000 writes, ~10 s
    python bench/bench_watch_catch_up.py --writes 100000 --json /tmp/catch_up.json

One `MemoryStore` (the engine of `elasticrun store serve`) in this process takes
`--writes` puts of 10-byte values, one in ten to `job/<i % 100>`, the others to
`busy/<i % 1000>`, then one put to each `quiet/<j>`. Then, for each case, 1 and 10
watches open at once from revision 1 and read until each has its last catch-up event,
while a ticker task on the same loop does `await asyncio.sleep(0)` in a loop:

  exact key    watch("quiet/<j>"): one event, at the very end of the history
  prefix       watch("quiet/<j>", prefix): the same, through the prefix path
  prefix 1/10  watch("job/", prefix): one event in ten of the history (writes/10)

Reported per case: the longest gap between two ticks, i.e. the longest loop iteration
(a keep-alive arriving then waits that long; with 10 watches one iteration holds a turn
of each), in wall time and in this thread's CPU time (the same, less the time other
processes had the core: the figure to read on a shared box); and the wall time until
every watch had caught up. The store collects garbage as `elasticrun store serve` does
(--default-gc: CPython's defaults). Nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from common import add_default_gc_flag, apply_default_gc_flag, settle_gc, write_json  # noqa: E402

from elasticrun.store.server.memory import MemoryStore  # noqa: E402

QUIET_KEYS = 10


async def fill(store: MemoryStore, writes: int) -> float:
    """The history of the docstring; returns the puts per second it took."""
    start = time.perf_counter()
    for i in range(writes):
        key = f"job/{i % 100}" if i % 10 == 0 else f"busy/{i % 1000}"
        await store.put(key, b"x" * 10)
    rate = writes / (time.perf_counter() - start)
    for j in range(QUIET_KEYS):
        await store.put(f"quiet/{j}", b"news")
    return rate


async def catch_up(store: MemoryStore, key: str, prefix: bool, last: int) -> int:
    """Read the watch from revision 1 until the event of revision `last`; the event count."""
    seen = 0
    watch = store.watch(key, start_revision=1, prefix=prefix)
    try:
        async for event in watch:
            seen += 1
            if event.revision >= last:
                return seen
    finally:
        await watch.aclose()
    raise AssertionError("the watch ended")


async def ticker(gaps: list[float], done: asyncio.Event) -> None:
    """Tick the loop until `done`, keeping the longest gap between two ticks in wall
    time in gaps[0], in this thread's CPU time in gaps[1]."""
    last, last_cpu = time.perf_counter(), time.thread_time()
    while not done.is_set():
        await asyncio.sleep(0)
        now, now_cpu = time.perf_counter(), time.thread_time()
        gaps[0] = max(gaps[0], now - last)
        gaps[1] = max(gaps[1], now_cpu - last_cpu)
        last, last_cpu = now, now_cpu


async def trial(store: MemoryStore, watches: list[tuple[str, bool, int]]) -> dict[str, float]:
    """Open `watches` (key, prefix, last revision) at once; the longest tick gaps and wall."""
    gaps, done = [0.0, 0.0], asyncio.Event()
    tick = asyncio.create_task(ticker(gaps, done))
    await asyncio.sleep(0)  # the ticker is ticking before the first watch opens
    start = time.perf_counter()
    counts = await asyncio.gather(*(catch_up(store, *w) for w in watches))
    wall = time.perf_counter() - start
    done.set()
    await tick
    return {
        "max_gap_ms": gaps[0] * 1e3,
        "max_gap_cpu_ms": gaps[1] * 1e3,
        "wall_ms": wall * 1e3,
        "events": float(sum(counts)),
    }


async def main(args: argparse.Namespace) -> None:
    settle_gc()
    store = MemoryStore()
    rate = await fill(store, args.writes)
    job_last = max(kv.mod_revision for kv in (await store.get_prefix("job/")).kvs)
    print(f"# watch catch-up bench, python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    print(f"{args.writes:,} writes at {rate:,.0f} puts/s; revision {store.revision:,}\n")
    print(
        "| watch from revision 1 | watches | events read | loop held, max ms "
        "| the same in CPU ms | wall ms |"
    )
    print("|---|---|---|---|---|---|")
    quiet = [(f"quiet/{j}", store.revision - QUIET_KEYS + 1 + j) for j in range(QUIET_KEYS)]
    cases = {
        "exact key": [(key, False, last) for key, last in quiet],
        "prefix": [(key, True, last) for key, last in quiet],
        "prefix 1/10": [("job/", True, job_last)] * QUIET_KEYS,
    }
    results = []
    for name, watches in cases.items():
        for n in (1, QUIET_KEYS):
            r = await trial(store, watches[:n])
            results.append({"case": name, "watches": n, **r})
            print(
                f"| {name} | {n} | {r['events']:,.0f} | {r['max_gap_ms']:,.1f} "
                f"| {r['max_gap_cpu_ms']:,.1f} | {r['wall_ms']:,.0f} |",
                flush=True,
            )
    await store.close()
    write_json(args.json, {"writes": args.writes, "puts_per_s": rate, "results": results})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--writes", type=int, default=300_000, help="history length")
    parser.add_argument("--json", help="also write the results to this file")
    add_default_gc_flag(parser)
    args = parser.parse_args()
    apply_default_gc_flag(args)
    asyncio.run(main(args))
