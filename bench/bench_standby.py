"""The memory a standby worker holds (warm restarts, --warm-imports), beside a worker's.

    python bench/bench_standby.py                          # --warm-imports=torch
    python bench/bench_standby.py --warm-imports=torch,numpy

One node, `--standalone --nproc-per-node=2`, the elastic benchmark's worker
(bench/workers/elastic_loop.py: gloo, an all_reduce and an optimizer step every 0.1 s).
Once the agent says `standby workers ready`, reads VmRSS (resident now), VmHWM (its
peak) and Pss (its share of pages shared with other processes, libtorch's code among
them) of each standby and of each running worker from /proc, and prints them in MB.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import LAUNCHERS, WORKERS, ProcessTracker, base_env, descendants, start_run  # noqa: E402


def _memory(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of `pid`, and its Pss (shared pages divided among their users), in MB."""
    fields = {}
    for name in ("status", "smaps_rollup"):
        for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "Pss"):
                fields[key] = int(value.split()[0]) / 1024
    return fields


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm-imports", default="torch")
    ap.add_argument("--cap", type=float, default=120.0, help="seconds to wait for the standbys")
    args = ap.parse_args()
    _, root = start_run("bench_standby_")
    (root / "events").mkdir()
    log = root / "agent.log"
    tracker = ProcessTracker()
    argv = [*LAUNCHERS["elasticrun"], "--standalone", "--nproc-per-node=2", f"--warm-imports={args.warm_imports}",
            str(WORKERS / "elastic_loop.py")]
    try:
        agent = tracker.start(argv, env=base_env(BENCH_EVENTS=str(root / "events")), log=log)
        deadline = time.monotonic() + args.cap
        found = None
        while time.monotonic() < deadline and found is None:
            found = re.search(r"standby workers ready \(local rank: pid ([^)]*)\)", log.read_text(errors="replace"))
            time.sleep(0.1)
        if found is None:
            print(f"no standby ready within {args.cap:g} s; see {log}")
            return 1
        standbys = [int(pid) for pid in re.findall(r"\d+: (\d+)", found.group(1))]
        workers = [pid for pid in descendants(agent.pid) if pid not in standbys and _runs_loop(pid)]
        print(f"--warm-imports={args.warm_imports}, MB (VmRSS now / VmHWM peak / Pss):")
        for what, pids in (("standby", standbys), ("worker", workers)):
            for pid in pids:
                m = _memory(pid)
                print(f"  {what} pid {pid}: {m['VmRSS']:.0f} / {m['VmHWM']:.0f} / {m['Pss']:.0f}")
    finally:
        tracker.stop_all()
    return 0


def _runs_loop(pid: int) -> bool:
    try:
        return b"elastic_loop.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
