"""What `--metrics-port` costs the store server: its calls with metrics off and on.

    python bench/bench_metrics.py              # ~1 minute: 3 rounds of off/on, 4,000 calls each

`elasticrun store serve` runs in a process of its own, once without and once with
`--metrics-port`, alternately; this process makes sequential Put + Range calls to it
over gRPC (one client, so the figure is the server's per-call time plus the round
trip) and, with metrics on, scrapes /metrics 10 times a second meanwhile, as a busy
Prometheus would not. Reported: calls/s off and on (median of the rounds), their ratio,
and how long a scrape takes. Nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from common import free_port, machine  # noqa: E402

from elasticrun.store.client.grpc_store import GrpcStore  # noqa: E402


def start_server(metrics_port: int | None) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    argv = [sys.executable, "-m", "elasticrun", "store", "serve", "--host", "127.0.0.1", "--port", str(port)]
    if metrics_port is not None:
        argv += ["--metrics-port", f"127.0.0.1:{metrics_port}"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "serving on" in line:
            return proc, f"127.0.0.1:{port}"
    raise RuntimeError("the store server did not start")


async def calls_per_second(endpoint: str, n: int) -> float:
    async with GrpcStore(endpoint) as store:
        for i in range(100):  # warm up
            await store.put(f"/w/{i}", b"x")
        start = time.perf_counter()
        for i in range(n // 2):
            await store.put(f"/k/{i % 100}", b"v" * 64)
            await store.get_prefix("/k/1")
        return n / (time.perf_counter() - start)


def scrape_loop(port: int, stop: threading.Event, took: list[float]) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            reply.read()
        took.append(time.perf_counter() - start)
        stop.wait(0.1)


def one(metrics: bool, n: int, took: list[float]) -> float:
    metrics_port = free_port() if metrics else None
    proc, endpoint = start_server(metrics_port)
    stop = threading.Event()
    scraper = None
    if metrics_port is not None:
        scraper = threading.Thread(target=scrape_loop, args=(metrics_port, stop, took), daemon=True)
        scraper.start()
    try:
        return asyncio.run(calls_per_second(endpoint, n))
    finally:
        stop.set()
        if scraper is not None:
            scraper.join()
        proc.terminate()
        proc.wait(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=4000)
    args = p.parse_args()
    off, on, took = [], [], []
    for _ in range(args.rounds):
        off.append(one(False, args.calls, took))
        on.append(one(True, args.calls, took))
    print(f"machine: {machine()}")
    print(f"calls/s, metrics off: {statistics.median(off):.0f}  ({', '.join(f'{x:.0f}' for x in off)})")
    print(f"calls/s, metrics on:  {statistics.median(on):.0f}  ({', '.join(f'{x:.0f}' for x in on)})")
    print(f"on/off: {statistics.median(on) / statistics.median(off):.3f}")
    print(f"scrape: median {statistics.median(took) * 1e3:.2f} ms, max {max(took) * 1e3:.2f} ms ({len(took)} scrapes)")


if __name__ == "__main__":
    main()
