"""In-process elasticity against restart mode and torchrun, side by side, in one run.

    python bench/bench_inprocess.py                 # 3 repetitions, ~15 minutes on 2 cores
    python bench/bench_inprocess.py --reps 1        # a quick look

The same worker script and model for the three (bench/workers/inprocess_loop.py: an MLP
of 4.2M parameters, SGD with momentum, gradients averaged with gloo, a checkpoint by
rank 0 every 20 steps that a fresh worker loads at start), one worker per node
(`--nproc-per-node=1`), agents on 127.0.0.x, `--rdzv-backend=c10d` with the store hosted
by node n1's agent, `--max-restarts=3`, otherwise default settings (heartbeat 5 s).

  in-process   elasticrun --elastic-mode=in-process
  restart      elasticrun (torchrun's model: every worker restarts on a change)
  torchrun     python -m torch.distributed.run, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
               (with its shared store torchrun did not scale up at all in bench_elastic)

Phases, each timed two ways: recovery, the training the job lost (its last step at the
old world size -> its first step at the new one; the issue's target, ≤ 0.1x torchrun),
and the time from the action (t0, just before it) to the first step at the new size,
which on scale-up includes the newcomer's own start while the job trains on. Every wait
is capped at --cap seconds:
  scale-up   n1, n2 stepping at world 2; start n3 -> first step at world 3
  sigterm    n1..n3 stepping at world 3; SIGTERM to n3's agent -> first step at world 2
  sigkill    n1..n3 stepping at world 3; SIGKILL n3's agent and worker -> first step at 2
The table also counts the worker processes each run started: 3 (two or three nodes'
workers, none restarted) is what in-process mode must show; restart mode and torchrun
start a fresh process for every survivor at every change.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_elastic  # noqa: E402
from bench_elastic import Job  # noqa: E402
from common import WORKERS, fmt, kill_tree, loadavg, median, ratio, start_run, write_json  # noqa: E402

SCRIPT = WORKERS / "inprocess_loop.py"
MODES = {
    "in-process": ("elasticrun", ("--elastic-mode=in-process",)),
    "restart": ("elasticrun", ()),
    "torchrun": ("torchrun-noshare", ()),
}
PHASES = ("scale_up", "sigterm", "sigkill")


def _job(mode: str, workdir: Path) -> Job:
    launcher, extra = MODES[mode]
    (workdir / "ckpt").mkdir(parents=True)
    return Job(launcher, "1:3", workdir, script=SCRIPT, extra=extra, env={"BENCH_CKPT_DIR": str(workdir / "ckpt")})


def _measure(job: Job, phase: str, cap: float) -> dict[str, object]:
    """Bring the job to the phase's starting point, act, and time the recovery."""
    t_start = time.time()
    for i in (1, 2) if phase == "scale_up" else (1, 2, 3):
        job.start_node(i)
    world_before = 2 if phase == "scale_up" else 3
    if job.step_at(world_before, t_start, cap) is None:
        return {"s": None, "note": f"never stepped at world {world_before}"}
    time.sleep(1.0)  # a few steps at the starting size
    t0 = time.time()
    if phase == "scale_up":
        job.start_node(3)
        world_after = 3
    elif phase == "sigterm":
        os.kill(job.nodes[3], signal.SIGTERM)
        world_after = 2
    else:
        kill_tree(job.nodes[3], signal.SIGKILL)
        world_after = 2
    t1 = job.step_at(world_after, t0, cap)
    if t1 is None:
        return {"s": None, "note": f"no step at world {world_after} within {cap:g} s"}
    job.events.refresh()
    started = len({e["pid"] for e in job.events.events if e["ev"] == "start"})
    return {"s": t1 - t0, "pause_s": _pause(job, world_before, t0, t1), "workers_started": started}


def _pause(job: Job, world_before: int, t0: float, t1: float) -> float | None:
    """The training the job lost: its last step at the old size -> first at the new one.

    Scale-up: the survivors train on while the newcomer starts, so this is what the
    change itself costs them. Node loss: from the last step before the loss.
    """
    job.events.refresh()
    last = [float(e["t"]) for e in job.events.events  # type: ignore[arg-type]
            if e["ev"] == "step" and e["world"] == world_before and float(e["t"]) < t1]  # type: ignore[arg-type]
    return None if not last else t1 - max(max(last), t0 if world_before == 3 else 0.0)


def _table(summary: dict[str, dict[str, object]], key: str, target: str) -> None:
    """One markdown table of the medians of `key` (s or pause_s), modes side by side."""
    print("| phase | in-process | restart | torchrun | in-process / torchrun | restart / torchrun "
          "| in-process / restart |" + (" target |" if target else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if target else ""))
    for phase, cells in summary.items():
        # called within this iteration only; `cells` is bound here to say so
        def cell(mode: str, cells: dict[str, object] = cells) -> str:
            c = cells[mode]
            if not c["runs"]:  # type: ignore[index]
                return "—"
            return f"{fmt(c[key])} ({c['ok']}/{c['runs']}; processes {c['started']})"  # type: ignore[index]

        m = {k: cells[k][key] for k in MODES}  # type: ignore[index]
        print(f"| {phase} | {cell('in-process')} | {cell('restart')} | {cell('torchrun')} | "
              f"{ratio(m['in-process'], m['torchrun'])} | {ratio(m['restart'], m['torchrun'])} | "  # type: ignore[arg-type]
              f"{ratio(m['in-process'], m['restart'])} |" + (f" {target} |" if target else ""))  # type: ignore[arg-type]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cap", type=float, default=90.0, help="seconds each phase may take")
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    ap.add_argument("--phases", nargs="*", default=list(PHASES), choices=list(PHASES))
    ap.add_argument("--json", help="write every trial here")
    ap.add_argument("--baseline", default="",
                    help="a checkout of an earlier elasticrun (e.g. from git archive): its in-process and restart "
                         "modes run side by side as in-process-base and restart-base")
    args = ap.parse_args()
    if args.baseline:
        bench_elastic.BASELINE = args.baseline
        for mode in ("in-process", "restart"):
            if mode in args.modes:
                MODES[f"{mode}-base"] = ("elasticrun-base", MODES[mode][1])
                args.modes.append(f"{mode}-base")
    info, root = start_run("bench_inprocess_")
    trials: list[dict[str, object]] = []
    started = time.monotonic()
    for rep in range(args.reps):
        for phase in args.phases:
            modes = list(args.modes) if rep % 2 == 0 else list(reversed(args.modes))
            for mode in modes:
                job = _job(mode, root / f"rep{rep}-{phase}-{mode}")
                print(f"rep {rep} {phase} {mode} (load {loadavg()}, {time.monotonic() - started:.0f} s in)", flush=True)
                try:
                    res = _measure(job, phase, args.cap)
                finally:
                    job.tracker.stop_all()
                print(f"    {fmt(res.get('s'))} s {res}", flush=True)  # type: ignore[arg-type]
                trials.append({"rep": rep, "phase": phase, "mode": mode, "dir": str(job.workdir),
                               "load": loadavg(), **res})

    print(f"\nall done in {time.monotonic() - started:.0f} s; load {loadavg()}; logs under {root}\n")
    summary: dict[str, dict[str, object]] = {}
    for phase in args.phases:
        cells: dict[str, dict[str, object]] = {}
        for mode in MODES:
            rs = [t for t in trials if t["phase"] == phase and t["mode"] == mode]
            times = [float(t["s"]) for t in rs if t.get("s") is not None]  # type: ignore[arg-type]
            pauses = [float(t["pause_s"]) for t in rs if t.get("pause_s") is not None]  # type: ignore[arg-type]
            cells[mode] = {"s": median(times), "ok": len(times), "runs": len(rs), "times": times,
                           "pause_s": median(pauses), "pauses": pauses,
                           "started": [t.get("workers_started") for t in rs]}
        summary[phase] = cells
    print("Recovery: the training the job lost, from its last step at the old size to its first "
          "step at the new one (median seconds; runs that got there / runs; worker processes "
          "started in each run, 3 when no worker was restarted). For a node lost this is the "
          "time from the loss; on scale-up the job trains on while the newcomer starts.\n")
    _table(summary, "pause_s", "≤ 0.1 of torchrun")
    print("\nTime from the action to the first step at the new world size (on scale-up this "
          "includes the newcomer's own start: a Python process importing torch).\n")
    _table(summary, "s", "")
    if args.baseline:
        print("\nThe earlier checkout (--baseline), same runs: recovery / time to the new size (median seconds)\n")
        print("| phase | " + " | ".join(m for m in MODES if m.endswith("-base")) + " |")
        print("|---|" + "---|" * sum(m.endswith("-base") for m in MODES))
        for phase, cells in summary.items():
            row = [f"{fmt(cells[m]['pause_s'])} / {fmt(cells[m]['s'])}" for m in MODES if m.endswith("-base")]  # type: ignore[index]
            print(f"| {phase} | " + " | ".join(row) + " |")
    write_json(args.json, {"machine": info, "trials": trials, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
