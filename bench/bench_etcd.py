"""The etcd backend: elasticrun against c10d and against torchrun's etcd backends.

    python bench/bench_etcd.py                      # a, b, c; 2 repetitions
    python bench/bench_etcd.py --only agents torch  # without the 1,000-node simulation

Needs /usr/bin/etcd (3.4; started here with --enable-v2, through ETCD_ENABLE_V2=true, so
torch's backends can use its v2 API) and, for (c), the `etcd` package (python-etcd, the
v2 client torch's etcd backends import; a bench-only install, never a dependency).

One etcd member on loopback (memory-backed data dir, tests/support/etcd_cluster.py's EtcdCluster,
short raft timings). Every agent runs `--nproc-per-node=1` with the same tiny worker for
both launchers, written into the bench's temp dir: no torch, it appends one JSON line
(wall-clock time of its first line, node, WORLD_SIZE) and sleeps a second. Agents run
through a bench-only wrapper that notes the wall-clock time when the agent enters its
rendezvous call and when it returns: for elasticrun `ElasticRendezvous.next_round()`, for
torchrun `RendezvousHandler.next_rendezvous()` (EtcdRendezvousHandler for `etcd`,
DynamicRendezvousHandler for `etcd-v2`), then runs the launcher's own main.

(a) agents-N (N = 2, 4, 8): N elasticrun agents started together, `--nnodes=N`, on etcd
    and on c10d (the store hosted by node 1's agent, is_host=true), same run. Reported:
    start of the first agent -> every worker started ("total", includes the agents'
    Python start), and the last agent entering the rendezvous -> the last agent leaving
    it with its assignment ("rdzv").
(b) bench/bench_rendezvous_scale.py (imported, its main() run) at 1,000 simulated nodes,
    our store and etcd, one store client per client process (--shared-client).
(c) 4 nodes, `--nnodes=4`: nodes 1-3 started and waited for until each has entered
    its rendezvous call; then node 4. Measured: node 4 enters its rendezvous call (its
    "join") -> every node has returned from it ("join->done"), and -> every worker
    started ("join->workers"). The same interval for torchrun `--rdzv-backend=etcd`,
    torchrun `--rdzv-backend=etcd-v2` and elasticrun `--rdzv-backend=etcd`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from common import (  # noqa: E402
    PYTHON,
    base_env,
    become_subreaper,
    descendants,
    fmt,
    free_port,
    loadavg,
    machine,
    median,
    ratio,
    write_json,
)

CAP = 60.0

WORKER = '''\
import json, os, sys, time
t = time.time()
with open(os.path.join(os.environ["BENCH_EVENTS"], "%d.log" % os.getpid()), "a") as f:
    f.write(json.dumps({"t": t, "ev": "worker", "node": os.environ["BENCH_NODE"],
                        "world": int(os.environ.get("WORLD_SIZE", "0"))}) + "\\n")
time.sleep(1.0)
'''

HOOK = '''\
import json, os, sys, time
_out = open(os.path.join(os.environ["BENCH_EVENTS"], "agent-%d.log" % os.getpid()), "a", buffering=1)
def note(ev):
    _out.write(json.dumps({"t": time.time(), "ev": ev, "node": os.environ["BENCH_NODE"]}) + "\\n")
which = sys.argv.pop(1)
if which == "torchrun":
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous, etcd_rendezvous
    for cls in (etcd_rendezvous.EtcdRendezvousHandler, dynamic_rendezvous.DynamicRendezvousHandler):
        def wrapped(self, _orig=cls.next_rendezvous):
            note("join")
            result = _orig(self)
            note("done")
            return result
        cls.next_rendezvous = wrapped
    from torch.distributed.run import main
    sys.argv[0] = "torchrun"
    main()
else:
    from elasticrun.rendezvous.elastic import ElasticRendezvous
    _orig = ElasticRendezvous.next_round
    async def next_round(self, *a, **k):
        note("join")
        result = await _orig(self, *a, **k)
        note("done")
        return result
    ElasticRendezvous.next_round = next_round
    from elasticrun.launcher.cli import console_main
    sys.argv[0] = "elasticrun"
    console_main()
'''


def read_events(folder: Path) -> list[dict[str, object]]:
    events = []
    for path in folder.glob("*.log"):
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                pass  # a line being written
    return events


class Trial:
    """One job: agents started by PID, their events in one folder, all stopped at the end."""

    def __init__(self, root: Path, launcher: str, backend: str, nodes: int, endpoint: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"{launcher}-{backend}-{nodes}-", dir=root))
        (self.dir / "events").mkdir()
        self.launcher, self.backend, self.nodes, self.endpoint = launcher, backend, nodes, endpoint
        self.run_id = "b" + uuid.uuid4().hex[:10]
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, i: int) -> None:
        conf = []
        if self.backend == "c10d":
            conf = [f"--rdzv-conf=is_host={'true' if i == 1 else 'false'}"]
        argv = [PYTHON, str(self.dir.parent / "hook.py"), self.launcher, f"--nnodes={self.nodes}", "--nproc-per-node=1",
                f"--rdzv-backend={self.backend}", f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}", *conf,
                f"--local-addr=127.0.0.{i}", "--max-restarts=0", str(self.dir.parent / "worker.py")]
        env = base_env(BENCH_EVENTS=str(self.dir / "events"), BENCH_NODE=f"n{i}")
        with open(self.dir / f"n{i}.log", "ab") as log:
            self.procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                               stderr=subprocess.STDOUT, cwd=REPO))

    def wait_for(self, pred, cap: float = CAP) -> list[dict[str, object]] | None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + cap
        while time.monotonic() < deadline:
            events = read_events(self.dir / "events")
            if pred(events):
                return events
            if any(p.poll() not in (None, 0) for p in self.procs):
                return None  # an agent failed
            time.sleep(0.02)
        return None

    def errors(self) -> list[str]:
        lines = []
        for log in sorted(self.dir.glob("n*.log")):
            for line in log.read_text(errors="replace").splitlines():
                if "Error" in line or "error:" in line:
                    lines.append(f"{log.stem}: {line.strip()[:300]}")
        return lines[-4:]

    def stop(self) -> None:
        """SIGKILL each agent and everything below it, by PID, and reap them."""
        for p in self.procs:
            for pid in [*descendants(p.pid), p.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.wait(10)


def count(events: list[dict[str, object]], ev: str, world: int | None = None) -> dict[object, float]:
    """node -> earliest time of `ev` (for workers: of the given world size)."""
    first: dict[object, float] = {}
    for e in events:
        if e["ev"] == ev and (world is None or e.get("world") == world):
            first[e["node"]] = min(first.get(e["node"], 1e18), float(e["t"]))  # type: ignore[arg-type]
    return first


def all_of(ev: str, n: int, world: int | None = None):  # type: ignore[no-untyped-def]
    return lambda events: len(count(events, ev, world)) >= n


def trial_agents(root: Path, backend: str, n: int, endpoint: str) -> dict[str, object]:
    t = Trial(root, "elasticrun", backend, n, endpoint)
    try:
        t0 = time.time()
        for i in range(1, n + 1):
            t.start(i)
        events = t.wait_for(lambda ev: all_of("worker", n, n)(ev) and all_of("done", n)(ev))
        if events is None:
            return {"error": t.errors()}
        joins, dones, workers = count(events, "join"), count(events, "done"), count(events, "worker", n)
        return {"total_s": max(workers.values()) - t0, "rdzv_s": max(dones.values()) - max(joins.values())}
    finally:
        t.stop()


def trial_last_join(root: Path, launcher: str, backend: str, endpoint: str, n: int = 4) -> dict[str, object]:
    t = Trial(root, launcher, backend, n, endpoint)
    try:
        for i in range(1, n):
            t.start(i)
        if t.wait_for(all_of("join", n - 1)) is None:
            return {"error": t.errors()}
        time.sleep(0.5)  # let the first nodes settle in their wait
        t.start(n)
        events = t.wait_for(lambda ev: all_of("worker", n, n)(ev) and all_of("done", n)(ev))
        if events is None:
            return {"error": t.errors()}
        t_join = count(events, "join")[f"n{n}"]
        dones, workers = count(events, "done"), count(events, "worker", n)
        return {"done_s": max(dones.values()) - t_join, "workers_s": max(workers.values()) - t_join}
    finally:
        t.stop()


def run_scale(json_path: Path) -> list[dict[str, object]]:
    import bench_rendezvous_scale as scale

    argv = sys.argv
    sys.argv = ["bench_rendezvous_scale.py", "--sizes", "1000", "--backends", "grpc", "etcd", "--shared-client",
                "--json", str(json_path)]
    try:
        scale.main()
    finally:
        sys.argv = argv
    return json.loads(json_path.read_text())["results"]  # type: ignore[no-any-return]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=["agents", "scale", "torch"], choices=["agents", "scale", "torch"])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="*", default=[2, 4, 8])
    ap.add_argument("--json")
    args = ap.parse_args()
    become_subreaper()
    info = machine()
    try:
        import etcd  # noqa: F401

        info["python-etcd"] = "importable"
    except ImportError as e:
        info["python-etcd"] = f"missing ({e}): torch's etcd backends cannot run"
    print(f"machine: {info}", flush=True)
    from tests.support.etcd_cluster import EtcdCluster

    os.environ["ETCD_ENABLE_V2"] = "true"  # etcd reads its flags from ETCD_* too
    cluster = EtcdCluster(1)
    cluster.start()
    etcd_ep = cluster.endpoints[0]
    out: dict[str, object] = {"machine": info}
    root = Path(tempfile.mkdtemp(prefix="bench-etcd-"))
    (root / "worker.py").write_text(WORKER)
    (root / "hook.py").write_text(HOOK)
    try:
        if "agents" in args.only:
            agents: dict[str, dict[str, list[dict[str, object]]]] = {}
            for rep in range(args.reps):
                for n in args.sizes:
                    for backend in ("etcd", "c10d"):
                        ep = etcd_ep if backend == "etcd" else f"127.0.0.1:{free_port()}"
                        r = trial_agents(root, backend, n, ep)
                        agents.setdefault(str(n), {}).setdefault(backend, []).append(r)
                        print(f"  agents-{n} {backend} rep {rep}: {r}  (load {loadavg()})", flush=True)
            out["agents"] = agents
        if "torch" in args.only:
            torch_runs: dict[str, list[dict[str, object]]] = {}
            for rep in range(args.reps + 1):
                for name, launcher, backend in (("torchrun etcd", "torchrun", "etcd"),
                                                ("torchrun etcd-v2", "torchrun", "etcd-v2"),
                                                ("elasticrun etcd", "elasticrun", "etcd")):
                    r = trial_last_join(root, launcher, backend, etcd_ep)
                    torch_runs.setdefault(name, []).append(r)
                    print(f"  last-join {name} rep {rep}: {r}  (load {loadavg()})", flush=True)
            out["torch"] = torch_runs
        if "scale" in args.only:
            out["scale"] = run_scale(root / "scale.json")
    finally:
        cluster.close()
        etcd_pids = set()
        for pid in descendants(os.getpid()):  # anything of ours left (not etcd: closed above)
            if pid not in etcd_pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    print(f"\nload at end: {loadavg()}")
    if "agents" in out:
        print("\n| agents | etcd: start -> all workers s | c10d: start -> all workers s | ratio "
              "| etcd: last join -> all assigned s | c10d: last join -> all assigned s | ratio |")
        print("|---|---|---|---|---|---|---|")
        for n, by in out["agents"].items():  # type: ignore[union-attr]
            # called within this iteration only; `by` is bound here to say so
            def med(backend: str, key: str, by: dict[str, list[dict[str, float]]] = by) -> float | None:
                return median(r[key] for r in by[backend] if key in r)  # type: ignore[misc]
            e_t, c_t = med("etcd", "total_s"), med("c10d", "total_s")
            e_r, c_r = med("etcd", "rdzv_s"), med("c10d", "rdzv_s")
            print(f"| {n} | {fmt(e_t)} | {fmt(c_t)} | {ratio(e_t, c_t)} | "
                  f"{fmt(e_r, 3)} | {fmt(c_r, 3)} | {ratio(e_r, c_r)} |")
    if "torch" in out:
        print("\n| 4 nodes, last node's join -> | rendezvous done on every node s (median) "
              "| every worker started s (median) | runs ok | vs elasticrun etcd (done) |")
        print("|---|---|---|---|---|")
        runs = out["torch"]
        ours = median(r["done_s"] for r in runs["elasticrun etcd"] if "done_s" in r)  # type: ignore[index]
        for name, rs in runs.items():  # type: ignore[union-attr]
            d = median(r["done_s"] for r in rs if "done_s" in r)
            w = median(r["workers_s"] for r in rs if "workers_s" in r)
            print(f"| {name} | {fmt(d, 3)} | {fmt(w, 3)} | {sum('done_s' in r for r in rs)}/{len(rs)} | "
                  f"{ratio(d, ours)} |")
            for r in rs:
                if "error" in r:
                    print(f"|   error | {r['error']} | | | |")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
