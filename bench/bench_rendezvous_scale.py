"""A rendezvous-only simulation of up to 10,000 nodes against one store.

    python bench/bench_rendezvous_scale.py                        # 100, 300, 1,000 nodes; our store, ~1 minute
    python bench/bench_rendezvous_scale.py --backends etcd --shared-client   # etcd, one client per process
    python bench/bench_rendezvous_scale.py --sizes 1000 --backends grpc --profile-server /tmp/srv.prof
    python bench/bench_rendezvous_scale.py --sizes 2000 5000 10000 --backends grpc etcd --shared-client --cap 240

No workers and no agents: each client process runs many `ElasticRendezvous` instances
(one per simulated node, each with its own store client and lease) on one event loop.
Stores: the built-in engine (`MemoryStore`) behind a real `StoreServer` over gRPC, in a
process of its own; or a real etcd (one member on loopback, memory-backed data dir,
as tests/support/etcd_cluster.py starts it).

Settings: --nnodes=(N-1):N, last_call 0.5 s (short, for the bench; only waited on if the
N-th registration came more than 0.5 s after the (N-1)-th), heartbeat as the launcher
sets it by default (5 s up to 2,000 nodes, N/400 s beyond; keep-alives every third of
it; --heartbeat overrides). Per size and backend, two rounds:
  round 1 (formation): every node calls next_round() at once; time from the moment the
      last node finished registering (lease, spec check, its node key, its watch) to
      the moment the last node holds its Assignment.
  round 2 (one node leaves): one node calls leave() (revokes its lease); time from that
      call to the moment every remaining node holds its round-2 Assignment.
Store operations per round are counted on the server side: for our server by a counting
wrapper around its engine (bench-only subclass: one count per engine call a request
makes, plus every watch event sent); for etcd from its /metrics (gRPC requests and
stream messages received per method, and watch events sent). Keep-alives are listed
apart: they flow all the time, not because of the round. Bytes per round are what the
store sends the nodes: for our server the keys and values of every watch event and read
result; for etcd `etcd_network_client_grpc_sent_bytes_total`. After round 2 the nodes
stay idle for --idle seconds, and the store's CPU over that window (keep-alives and
nothing else) is reported with the keep-alives per second: for our server the process's
own CPU time, for etcd `process_cpu_seconds_total`.

The protocol apart from the simulation: on a small machine thousands of simulated nodes
share its cores with the store, so the nodes' clocks measure their own queueing as much
as the rendezvous. The leader (node 0) runs alone in a process of its own, at the
store's priority, and registers before the others go: a real leader's agent has a host
of its own, and a leader sharing a loop with hundreds of simulated nodes decided as late
as that loop ran (--procs counts the other processes). Three figures separate them:
  decided at the store: an observer process (one client, one watch on the job's
      records, not niced) times the last registration (round 1) or the leaver's
      deletion (round 2) and the round's head as the store delivers them;
  spread to the nodes: from the head the observer saw to the last node holding its
      place (each node's reads, on its busy loop);
  CPU per node: the store's CPU and the client processes' CPU (every thread) per node
      in each round's window (round 1 includes registration); the leader's process's
      CPU apart.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from common import (  # noqa: E402
    add_default_gc_flag,
    apply_default_gc_flag,
    become_subreaper,
    fmt,
    loadavg,
    machine,
    run_profiled,
    settle_gc,
    write_json,
)

HOST = "127.0.0.1"
#: engine calls counted as they are (get, get_prefix and watches count their bytes too)
_COUNTED = frozenset({"put", "put_all", "compare_and_put", "delete", "compare_and_delete", "delete_prefix",
                      "grant_lease", "keep_alive", "revoke_lease"})
LAST_CALL = 0.5
CAP_S = 60.0  # --cap
#: Our server lets a connection hold MAX_STREAMS_PER_CONNECTION calls at once and a
#: client queues the rest: a simulated node holds a watch or two and a few calls in
#: flight, so more nodes than this on one client would wait on each other's streams,
#: as no real node (which has a connection of its own) does. etcd sets no such limit.
GRPC_NODES_PER_CONNECTION = 16


# --- children ---------------------------------------------------------------------------


def role_serve(profile: str) -> None:
    """A StoreServer over a MemoryStore that counts what the requests do, collecting
    garbage as `elasticrun store serve` does (unless --default-gc)."""
    from elasticrun.store.server.memory import MemoryStore
    from elasticrun.store.server.store_server import StoreServer

    counts: collections.Counter[str] = collections.Counter()

    class Counting(MemoryStore):
        async def get(self, key):  # type: ignore[no-untyped-def]
            counts["get"] += 1
            kv = await super().get(key)
            counts["bytes_sent"] += len(kv.key) + len(kv.value) if kv else 0
            return kv

        async def get_prefix(self, prefix):  # type: ignore[no-untyped-def]
            counts["get_prefix"] += 1
            result = await super().get_prefix(prefix)
            counts["bytes_sent"] += sum(len(kv.key) + len(kv.value) for kv in result.kvs)
            return result

        def __getattribute__(self, name):  # type: ignore[no-untyped-def]
            # one count per engine call a request makes (put, compare_and_put, delete,
            # delete_prefix, grant_lease, keep_alive, revoke_lease, ...)
            if name in _COUNTED:
                counts[name] += 1
            return super().__getattribute__(name)

        async def watch_batches(self, key, start_revision, prefix):  # type: ignore[no-untyped-def]
            counts["watch"] += 1
            async for batch in super().watch_batches(key, start_revision, prefix):
                counts["watch_events_sent"] += len(batch)
                counts["bytes_sent"] += sum(len(e.key) + len(e.value or b"") for e in batch)
                for e in batch:  # which records fan out: job/round, job/state, nodes/*, ...
                    part = e.key.split("/")
                    kind = "nodes/*" if "nodes" in part else "ranks/*" if "ranks" in part else part[-1]
                    counts["events:" + kind] += 1
                yield batch

    async def serve() -> None:
        server = StoreServer(HOST, 0, engine=Counting())
        await server.start()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        print(server.port, flush=True)

        async def commands() -> None:
            while True:
                line = await asyncio.to_thread(sys.stdin.readline)
                if not line:
                    stop.set()
                    return
                t = os.times()
                print(json.dumps({**counts, "cpu_s": t.user + t.system}), flush=True)
                counts.clear()

        task = asyncio.ensure_future(commands())
        await stop.wait()
        task.cancel()
        await server.stop(0)

    settle_gc()
    run_profiled(serve, profile)


def node_address(n: int) -> str:
    """Simulated node `n`'s own loopback address, as each real node has its own host.

    Its liveness port is bound there: with every node on 127.0.0.1, 10,000 listening
    sockets share one address, and the kernel's search for a free port took 4.5 ms a
    bind (11.4 s of a 2,500-node process's loop, cProfile), the simulation's cost that a
    real host, binding one port, never pays."""
    return f"127.{1 + n // 62_500}.{n // 250 % 250}.{n % 250 + 1}"


def role_nodes(backend: str, endpoint: str, run_id: str, first: int, count: int, total: int, leaver: int, profile: str,
               per_client: int = 1, cap: float = CAP_S, heartbeat: float = 0.0, lead: bool = False) -> None:
    """`count` ElasticRendezvous instances (node ids first..first+count-1) on one loop,
    collecting garbage as an agent does (unless --default-gc).

    `lead`: this process is the leader's alone (one node, registered before the rest,
    at the store's priority), as a real leader's agent has a host of its own; it says
    "leading" once its node holds the job's leader key."""
    import logging

    from elasticrun.rendezvous.elastic import ElasticRendezvous
    from elasticrun.rendezvous.records import JobSpec, NodeInfo
    from elasticrun.rendezvous.settings import RendezvousSettings

    if not lead:
        os.nice(5)  # the store and the leader first: in a cluster each node has its own host
    lost = collections.Counter()

    class CountLosses(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if "lost its membership" in msg:
                lost["lost_membership"] += 1
                msg = msg.split("membership: ", 1)[-1]
            lost[re.sub(r"\b[0-9a-f]*\d[0-9a-f]*\b", "N", msg)[:90]] += 1  # every warning, by its kind

    rdzv_log = logging.getLogger("elasticrun.rendezvous")
    rdzv_log.addHandler(CountLosses())
    rdzv_log.setLevel(logging.WARNING)
    rdzv_log.propagate = False  # 1,000 nodes' warnings would flood the terminal
    ttl = heartbeat or RendezvousSettings.default_heartbeat_ttl(total)
    settings = RendezvousSettings(
        run_id, max(total - 1, 1), total, last_call=LAST_CALL, heartbeat_ttl=ttl, join_timeout=cap
    )
    registered: dict[int, float] = {}

    class Timed(ElasticRendezvous):
        async def _register(self) -> None:  # bench-only: note when registration is done
            await super()._register()
            registered[int(self._me.node_id[4:])] = time.time()

    renewals: list[float] = []  # how long each keep-alive call took (a cancelled one: -1)

    def make_store():  # type: ignore[no-untyped-def]
        if backend == "grpc":
            from elasticrun.store.client.grpc_store import GrpcStore

            store = GrpcStore(endpoint, timeout=cap)
        else:
            from elasticrun.store.etcd.backend import EtcdStore

            store = EtcdStore([endpoint], timeout=cap)
        renew = store.keep_alive

        async def timed_keep_alive(lease: int) -> None:
            t = time.monotonic()
            try:
                await renew(lease)
            except asyncio.CancelledError:
                renewals.append(-1.0)
                raise
            renewals.append(time.monotonic() - t)

        store.keep_alive = timed_keep_alive
        return store

    async def main() -> None:
        nodes, stores = {}, []
        for n in range(first, first + count):
            if (n - first) % per_client == 0:
                stores.append(make_store())
            store = stores[-1]
            me = NodeInfo(node_id=f"node{n:05d}", host=socket.gethostname(), addr=node_address(n), nproc=1,
                          pid=os.getpid(), started_at=time.time())
            nodes[n] = Timed(store, settings, me, spec=JobSpec(command=("bench",)))
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # go
        cpu_go = time.process_time()
        lag = [0.0]  # how late this process's loop runs a timer, at most: a busy client

        async def gauge_lag() -> None:
            while True:
                t = time.monotonic()
                await asyncio.sleep(0.1)
                lag[0] = max(lag[0], time.monotonic() - t - 0.1)

        lag_task = asyncio.ensure_future(gauge_lag())

        def phase() -> dict[str, object]:
            cpu, worst = time.process_time(), lag[0]
            lag[0] = 0.0
            why = {k: v for k, v in lost.items() if k != "lost_membership"}
            done = sorted(t for t in renewals if t >= 0)
            took = {"n": len(done), "cancelled": len(renewals) - len(done),
                    "p50": done[len(done) // 2] if done else None, "p99": done[len(done) * 99 // 100] if done else None,
                    "max": done[-1] if done else None}
            renewals.clear()
            return {"cpu_s": cpu, "lag_s": worst, "why": why, "keep_alive": took}
        round1: dict[int, float] = {}
        round2: dict[int, float] = {}
        opened: dict[str, float] = {}  # when the leader wrote each round (its head's opened_at)
        errors: list[str] = []

        async def life(n: int) -> None:
            try:
                a1 = await nodes[n].next_round()
                round1[n] = time.time()
                opened["1"] = nodes[n]._ran.opened_at  # type: ignore[union-attr]
                if n == leaver:
                    return
                await nodes[n].round_ended()
                a2 = await nodes[n].next_round()
                round2[n] = time.time()
                opened["2"] = nodes[n]._ran.opened_at  # type: ignore[union-attr]
                assert a2.round > a1.round
            except Exception as e:  # noqa: BLE001
                errors.append(f"node{n}: {type(e).__name__}: {e}")

        tasks = [asyncio.ensure_future(life(n)) for n in nodes]
        if lead:  # the others go once this node leads
            while not registered and not errors:
                await asyncio.sleep(0.005)
            print("leading" if nodes[first]._leader is not None else f"not leading: {errors}", flush=True)
        deadline = time.monotonic() + cap
        while len(round1) + len(errors) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        print(json.dumps({"registered": registered, "round1": round1, "errors": errors, "lost": lost["lost_membership"],
                          "opened": opened.get("1"), "cpu_go": cpu_go, **phase()}), flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # leave (acted on by the leaver's process)
        t_leave = None
        if leaver in nodes:
            t_leave = time.time()
            await nodes[leaver].leave("bench: scale in")
        expected = count - (leaver in nodes)
        deadline = time.monotonic() + cap
        while len(round2) + len(errors) < expected and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        print(json.dumps({"round2": round2, "t_leave": t_leave, "errors": errors, "lost": lost["lost_membership"],
                          "opened": opened.get("2"), **phase()}), flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # idle window over
        print(json.dumps({"lost": lost["lost_membership"], **phase()}), flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # quit
        for t in [*tasks, lag_task]:
            t.cancel()
        await asyncio.gather(*tasks, lag_task, return_exceptions=True)
        await asyncio.gather(*(r.aclose() for r in nodes.values()), return_exceptions=True)
        await asyncio.gather(*(s.close() for s in stores), return_exceptions=True)

    settle_gc()  # the simulated nodes stand for agents
    run_profiled(main, profile)


def role_observe(backend: str, endpoint: str, run_id: str) -> None:
    """One watch on the job's rendezvous records, timing them as the store delivers them.

    The nodes' own clocks say when each of them got its place, and that is the
    simulation's cost as much as the protocol's: thousands of nodes share two cores.
    This process is one client with one watch, at normal priority (the nodes run at nice
    5): the moment it sees the last registration and the moment it sees the round's
    head tell how long the store and the leader took to decide the round, whatever the
    simulated nodes' loops are doing. Prints the times on each line of stdin."""
    from elasticrun.rendezvous.codec import decode
    from elasticrun.rendezvous.keys import Keys
    from elasticrun.rendezvous.rounds import RoundHead
    from elasticrun.store.interface import EventType

    keys = Keys(run_id)
    nodes = keys.rdzv + "nodes/"

    async def main() -> None:
        if backend == "grpc":
            from elasticrun.store.client.grpc_store import GrpcStore

            store = GrpcStore(endpoint, timeout=CAP_S)
        else:
            from elasticrun.store.etcd.backend import EtcdStore

            store = EtcdStore([endpoint], timeout=CAP_S)
        seen: dict[str, object] = {"registered": [], "left": [], "heads": {}}

        async def watch() -> None:
            start = (await store.get_prefix(keys.rdzv + "job/spec")).revision + 1
            async for event in store.watch(keys.rdzv, start_revision=start, prefix=True):
                now = time.time()
                if event.key.startswith(nodes):
                    kind = "registered" if event.type is EventType.PUT else "left"
                    seen[kind].append(now)  # type: ignore[attr-defined]
                elif event.key == keys.round and event.type is EventType.PUT:
                    head = decode(RoundHead, event.value)
                    seen["heads"].setdefault(str(head.number), now)  # type: ignore[attr-defined]

        task = asyncio.ensure_future(watch())
        print("ready", flush=True)
        while await asyncio.to_thread(sys.stdin.readline):
            print(json.dumps(seen), flush=True)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await store.close()

    asyncio.run(main())


# --- the driver ---------------------------------------------------------------------------


def last_opened(reports: list[dict]) -> float | None:  # type: ignore[type-arg]
    """When the leader wrote the round these reports' nodes got (the latest, if several)."""
    times = [r["opened"] for r in reports if r.get("opened")]
    return max(times) if times else None


def store_side_times(seen: dict, got1: list[float], got2: list[float]) -> dict[str, float | None]:  # type: ignore[type-arg]
    """Each round, as the observer saw the store deliver it, and the nodes' part after.

    decided: from the last registration (round 1) or the leaver's deletion (round 2) to
    the round's head, both seen by the observer's one watch; spread: from the head
    seen by the observer to the last simulated node holding its place (the nodes'
    reads and their loops: where the simulation, not the store, takes the time)."""
    heads = {int(k): v for k, v in seen["heads"].items()}
    out: dict[str, float | None] = {}
    for n, start_times, got in ((1, seen["registered"], got1), (2, seen["left"], got2)):
        head = heads.get(n)
        before = [t for t in start_times if head is None or t <= head]
        if n == 2:
            before = [t for t in before if t > heads.get(1, 0.0)]
        start = (max(before) if n == 1 else min(before)) if before else None
        out[f"round{n}_store_decided_s"] = head - start if head and start else None
        out[f"round{n}_spread_s"] = max(got) - head if head and got else None
    return out


def child(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
    )


def send(proc: subprocess.Popen[str], line: str = "x") -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def recv(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"child {proc.pid} ended without answering (exit {proc.poll()})")
    return line


_METRIC = re.compile(r'^(grpc_server_handled_total|grpc_server_msg_received_total)\{.*grpc_method="(\w+)".*\} (\S+)$')
_CODE = re.compile(r'grpc_code="(\w+)"')


class EtcdCounter:
    """Server-side counts from etcd's /metrics: requests handled and stream messages.

    Requests etcd answered with an error are also counted apart by method and code
    ("refused:Put:Unknown"): etcd refuses writes with "too many requests" when it falls
    5,000 entries behind in applying them, and the nodes' retries are store calls too."""

    def __init__(self, cluster: object) -> None:
        self.cluster = cluster
        self.last = self._read()

    def _read(self) -> collections.Counter[str]:
        counts: collections.Counter[str] = collections.Counter()
        for line in self.cluster._http(0, "/metrics").splitlines():  # type: ignore[attr-defined]
            m = _METRIC.match(line)
            if m:
                kind = "rpc" if m.group(1) == "grpc_server_handled_total" else "msg"
                counts[f"{kind}:{m.group(2)}"] += int(float(m.group(3)))
                code = _CODE.search(line)
                if kind == "rpc" and code is not None and code.group(1) != "OK":
                    counts[f"refused:{m.group(2)}:{code.group(1)}"] += int(float(m.group(3)))
            elif line.startswith("etcd_debugging_mvcc_events_total "):
                counts["watch_events_sent"] += int(float(line.split()[1]))
            elif line.startswith("etcd_network_client_grpc_sent_bytes_total "):
                counts["bytes_sent"] += int(float(line.split()[1]))
            elif line.startswith("process_cpu_seconds_total "):
                counts["cpu_ms"] += int(float(line.split()[1]) * 1000)
        return counts

    def delta(self) -> dict[str, float]:
        now = self._read()
        d: dict[str, float] = {k: now[k] - self.last.get(k, 0) for k in now if now[k] - self.last.get(k, 0)}
        self.last = now
        d["cpu_s"] = now["cpu_ms"] / 1000  # a total, as our server reports it
        return d


def summarise_ops(counts: dict[str, float], backend: str) -> tuple[int, int, dict[str, float]]:
    """(round ops without keep-alives, keep-alives, detail) from server-side counts."""
    if backend == "grpc":
        keep = int(counts.get("keep_alive", 0))
        apart = ("keep_alive", "watch_events_sent", "bytes_sent", "cpu_s")
        ops = sum(int(v) for k, v in counts.items() if k not in apart and not k.startswith("events:"))
        return ops, keep, counts
    # etcd: unary requests plus messages on streams (Watch creates, keep-alives)
    keep = int(counts.get("msg:LeaseKeepAlive", 0))
    unary = sum(
        int(v) for k, v in counts.items() if k.startswith("rpc:") and k not in ("rpc:LeaseKeepAlive", "rpc:Watch")
    )
    watches = int(counts.get("msg:Watch", 0))
    return unary + watches, keep, counts


def main() -> int:
    from elasticrun.rendezvous.settings import RendezvousSettings

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="*", default=[100, 300, 1000])
    # etcd with one client per node runs a thread per watch: 1,000 of them overload a 2-core box
    ap.add_argument("--backends", nargs="*", default=["grpc"], choices=["grpc", "etcd"])
    ap.add_argument("--procs", type=int, default=4, help="client processes (the leader runs in one more)")
    ap.add_argument("--profile-server", default="", help="cProfile our server process here (.prof)")
    ap.add_argument("--profile-nodes", default="", help="cProfile the first client process here (.prof)")
    ap.add_argument("--profile-leader", default="", help="cProfile the leader's process here (.prof)")
    ap.add_argument("--shared-client", action="store_true",
                    help="one store client per process (not per node); on our store at most "
                    f"{GRPC_NODES_PER_CONNECTION} nodes per client (its streams per connection)")
    ap.add_argument("--nodes-per-client", type=int, default=0,
                    help="nodes that share one store client (connection); default 1, or the whole process "
                    "with --shared-client")
    ap.add_argument("--cap", type=float, default=CAP_S, help="seconds each phase may take")
    ap.add_argument("--heartbeat", type=float, default=0.0,
                    help="the lease TTL (heartbeat_timeout); default: the launcher's for the size "
                    "(5 s to 2,000 nodes, then N/400)")
    ap.add_argument("--idle", type=float, default=10.0, help="seconds of keep-alives only, after round 2")
    ap.add_argument("--json")
    add_default_gc_flag(ap)
    args = ap.parse_args()

    def per_client(backend: str, count: int) -> int:
        wanted = args.nodes_per_client or (count if args.shared_client else 1)
        return min(wanted, GRPC_NODES_PER_CONNECTION) if backend == "grpc" else wanted

    def clients_label(backend: str, count: int) -> str:
        shared = per_client(backend, count)
        if shared == count and args.shared_client and not args.nodes_per_client:
            return "one per process"
        return f"one per {shared} nodes" if shared > 1 else "one per node"
    apply_default_gc_flag(args)
    become_subreaper()
    info = machine()
    print(f"machine: {info}", flush=True)
    results = []
    all_procs: list[subprocess.Popen[str]] = []
    cluster = None
    try:
        for backend in args.backends:
            server = None
            if backend == "grpc":
                server = child("_serve", args.profile_server)
                all_procs.append(server)
                endpoint = f"{HOST}:{int(recv(server))}"
                counter = None
            else:
                from tests.support.etcd_cluster import EtcdCluster

                cluster = EtcdCluster(1)
                cluster.start()
                endpoint = cluster.endpoints[0]
                counter = EtcdCounter(cluster)
            for size in args.sizes:
                run_id = f"scale{size}-{time.time_ns() % 10**9}"
                # node 0 leads, in a process of its own; the other nodes share --procs processes
                rest = size - 1
                per = [rest // args.procs + (1 if i < rest % args.procs else 0) for i in range(args.procs)]
                firsts = [1 + sum(per[:i]) for i in range(args.procs)]
                leaver = size - 1
                largest = size == max(args.sizes)
                leader = child("_nodes", backend, endpoint, run_id, "0", "1", str(size), str(leaver),
                               args.profile_leader if largest else "", "1", str(args.cap), str(args.heartbeat), "lead")
                nodes = [leader]
                for i in range(args.procs):
                    prof = args.profile_nodes if (i == 0 and largest) else ""
                    nodes.append(child("_nodes", backend, endpoint, run_id, str(firsts[i]), str(per[i]), str(size),
                                       str(leaver), prof, str(per_client(backend, per[i])), str(args.cap),
                                       str(args.heartbeat), "-"))
                observer = child("_observe", backend, endpoint, run_id)
                all_procs.extend([*nodes, observer])
                for p in [*nodes, observer]:
                    assert recv(p).strip() == "ready"
                if server:
                    send(server)
                    cpu0 = json.loads(recv(server))["cpu_s"]  # and the counts start again
                else:
                    cpu0 = 0.0  # etcd's counter gives the CPU of each window
                    counter.delta()  # type: ignore[union-attr]
                send(leader)
                leading = recv(leader).strip()
                if leading != "leading":
                    raise RuntimeError(f"node 0 was to lead the job: {leading}")
                t_go = time.time()
                for p in nodes[1:]:
                    send(p)
                r1 = [json.loads(recv(p)) for p in nodes]
                ops1 = json.loads((send(server), recv(server))[1]) if server else counter.delta()  # type: ignore[union-attr]
                for p in nodes:
                    send(p)
                r2 = [json.loads(recv(p)) for p in nodes]
                ops2 = json.loads((send(server), recv(server))[1]) if server else counter.delta()  # type: ignore[union-attr]
                send(observer)
                seen = json.loads(recv(observer))
                observer.stdin.close()  # type: ignore[union-attr]
                observer.wait(30)
                time.sleep(args.idle)  # keep-alives only
                idle = json.loads((send(server), recv(server))[1]) if server else counter.delta()  # type: ignore[union-attr]
                for p in nodes:
                    send(p)
                r3 = [json.loads(recv(p)) for p in nodes]
                for p in nodes:
                    send(p)
                for p in nodes:
                    p.wait(120)
                registered = [t for r in r1 for t in r["registered"].values()]
                got1 = [t for r in r1 for t in r["round1"].values()]
                got2 = [t for r in r2 for t in r["round2"].values()]
                t_leave = next(r["t_leave"] for r in r2 if r["t_leave"])
                errors = [e for r in r1 + r2 for e in r["errors"]]
                cpu = [sum(r["cpu_s"] for r in rs[1:]) for rs in (r1, r2, r3)]  # the simulated nodes'
                lead_cpu = [r1[0]["cpu_s"] - r1[0]["cpu_go"], r2[0]["cpu_s"] - r1[0]["cpu_s"]]
                if server:
                    store_cpu = [ops1["cpu_s"] - cpu0, ops2["cpu_s"] - ops1["cpu_s"]]
                else:
                    store_cpu = [ops1.get("cpu_ms", 0) / 1000, ops2.get("cpu_ms", 0) / 1000]
                store_side = store_side_times(seen, got1, got2)
                res = {
                    "backend": backend,
                    "nodes": size,
                    "registered": len(registered),
                    "round1_assigned": len(got1),
                    "round2_assigned": len(got2),
                    "all_registered_after_go_s": max(registered) - t_go if registered else None,
                    "round1_s": (max(got1) - max(registered)) if len(got1) == size else None,
                    "round1_from_go_s": (max(got1) - t_go) if len(got1) == size else None,
                    "round2_s": (max(got2) - t_leave) if len(got2) == size - 1 else None,
                    # how each round's time splits: until the leader wrote it, then until
                    # the last node held its place (the nodes' side: head, shard, master)
                    "round1_decided_s": opened1 - max(registered) if (opened1 := last_opened(r1)) else None,
                    "round1_fanout_s": max(got1) - opened1 if opened1 and len(got1) == size else None,
                    "round2_decided_s": opened2 - t_leave if (opened2 := last_opened(r2)) else None,
                    "round2_fanout_s": max(got2) - opened2 if opened2 and len(got2) == size - 1 else None,
                    "ops_round1": summarise_ops(ops1, backend),
                    "ops_round2": summarise_ops(ops2, backend),
                    "errors": errors[:5],
                    "lost_membership_r1": sum(r["lost"] for r in r1),
                    "lost_membership_r1_r2": sum(r["lost"] for r in r2),
                    "lost_membership_idle": sum(r["lost"] for r in r3),
                    "clients_cpu_s": cpu,
                    # the simulation's cost: client CPU (every thread) per simulated node
                    # for registration and round 1, then for round 2
                    "client_cpu_ms_per_node": [cpu[0] * 1000 / (size - 1), (cpu[1] - cpu[0]) * 1000 / (size - 2)],
                    # the protocol's: the store's CPU per node in the same windows
                    "store_cpu_ms_per_node": [store_cpu[0] * 1000 / size, store_cpu[1] * 1000 / (size - 1)],
                    # the leader's process (its node and its leading) in each round's window
                    "leader_cpu_s": lead_cpu,
                    "leader_loop_lag_s": [r1[0]["lag_s"], r2[0]["lag_s"]],
                    **store_side,
                    "clients_loop_lag_s": [max(r["lag_s"] for r in rs) for rs in (r1, r2, r3)],
                    "keep_alive_calls": [[r["keep_alive"] for r in rs] for rs in (r1, r2, r3)],
                    "lost_why": [dict(sum((collections.Counter(r["why"]) for r in rs), collections.Counter()))
                                 for rs in (r1, r2, r3)],
                    "bytes_per_node_round1": ops1.get("bytes_sent", 0) / size,
                    "bytes_per_node_round2": ops2.get("bytes_sent", 0) / (size - 1),
                    "keep_alives_per_s": summarise_ops(idle, backend)[1] / args.idle,
                    "server_cpu_idle": (idle["cpu_s"] - ops2["cpu_s"]) / args.idle,
                    "clients": clients_label(backend, per[0]),
                    "heartbeat_s": args.heartbeat or RendezvousSettings.default_heartbeat_ttl(size),
                    "load": loadavg(),
                }
                results.append(res)
                print(json.dumps(res), flush=True)
            if server:
                assert server.stdin is not None
                server.stdin.close()  # end of commands: the server stops
                server.wait(60)
            if cluster:
                cluster.close()
                cluster = None
    finally:
        for p in all_procs:
            if p.poll() is None:
                p.kill()  # by PID: only processes this driver started
                p.wait(10)
        if cluster:
            cluster.close()

    print("\n| backend | clients | nodes | all registered after go s | round 1 s (last registered → last assigned) "
          "| round 2 s (leave → last assigned) "
          "| decided at the store r1, r2 s | spread to the nodes r1, r2 s | store CPU ms/node r1, r2 "
          "| client CPU ms/node r1, r2 | leader CPU r1, r2 s "
          "| store calls/node r1, r2 | bytes/node r1, r2 | watch events sent r1 | keep-alives/s "
          "| store CPU, keep-alives only | leases lost (r1+r2, idle) | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        o1, _, d1 = r["ops_round1"]  # type: ignore[misc]
        o2, _, _ = r["ops_round2"]  # type: ignore[misc]
        n = r["nodes"]
        print(f"| {r['backend']} | {r['clients']} | {n} | {fmt(r['all_registered_after_go_s'])} | "
              f"{fmt(r['round1_s'])} | {fmt(r['round2_s'])} | "
              f"{fmt(r['round1_store_decided_s'])}, {fmt(r['round2_store_decided_s'])} | "
              f"{fmt(r['round1_spread_s'])}, {fmt(r['round2_spread_s'])} | "
              f"{r['store_cpu_ms_per_node'][0]:.2f}, {r['store_cpu_ms_per_node'][1]:.2f} | "
              f"{r['client_cpu_ms_per_node'][0]:.2f}, {r['client_cpu_ms_per_node'][1]:.2f} | "
              f"{r['leader_cpu_s'][0]:.2f}, {r['leader_cpu_s'][1]:.2f} | "
              f"{o1 / n:.2f}, {o2 / (n - 1):.2f} | "
              f"{r['bytes_per_node_round1']:,.0f}, {r['bytes_per_node_round2']:,.0f} | "
              f"{int(d1.get('watch_events_sent', 0))} | {r['keep_alives_per_s']:.0f} | "
              f"{r['server_cpu_idle']:.0%} of a core | "
              f"{r['lost_membership_r1_r2']}, {r['lost_membership_idle']} | {r['load']} |")
    write_json(args.json, {"machine": info, "results": results})
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_serve":
        role_serve(sys.argv[2] if len(sys.argv) > 2 else "")
    elif len(sys.argv) > 1 and sys.argv[1] == "_observe":
        role_observe(*sys.argv[2:5])
    elif len(sys.argv) > 1 and sys.argv[1] == "_nodes":
        b, ep, rid, first, count, total, leaver = sys.argv[2:9]
        role_nodes(b, ep, rid, int(first), int(count), int(total), int(leaver), sys.argv[9], int(sys.argv[10]),
                   float(sys.argv[11]), float(sys.argv[12]), sys.argv[13] == "lead")
    else:
        sys.exit(main())
