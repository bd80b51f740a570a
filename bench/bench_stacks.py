"""Stacks: time from a hang to its summary, and what a capture costs.

    python bench/bench_stacks.py                        # all scenarios, 3 repetitions
    python bench/bench_stacks.py --only hang --nodes 2 --reps 1

Every agent runs on this machine (127.0.0.1, one store served apart: `elasticrun store
serve`), gloo workers (bench/workers/), LOGLEVEL=INFO.

Scenarios:
  hang       N agents (--nodes, default 2 and 4) x 2 workers, --progress-timeout=5,
             --max-restarts=1 (bench/workers/stuck_loop.py: rank 1 stuck in load_batch at
             step 5, the others in an all-reduce). `s`: from the watchdog's verdict to
             the summary, as the agent that asked logs it ("where the ranks were when the
             hang was found (job-wide: A of N nodes answered, S s)"): its own capture,
             the request, every node's capture and answer, the summary written back;
             `named`: whether the summary names rank 1, its node and load_batch.
  ondemand   the same job without a hang; `elasticrun stacks --json` run 5 times:
             the command's wall time (a Python start, connecting, reading the job) and
             the time from its request to the last answer (`answers_s`).
  capture    StackCapture.capture of 8 Python processes with the boot and 16 threads
             each, 20 times: what a node's capture costs (the round-end capture when a
             peer is lost is this, bounded at 0.5 s).
  lost-peer  3 agents x 1 worker (bench/workers/elastic_loop.py), SIGKILL of n3's agent
             and worker: from the kill to the survivors' first step at world 2, with
             this checkout and with the commit before the stacks (--base, a `git archive`
             of it on PYTHONPATH), interleaved: what the round-end capture adds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    PYTHON,
    REPO,
    WORKERS,
    ProcessTracker,
    base_env,
    fmt,
    free_port,
    loadavg,
    median,
    start_run,
    write_json,
)

HANG = re.compile(
    r"where the ranks were when the hang was found \(job-wide: (\d+) of (\d+) nodes answered, ([\d.]+)s\): (.*)$", re.M
)
CONF = "heartbeat_timeout=2,last_call_timeout=0.5,join_timeout=120,is_host=false"


def wait_for(predicate, cap: float, interval: float = 0.05):
    deadline = time.monotonic() + cap
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(interval)
    return None


def serve(tracker: ProcessTracker, folder: Path, env: dict[str, str]) -> str:
    port = free_port()
    log = folder / "store.log"
    tracker.start([PYTHON, "-m", "elasticrun", "store", "serve", "--host", "127.0.0.1", "--port", str(port)],
                  env=env, log=log)
    if not wait_for(lambda: "serving on" in log.read_text(errors="replace") if log.exists() else False, 30):
        raise RuntimeError(f"the store did not start: {log}")
    return f"127.0.0.1:{port}"


def agents(tracker: ProcessTracker, folder: Path, env: dict[str, str], endpoint: str, job: str, nodes: int,
           nnodes: str, nproc: int, worker: str, extra: list[str]) -> list[tuple[subprocess.Popen[bytes], Path]]:
    started = []
    for n in range(nodes):
        log = folder / f"n{n + 1}.log"
        argv = [PYTHON, "-m", "elasticrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}", f"--rdzv-conf={CONF}",
                "--local-addr=127.0.0.1", f"--log-dir={folder / 'logs'}", *extra, str(WORKERS / worker)]
        # run from the trial's folder: from the checkout, `python -m` would import its
        # elasticrun before the one PYTHONPATH names (lost-peer's base)
        started.append((tracker.start(argv, env={**env, "BENCH_NODE": f"n{n + 1}"}, log=log, cwd=folder), log))
    return started


def events(folder: Path) -> list[dict[str, object]]:
    out = []
    for path in folder.glob("*.log"):
        for line in path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def trial_hang(nodes: int, cap: float) -> dict[str, object]:
    tracker, folder = ProcessTracker(), Path(tempfile.mkdtemp(prefix="stacks-hang-"))
    ev = folder / "events"
    ev.mkdir()
    env = base_env(BENCH_EVENTS=str(ev), BENCH_STUCK_RANK="1", BENCH_STUCK_STEP="5")
    try:
        endpoint = serve(tracker, folder, env)
        logs = agents(tracker, folder, env, endpoint, f"bench-{os.getpid()}-{time.time_ns()}", nodes, str(nodes),
                      2, "stuck_loop.py", ["--progress-timeout=5", "--max-restarts=1"])
        found = wait_for(lambda: next((m for _, log in logs if (m := HANG.search(log.read_text(errors="replace")))),
                                      None), cap)
        if found is None:
            return {"nodes": nodes, "s": None, "load": loadavg()}
        named = bool(re.search(r"rank 1 on node \S+: stuck_loop\.py:\d+ in load_batch", found[4]))
        return {"nodes": nodes, "answered": int(found[1]), "asked": int(found[2]), "s": float(found[3]),
                "named": named, "summary": found[4], "load": loadavg()}
    finally:
        tracker.stop_all()


def trial_ondemand(nodes: int, cap: float, runs: int = 5) -> list[dict[str, object]]:
    tracker, folder = ProcessTracker(), Path(tempfile.mkdtemp(prefix="stacks-ondemand-"))
    ev = folder / "events"
    ev.mkdir()
    env = base_env(BENCH_EVENTS=str(ev), BENCH_STUCK_RANK="-1")
    job = f"bench-{os.getpid()}-{time.time_ns()}"
    rows = []
    try:
        endpoint = serve(tracker, folder, env)
        agents(tracker, folder, env, endpoint, job, nodes, str(nodes), 2, "stuck_loop.py", [])
        if not wait_for(lambda: sum(1 for e in events(ev) if e.get("ev") == "step" and e.get("step") == 3)
                        >= 2 * nodes, cap):
            return [{"nodes": nodes, "s": None}]
        for _ in range(runs):
            t0 = time.monotonic()
            out = subprocess.run([PYTHON, "-m", "elasticrun", "stacks", f"--rdzv-endpoint={endpoint}",
                                  f"--rdzv-id={job}", "--json"], capture_output=True, text=True, env=env, timeout=60)
            wall = time.monotonic() - t0
            data = json.loads(out.stdout)
            answered = re.search(r"(\d+) of (\d+) nodes answered in ([\d.]+)s", data["header"])
            rows.append({"nodes": nodes, "wall_s": wall, "answers_s": float(answered[3]) if answered else None,
                         "ranks": len(data["ranks"]), "load": loadavg()})
        return rows
    finally:
        tracker.stop_all()


def trial_capture(reps: int = 20, procs: int = 8, threads: int = 16) -> dict[str, object]:
    sys.path.insert(0, str(REPO))
    from elasticrun.agent.boot import boot_env
    from elasticrun.agent.sessions import Session
    from elasticrun.agent.stacks import StackCapture, Target, prepare_file, stacks_env

    folder = Path(tempfile.mkdtemp(prefix="stacks-capture-"))
    script = folder / "w.py"
    script.write_text(
        "import threading, time\n"
        f"for _ in range({threads - 1}):\n"
        "    threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
        "print('ready', flush=True)\n"
        "def step():\n"
        "    time.sleep(3600)\n"
        "step()\n"
    )
    tracker, targets = ProcessTracker(), []
    try:
        for i in range(procs):
            file = folder / f"{i}.stacks"
            prepare_file(file)
            env = dict(os.environ)
            env.update(boot_env(env))
            env.update(stacks_env(file))
            proc = subprocess.Popen([PYTHON, str(script)], env=env, stdout=subprocess.PIPE, start_new_session=True)
            tracker.procs.append(proc)  # type: ignore[arg-type]
            assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
            targets.append(Target(i, i, Session.of_leader(proc.pid), file))
        capture = StackCapture("bench")
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            got = capture.capture(targets, 2.0)
            times.append(time.perf_counter() - t0)
            assert all(not r.missing and len(r.threads) == threads for r in got), got
        times.sort()
        return {"procs": procs, "threads": threads, "median_s": statistics.median(times),
                "p90_s": times[int(0.9 * (len(times) - 1))], "max_s": times[-1], "load": loadavg()}
    finally:
        for proc in tracker.procs:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def trial_lost_peer(pythonpath: str | None, cap: float) -> dict[str, object]:
    tracker, folder = ProcessTracker(), Path(tempfile.mkdtemp(prefix="stacks-lost-"))
    ev = folder / "events"
    ev.mkdir()
    env = base_env(BENCH_EVENTS=str(ev))
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    try:
        endpoint = serve(tracker, folder, env)
        started = agents(tracker, folder, env, endpoint, f"bench-{os.getpid()}-{time.time_ns()}", 3, "1:3",
                         1, "elastic_loop.py", ["--max-restarts=3"])
        if not wait_for(lambda: {e["node"] for e in events(ev) if e.get("ev") == "step" and e.get("world") == 3}
                        >= {"n1", "n2", "n3"}, cap):
            return {"s": None}
        n3 = {e["pid"] for e in events(ev) if e.get("node") == "n3" and e.get("ev") == "start"}
        t0 = time.time()
        os.kill(started[2][0].pid, signal.SIGKILL)
        for pid in n3:
            try:
                os.kill(int(pid), signal.SIGKILL)  # type: ignore[call-overload]
            except ProcessLookupError:
                pass
        first = wait_for(lambda: min((e["t"] for e in events(ev) if e.get("ev") == "step" and e.get("world") == 2
                                      and e["t"] > t0), default=None), cap)
        capture = re.findall(r"captured in ([\d.]+)s", "".join(log.read_text(errors="replace")
                                                              for _, log in started[:2]))
        return {"s": first - t0 if first else None, "captures_s": [float(c) for c in capture], "load": loadavg()}
    finally:
        tracker.stop_all()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--only", choices=["hang", "ondemand", "capture", "lost-peer"], action="append")
    p.add_argument("--base", default="c2eb646", help="the commit before the stacks, for lost-peer")
    p.add_argument("--cap", type=float, default=120.0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    info, _ = start_run("bench-stacks-")
    only = set(args.only or ["hang", "ondemand", "capture", "lost-peer"])
    results: dict[str, object] = {"machine": info}
    if "capture" in only:
        row = trial_capture()
        results["capture"] = row
        print(f"capture: {row['procs']} processes x {row['threads']} threads: median {fmt(row['median_s'], 4)}s, "
              f"p90 {fmt(row['p90_s'], 4)}s, max {fmt(row['max_s'], 4)}s (load {row['load']})", flush=True)
    if "hang" in only:
        rows = [trial_hang(n, args.cap) for n in args.nodes for _ in range(args.reps)]
        results["hang"] = rows
        for n in args.nodes:
            mine = [r for r in rows if r["nodes"] == n]
            took = median(r["s"] for r in mine if r["s"])
            print(f"hang, {n} nodes x 2 workers: verdict -> summary median {fmt(took)}s"
                  f" over {[fmt(r['s']) for r in mine]}, all named: {all(r.get('named') for r in mine)}; "
                  f"answered {[r.get('answered') for r in mine]}", flush=True)
    if "ondemand" in only:
        rows = [row for n in args.nodes for row in trial_ondemand(n, args.cap)]
        results["ondemand"] = rows
        for n in args.nodes:
            mine = [r for r in rows if r["nodes"] == n and r.get("wall_s")]
            answers = median(r["answers_s"] for r in mine if r["answers_s"] is not None)
            print(f"elasticrun stacks, {n} nodes x 2 workers: wall median {fmt(median(r['wall_s'] for r in mine))}s, "
                  f"request -> last answer median {fmt(answers)}s", flush=True)
    if "lost-peer" in only:
        base = Path(tempfile.mkdtemp(prefix="stacks-base-"))
        subprocess.run(f"git -C {REPO} archive {args.base} elasticrun | tar -x -C {base}", shell=True, check=True)
        rows = []
        for _ in range(args.reps):
            for label, path in (("base", str(base)), ("stacks", None)):
                rows.append({"build": label, **trial_lost_peer(path, args.cap)})
        results["lost_peer"] = rows
        for label in ("base", "stacks"):
            mine = [r for r in rows if r["build"] == label]
            took = median(r["s"] for r in mine if r["s"])
            print(f"lost peer, {label}: kill -> first step at world 2 median {fmt(took)}s"
                  f" over {[fmt(r['s']) for r in mine]}; round-end captures {[r.get('captures_s') for r in mine]}",
                  flush=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
