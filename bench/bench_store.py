"""Benchmark of the built-in store against torch's TCPStore, in the same run.

    python bench/bench_store.py                    # everything, a few minutes
    python bench/bench_store.py --skip-scale       # ops/s and watch latency only
    python bench/bench_store.py --profile-server /tmp/store.prof   # cProfile the server

1. set/get/add ops/s from 1 and 8 client processes (blocking clients: our C10dClient,
   TCPStore's client), each server in a process of its own.
2. Watch notification latency, p50/p99: from the start of a write to the moment a
   watcher in another connection sees it (TCPStore: a `wait` in another connection).
3. One server holding 1,000 clients (several processes, many async clients each, one
   connection per client), each with a lease kept alive at 1 Hz and a watch open: the
   server's CPU share, idle and while the watched key changes once a second, and the
   notification latency of those changes; apart from it, the server's own fan-out
   (from the write to the last watcher's reply handed to gRPC, and to its send done;
   and the same per reply), since the 1,000 receiving clients share the same cores.
   Our server and clients collect garbage as elasticrun's processes do
   (`elasticrun/launcher/gc_settings.py`); --default-gc keeps CPython's defaults.

    python bench/bench_store.py --only-scale     # part 3 only, ~1 minute
    python bench/bench_store.py --only-scale --server-cpu 0   # the server alone on CPU 0
    python bench/bench_store.py --only-scale --default-gc     # CPython's GC defaults
    python bench/bench_store.py --only-scale --split-servers 2  # a fan-out split in 2, at best

Children are this same file with a hidden role argument; they talk over stdin/stdout
lines. Nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from common import add_default_gc_flag, apply_default_gc_flag, run_profiled, settle_gc  # noqa: E402

HOST = "127.0.0.1"


# --- children --------------------------------------------------------------------------


def _log_watch_sends(path: str) -> None:
    """Record when the server handed each watch event reply to gRPC and when gRPC had
    sent it (bench only): perf_counter_ns, one clock for every process on the host.
    The first reply of a stream (the confirmation) is left out. Written at exit."""
    import atexit
    import inspect

    from elasticrun.store.server.kv_service import StoreService

    sent: list[tuple[int, int]] = []
    original = StoreService.Watch

    if inspect.isasyncgenfunction(original):  # replies yielded (older servers)

        async def watch(self, request, context):  # type: ignore[no-untyped-def]
            first = True
            async for reply in original(self, request, context):
                handed = time.perf_counter_ns()
                yield reply
                if not first:
                    sent.append((handed, time.perf_counter_ns()))
                first = False

    else:  # replies written with context.write

        class Context:
            def __init__(self, context):  # type: ignore[no-untyped-def]
                self._context, self._first = context, True

            async def write(self, reply):  # type: ignore[no-untyped-def]
                handed = time.perf_counter_ns()
                await self._context.write(reply)
                if not self._first:
                    sent.append((handed, time.perf_counter_ns()))
                self._first = False

            def __getattr__(self, name):  # type: ignore[no-untyped-def]
                return getattr(self._context, name)

        async def watch(self, request, context):  # type: ignore[no-untyped-def]
            await original(self, request, Context(context))

    StoreService.Watch = watch  # type: ignore[method-assign]
    atexit.register(lambda: Path(path).write_text(json.dumps(sent)))


def role_serve_ours(profile: str | None) -> None:
    from elasticrun.store.server.store_server import StoreServer

    settle_gc()
    if os.environ.get("BENCH_SEND_LOG"):
        _log_watch_sends(os.environ["BENCH_SEND_LOG"])

    async def serve() -> None:
        server = StoreServer(HOST, 0)
        await server.start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        print(server.port, flush=True)
        await stop.wait()
        await server.stop(0)

    run_profiled(serve, profile)


def role_serve_tcp() -> None:
    from torch.distributed import TCPStore

    store = TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    print(store.port, flush=True)
    signal.sigwait([signal.SIGTERM])


def _client(kind: str, port: int):  # type: ignore[no-untyped-def]
    if kind == "ours":
        from elasticrun.store.client.c10d import C10dClient

        return C10dClient(f"{HOST}:{port}")
    from torch.distributed import TCPStore

    return TCPStore(HOST, port, is_master=False)


def role_ops(kind: str, port: int, op: str, seconds: float, ident: int) -> None:
    client = _client(kind, port)
    key = f"bench/{ident}"
    client.set(key, b"0")
    if kind == "ours":
        calls = {
            "set": lambda: client.set(key, b"v"),
            "get": lambda: client.get(key, 10),
            "add": lambda: client.add(key, 1),
        }
    else:
        calls = {
            "set": lambda: client.set(key, b"v"),
            "get": lambda: client.get(key),
            "add": lambda: client.add(key, 1),
        }
    call = calls[op]
    print("ready", flush=True)
    sys.stdin.readline()  # go
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        call()
        count += 1
    print(count, flush=True)


def role_hold(port: int, clients: int, start: int) -> None:
    """`clients` async clients, each a lease kept alive at 1 Hz and a watch on `round`."""
    from elasticrun.store.client.grpc_store import GrpcStore

    os.nice(10)  # the server and the probe first: in a cluster each client has its own host
    settle_gc()  # each client stands for an agent
    latencies: list[float] = []

    async def one(i: int, ready: asyncio.Event, counter: list[int]) -> None:
        store = GrpcStore(f"{HOST}:{port}", timeout=60)
        lease = await store.grant_lease(10)
        rev = await store.put(f"nodes/{start + i}", b"x" * 200, lease=lease)

        async def keep() -> None:
            await asyncio.sleep(random.random())
            while True:
                await store.keep_alive(lease)
                await asyncio.sleep(1.0)

        keeper = asyncio.ensure_future(keep())
        watch = store.watch("round", start_revision=rev + 1)
        counter[0] += 1
        if counter[0] == clients:
            ready.set()
        try:
            async for event in watch:
                latencies.append((time.perf_counter_ns() - int(event.value)) / 1e6)
        finally:
            keeper.cancel()

    async def main() -> None:
        ready, counter = asyncio.Event(), [0]
        tasks = [asyncio.ensure_future(one(i, ready, counter)) for i in range(clients)]
        await ready.wait()
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # stop
        for t in tasks:
            t.cancel()
        print(json.dumps(latencies), flush=True)

    asyncio.run(main())


# --- the driver ---------------------------------------------------------------------


def child(*args: str, stdin: bool = True) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, *args],
        stdin=subprocess.PIPE if stdin else None,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


@dataclass
class Server:
    proc: subprocess.Popen[str]
    port: int

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(kind: str, profile: str | None = None, send_log: str = "") -> Server:
    args = ["_serve_ours", profile or ""] if kind == "ours" else ["_serve_tcp"]
    proc = subprocess.Popen(
        [sys.executable, __file__, *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "BENCH_SEND_LOG": send_log},
    )
    assert proc.stdout is not None
    return Server(proc, int(proc.stdout.readline()))


def ops_per_second(kind: str, port: int, op: str, procs: int, seconds: float) -> float:
    workers = [child("_ops", kind, str(port), op, str(seconds), str(i)) for i in range(procs)]
    for w in workers:
        assert w.stdout is not None and w.stdout.readline().strip() == "ready"
    for w in workers:
        assert w.stdin is not None
        w.stdin.write("go\n")
        w.stdin.flush()
    total = 0
    for w in workers:
        assert w.stdout is not None
        total += int(w.stdout.readline())
        w.wait(30)
    return total / seconds


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def watch_latency_ours(port: int, samples: int) -> list[float]:
    from elasticrun.store.client.grpc_store import GrpcStore

    async def run() -> list[float]:
        writer, watcher = GrpcStore(f"{HOST}:{port}"), GrpcStore(f"{HOST}:{port}")
        start = await writer.put("lat", b"")
        watch = watcher.watch("lat", start_revision=start + 1)
        await writer.put("lat", b"warm-up")
        await anext(watch)
        out = []
        for i in range(samples):
            t0 = time.perf_counter()
            await writer.put("lat", str(i).encode())
            await anext(watch)
            out.append((time.perf_counter() - t0) * 1e3)
        await watch.aclose()
        await writer.close()
        await watcher.close()
        return out

    return asyncio.run(run())


def watch_latency_tcp(port: int, samples: int) -> list[float]:
    from torch.distributed import TCPStore

    writer = TCPStore(HOST, port, is_master=False)
    waiter = TCPStore(HOST, port, is_master=False)
    seen = [threading.Event() for _ in range(samples)]
    stamps = [0.0] * samples

    def wait_all() -> None:
        for i in range(samples):
            waiter.wait([f"lat/{i}"])
            stamps[i] = time.perf_counter()
            seen[i].set()

    thread = threading.Thread(target=wait_all)
    thread.start()
    out = []
    for i in range(samples):
        t0 = time.perf_counter()
        writer.set(f"lat/{i}", b"x")
        seen[i].wait(30)
        out.append((stamps[i] - t0) * 1e3)
    thread.join()
    return out


def scale(
    clients: int,
    procs: int,
    seconds: float,
    profile: str | None = None,
    server_cpu: int | None = None,
    split: int = 1,
) -> dict[str, float]:
    """The 1,000-client part. With `split` > 1, that many independent servers, the
    client processes spread over them and every change written to all at once: what a
    store whose fan-out were spread perfectly over `split` processes could do at best."""
    from elasticrun.store.client.grpc_store import GrpcStore

    send_logs = [Path(f"/tmp/bench_store_sends.{os.getpid()}.{k}.json") for k in range(split)]
    servers = [start_server("ours", profile, str(log)) for log in send_logs]
    per = clients // procs
    holders = [
        child("_hold", str(servers[i % split].port), str(per), str(i * per)) for i in range(procs)
    ]
    if server_cpu is not None:  # the server alone on one core, the clients on the others
        os.sched_setaffinity(servers[0].proc.pid, {server_cpu})
        for h in holders:
            os.sched_setaffinity(h.pid, os.sched_getaffinity(0) - {server_cpu})
    for h in holders:
        assert h.stdout is not None and h.stdout.readline().strip() == "ready"

    def servers_cpu() -> float:
        return sum(server.cpu_seconds() for server in servers)

    time.sleep(3)  # let every first keep-alive phase pass
    cpu0, t0 = servers_cpu(), time.perf_counter()
    time.sleep(seconds)
    idle_share = (servers_cpu() - cpu0) / (time.perf_counter() - t0)

    probe: list[float] = []
    changes: list[int] = []  # perf_counter_ns at the start of each write

    async def broadcast() -> None:
        """Change `round` once a second; a probe client times each notification."""
        writers = [GrpcStore(f"{HOST}:{server.port}") for server in servers]
        watcher = GrpcStore(f"{HOST}:{servers[0].port}")
        start = (await writers[0].get_prefix("")).revision + 1
        watch = watcher.watch("round", start_revision=start)
        end = time.perf_counter() + seconds
        while (t0 := time.perf_counter()) < end:
            changes.append(time.perf_counter_ns())
            value = str(changes[-1]).encode()
            await asyncio.gather(*(writer.put("round", value) for writer in writers))
            await anext(watch)
            probe.append((time.perf_counter() - t0) * 1e3)
            await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))
        await watch.aclose()
        for store in (*writers, watcher):
            await store.close()

    cpu0, t0 = servers_cpu(), time.perf_counter()
    asyncio.run(broadcast())
    busy_share = (servers_cpu() - cpu0) / (time.perf_counter() - t0)
    time.sleep(1.0)  # the last broadcast's stragglers
    latencies: list[float] = []
    for h in holders:
        assert h.stdin is not None and h.stdout is not None
        h.stdin.write("stop\n")
        h.stdin.flush()
        latencies += json.loads(h.stdout.readline())
        h.wait(30)
    sends = []
    for server, log in zip(servers, send_logs, strict=True):
        server.stop()
        sends += json.loads(log.read_text())
        log.unlink()
    # Server-side fan-out: from the start of each write to the moment the server had
    # sent the change to its last watcher (every send before the next write).
    sends.sort()
    handed, done = [], []  # per change: when the last reply was handed over / sent
    reply_handed, reply_done = [], []  # per reply, from the start of its change's write
    for i, start in enumerate(changes):
        end = changes[i + 1] if i + 1 < len(changes) else 1 << 62
        mine = [((h - start) / 1e6, (d - start) / 1e6) for h, d in sends if start <= h < end]
        if mine:
            handed.append(max(h for h, _ in mine))
            done.append(max(d for _, d in mine))
            reply_handed += [h for h, _ in mine]
            reply_done += [d for _, d in mine]
    return {
        "handed_p50": percentile(handed, 50),
        "handed_max": max(handed),
        "done_p50": percentile(done, 50),
        "done_max": max(done),
        "reply_handed_p50": percentile(reply_handed, 50),
        "reply_handed_p99": percentile(reply_handed, 99),
        "reply_done_p50": percentile(reply_done, 50),
        "reply_done_p99": percentile(reply_done, 99),
        "sends": len(sends),
        "clients": per * procs,
        "idle_cpu": idle_share,
        "busy_cpu": busy_share,
        "notifications": len(latencies),
        "p50": percentile(latencies, 50),
        "p99": percentile(latencies, 99),
        "probe_p50": percentile(probe, 50),
        "probe_max": max(probe),
        "probes": len(probe),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per ops/s measurement")
    parser.add_argument("--samples", type=int, default=500, help="watch latency samples")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--client-procs", type=int, default=4)
    parser.add_argument("--scale-seconds", type=float, default=15.0)
    parser.add_argument("--skip-scale", action="store_true")
    parser.add_argument("--only-scale", action="store_true", help="skip ops/s and latency")
    parser.add_argument("--profile-scale", help="cProfile the server in the 1,000-client part")
    parser.add_argument(
        "--server-cpu", type=int, help="1,000-client part: pin the server to this CPU, the clients to the others"
    )
    parser.add_argument(
        "--split-servers",
        type=int,
        default=1,
        metavar="K",
        help="1,000-client part: K independent servers, the clients spread over them, "
        "each change written to all (the best a fan-out spread over K processes could do)",
    )
    parser.add_argument("--profile-server", help="cProfile our server during ops/s into PATH")
    add_default_gc_flag(parser)
    args = parser.parse_args()
    if args.split_servers < 1 or (args.split_servers > 1 and args.server_cpu is not None):
        parser.error("--split-servers must be at least 1, and does not go with --server-cpu")
    apply_default_gc_flag(args)

    print(f"# store bench, {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    if not args.only_scale:
        pairwise(args)
    if not args.skip_scale:
        report_scale(args)


def pairwise(args: argparse.Namespace) -> None:
    servers = {"ours": start_server("ours", args.profile_server), "tcp": start_server("tcp")}
    try:
        print("\n| op | clients | ours ops/s | TCPStore ops/s | ratio |\n|---|---|---|---|---|")
        for procs in (1, 8):
            for op in ("set", "get", "add"):
                rates = {
                    kind: ops_per_second(kind, s.port, op, procs, args.seconds)
                    for kind, s in servers.items()
                }
                print(
                    f"| {op} | {procs} | {rates['ours']:,.0f} | {rates['tcp']:,.0f} "
                    f"| {rates['ours'] / rates['tcp']:.2f} |",
                    flush=True,
                )
        ours = watch_latency_ours(servers["ours"].port, args.samples)
        tcp = watch_latency_tcp(servers["tcp"].port, args.samples)
        print("\n| notification latency | p50 ms | p99 ms |\n|---|---|---|")
        print(f"| ours (watch) | {percentile(ours, 50):.2f} | {percentile(ours, 99):.2f} |")
        print(f"| TCPStore (wait) | {percentile(tcp, 50):.2f} | {percentile(tcp, 99):.2f} |")
    finally:
        for s in servers.values():
            s.stop()


def report_scale(args: argparse.Namespace) -> None:
    r = scale(
        args.clients,
        args.client_procs,
        args.scale_seconds,
        args.profile_scale,
        args.server_cpu,
        args.split_servers,
    )
    servers = f" over {args.split_servers} independent servers" if args.split_servers > 1 else ""
    print(
        f"\n{r['clients']:.0f} clients{servers}, lease keep-alive at 1 Hz + one watch each:\n"
        f"- server CPU, keep-alives only: {r['idle_cpu']:.1%} of one core\n"
        f"- server CPU, plus a watched change every second: {r['busy_cpu']:.1%} of one core\n"
        f"- notification latency, all clients ({r['notifications']:.0f} notifications, "
        f"clients niced and sharing the cores): p50 {r['p50']:.1f} ms, "
        f"p99 {r['p99']:.1f} ms\n"
        f"- server fan-out, from the start of the write to the last watcher's reply "
        f"handed to gRPC: p50 {r['handed_p50']:.1f} ms, max {r['handed_max']:.1f} ms; "
        f"to gRPC's send of it done: p50 {r['done_p50']:.1f} ms, "
        f"max {r['done_max']:.1f} ms ({r['sends']:.0f} replies)\n"
        f"- server side, per reply, from the start of the write: handed to gRPC "
        f"p50 {r['reply_handed_p50']:.1f} ms, p99 {r['reply_handed_p99']:.1f} ms; "
        f"gRPC's send done p50 {r['reply_done_p50']:.1f} ms, p99 {r['reply_done_p99']:.1f} ms\n"
        f"- notification latency, one probe client ({r['probes']:.0f} changes): "
        f"p50 {r['probe_p50']:.1f} ms, max {r['probe_max']:.1f} ms"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        role, rest = sys.argv[1], sys.argv[2:]
        if role == "_serve_ours":
            role_serve_ours(rest[0] or None)
        elif role == "_serve_tcp":
            role_serve_tcp()
        elif role == "_ops":
            role_ops(rest[0], int(rest[1]), rest[2], float(rest[3]), int(rest[4]))
        elif role == "_hold":
            role_hold(int(rest[0]), int(rest[1]), int(rest[2]))
    else:
        main()
