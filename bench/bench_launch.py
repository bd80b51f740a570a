"""Launcher overhead: elasticrun against torchrun, side by side, in one run.

    python bench/bench_launch.py                 # N=5 per launcher and job, ~1-2 minutes
    python bench/bench_launch.py --reps 3 --json /tmp/launch.json

Two jobs, `--standalone --nproc-per-node=2`, the same worker scripts for both launchers:
  noop       bench/workers/noop.py (an empty script): the launcher's own cost
  allreduce  bench/workers/allreduce.py: gloo init_process_group + one all_reduce
Trials alternate launchers (and which goes first) after one untimed warm-up of each.

Wall time: from just before Popen of the launcher to its exit (`Popen.wait`).
Agent peak RSS: VmHWM from /proc/<launcher pid>/status, polled every 5 ms by a thread
while the launcher runs; VmHWM is the process's own high-water mark (workers are other
processes and are not included, unlike wait4()/`time -v`, whose ru_maxrss also covers
reaped children), and it only grows, so the last read before exit is the peak up to the
last ≤5 ms. Each trial is capped (120 s) and recorded as not completing when it runs over.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    LAUNCHERS,
    WORKERS,
    ProcessTracker,
    base_env,
    fmt,
    loadavg,
    median,
    ratio,
    start_run,
    write_json,
)

JOBS = {"noop": WORKERS / "noop.py", "allreduce": WORKERS / "allreduce.py"}
CAP_S = 120.0


def _vm_hwm_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def trial(launcher: str, job: str, logdir: Path, tag: str) -> dict[str, object]:
    tracker = ProcessTracker()
    argv = [*LAUNCHERS[launcher], "--standalone", "--nproc-per-node=2", str(JOBS[job])]
    log = logdir / f"{tag}-{launcher}-{job}.log"
    peak = [0]
    t0 = time.perf_counter()
    proc = tracker.start(argv, env=base_env(), log=log)
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            hwm = _vm_hwm_kib(proc.pid)
            if hwm:
                peak[0] = max(peak[0], hwm)
            time.sleep(0.005)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        rc: int | None = proc.wait(CAP_S)
    except Exception:  # TimeoutExpired
        rc = None
    wall = time.perf_counter() - t0
    done.set()
    poller.join()
    tracker.stop_all()
    return {"launcher": launcher, "job": job, "rc": rc, "wall_s": wall if rc is not None else None,
            "peak_rss_mib": peak[0] / 1024 if peak[0] else None, "log": str(log)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="write every trial here")
    args = ap.parse_args()
    info, logdir = start_run("bench_launch_")
    results: list[dict[str, object]] = []
    for job in JOBS:
        for launcher in LAUNCHERS:  # warm-up: page cache, .pyc files
            trial(launcher, job, logdir, "warmup")
        for rep in range(args.reps):
            order = list(LAUNCHERS) if rep % 2 == 0 else list(reversed(LAUNCHERS))
            for launcher in order:
                r = trial(launcher, job, logdir, f"rep{rep}")
                r["rep"] = rep
                results.append(r)
                print(f"{job:9} {launcher:10} rep {rep}: rc={r['rc']} wall={fmt(r['wall_s'], 3)} s "
                      f"agent peak RSS={fmt(r['peak_rss_mib'], 1)} MiB (load {loadavg()})", flush=True)

    print("\n| job | launcher | ok/runs | wall median s | wall min–max s | agent peak RSS median MiB |")
    print("|---|---|---|---|---|---|")
    summary: dict[str, dict[str, dict[str, float | None]]] = {}
    for job in JOBS:
        for launcher in LAUNCHERS:
            rs = [r for r in results if r["job"] == job and r["launcher"] == launcher]
            ok = [r for r in rs if r["rc"] == 0]
            walls = [float(r["wall_s"]) for r in ok]  # type: ignore[arg-type]
            rss = [float(r["peak_rss_mib"]) for r in ok if r["peak_rss_mib"]]  # type: ignore[arg-type]
            summary.setdefault(job, {})[launcher] = {"wall": median(walls), "rss": median(rss)}
            span = f"{min(walls):.3f}–{max(walls):.3f}" if walls else "—"
            print(f"| {job} | {launcher} | {len(ok)}/{len(rs)} | {fmt(median(walls), 3)} | {span} | "
                  f"{fmt(median(rss), 1)} |")
    print("\n| job | wall ours/torchrun | target | agent peak RSS ours/torchrun | target |")
    print("|---|---|---|---|---|")
    targets = {"noop": 0.3, "allreduce": 0.75}
    for job in JOBS:
        e, t = summary[job]["elasticrun"], summary[job]["torchrun"]
        print(f"| {job} | {ratio(e['wall'], t['wall'])} | ≤ {targets[job]} | {ratio(e['rss'], t['rss'])} | ≤ 0.2 |")
    print(f"\nload average at end: {loadavg()}; logs in {logdir}")
    write_json(args.json, {"machine": info, "trials": results, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
