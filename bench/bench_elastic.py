"""Elastic behaviour: elasticrun against torchrun, side by side, in one run.

    python bench/bench_elastic.py --cap 90               # 3 repetitions, ~21 minutes on 2 cores
    python bench/bench_elastic.py --reps 1 --only rdzv  # a quick look

Several agents on this machine, one per 127.0.0.x address (`--local-addr`), one worker
each (`--nproc-per-node=1`), the same worker script for both launchers
(bench/workers/elastic_loop.py: gloo, one all_reduce every 0.1 s, a JSON event line per
step with its wall-clock time and world size). Both use `--rdzv-backend=c10d` with the
store hosted by the agent of node n1 (127.0.0.1, `--rdzv-conf is_host=true`; the other
agents `is_host=false`), `--max-restarts=3` (with 0 neither launcher survives a lost
peer), and otherwise default settings (elasticrun: last call 1 s, heartbeat 5 s;
torchrun: last call 30 s, monitor interval 0.1 s). Only non-host nodes are stopped,
except in `host-kill`.

Scenarios (t0 is taken just before the action; every wait is capped at --cap seconds):
  rdzv-N     --nnodes=N, N agents started together (N = 2, 4, 8): time until every
             worker has started (first line of the script, before `import torch`), and
             until the first step at world N
  grow       --nnodes=1:3, chained, each phase measured from its own t0:
             formation: start n1 and n2 together -> first step at world 2
             scale-up:  start n3 -> first step at world 3
             crash:     one worker exits 1 once -> first step of a fresh worker process
             sigterm:   SIGTERM to n3's agent -> first step at world 2
  kill       --nnodes=1:3, n1..n3 stepping at world 3, then SIGKILL of n3's agent and
             worker together (a node dies) -> first step of the survivors at world 2
  host-kill  --nnodes=1:2, n1 and n2 stepping at world 2 (a job of two nodes: no
             successor can take the store over), then SIGKILL of n1's agent (the store's
             host) and worker together -> n2's agent has exited (`s`; polled every
             0.02 s), and its worker (the process below it at t0 that runs the script)
             is gone (`spawn_s`); with its exit code and last error line. No head comes
             back: elasticrun's survivor stops its worker at once and exits when
             store_host_grace (30 s) has passed.
  head-restart --nnodes=1:2, n1 and n2 stepping at world 2, then SIGKILL of n1's agent
             and worker together, and a new n1 agent at the same address
             HEAD_RESTART_DELAY (5 s) later, as a scheduler restarting the head does ->
             the first step at world 2 after the new agent started (`s`, from the kill),
             and both workers of that round started (`spawn_s`); with whether the
             survivor was still running when the new head started, its exit code, and
             the world of the first step after it (torchrun's new head alone: world 1).
  host-failover --nnodes=3:4, n1..n4 stepping at world 4, then SIGKILL of n1's agent
             (the store's host) and worker together -> the first step at world 3 (`s`)
             and the three workers of that round started (`spawn_s`): elasticrun's
             first successor serves the store's copy, no external store; with the
             survivors' agents' exit codes where they exited (torchrun loses the job).
  host-preempt --nnodes=3:4, as host-failover with SIGTERM to n1's agent alone (a
             preemption notice): elasticrun's host leaves and hands the store over.
  spare      --nnodes=3 (fixed), n1..n3 stepping at world 3, then n4 started and left
             to settle 5 s (a spare; torchrun's waits for the next round), then SIGKILL
             of n3's agent and worker -> first step at world 3 again (n4 in n3's place)
  dead-spare --nnodes=3 (fixed), as `spare` with two spares, n4 then n5 (5 s each to
             settle: n4 is the first picked); SIGKILL of n4's agent, and 2 s later of
             n3's agent and worker -> first step at world 3 again, n5 in n3's place
             (two deaths in one lease TTL: a dead spare lingers until its lease ends
             unless the leader finds its liveness port closed)
  dead-waiting --nnodes=3 (fixed), n1 and n2 started and left to settle 5 s (both wait
             for a third node), SIGKILL of n2's agent, and 2 s later n3 and n4 started
             together -> first step at world 3 (n1, n3, n4), with the workers started
             until then (3: the first round was the live nodes'; more: a round that
             held the dead node started workers that never stepped)
  torchrun runs `grow` a second time with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
  ("torchrun-noshare"), for scale-up. elasticrun runs `kill` and `grow` a second time
  with --warm-imports=off ("elasticrun-cold": every worker starts cold); the default
  (warm) run waits before the kill and the crash until the nodes that go on say
  `standby workers ready`, as a job that has run a while has them (a node's first
  round, as n3's in scale-up, starts cold: no standby before its first step).
A phase that did not happen within the cap is recorded as such, and the rest of that
chain is skipped (it would start from an unknown state).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    LAUNCHERS,
    WORKERS,
    ProcessTracker,
    base_env,
    descendants,
    fmt,
    free_port,
    kill_tree,
    loadavg,
    median,
    ratio,
    start_run,
    write_json,
)

SCRIPT = WORKERS / "elastic_loop.py"
#: seconds the spare scenario gives the fourth agent to settle before the kill
SPARE_SETTLE = 5.0
#: seconds between a spare's death and a participant's in `dead-spare`: within a lease TTL
DEAD_SPARE_GAP = 2.0
#: seconds between the SIGKILL of the head and the start of its replacement (head-restart)
HEAD_RESTART_DELAY = 5.0
#: --baseline: a checkout of an earlier elasticrun, run as launcher "elasticrun-base"
BASELINE = ""
MAX_RESTARTS = 3
Event = dict[str, object]


class Events:
    """The workers' event lines, read incrementally from one folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.events: list[Event] = []
        self._offsets: dict[Path, int] = {}

    def refresh(self) -> None:
        for path in self.folder.glob("*.log"):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            for line in data[:end].splitlines():
                self.events.append(json.loads(line))
            self._offsets[path] = offset + end

    def first(self, pred: Callable[[Event], bool], timeout: float) -> Event | None:
        """The earliest event matching `pred`, waiting up to `timeout` for one to appear."""
        deadline = time.monotonic() + timeout
        while True:
            self.refresh()
            if any(pred(e) for e in self.events):
                time.sleep(0.2)  # let slower files catch up, then take the earliest
                self.refresh()
                return min((e for e in self.events if pred(e)), key=lambda e: float(e["t"]))  # type: ignore[arg-type]
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


@dataclass
class Job:
    launcher: str  # elasticrun | elasticrun-cold | torchrun | torchrun-noshare
    nnodes: str
    workdir: Path
    tracker: ProcessTracker = field(default_factory=ProcessTracker)
    port: int = field(default_factory=free_port)
    run_id: str = field(default_factory=lambda: "bench" + uuid.uuid4().hex[:8])
    nodes: dict[int, int] = field(default_factory=dict)  # node index -> agent pid
    script: Path = SCRIPT
    #: launcher flags on top of the common ones (e.g. --elastic-mode=in-process)
    extra: tuple[str, ...] = ()
    #: environment for the workers on top of the common one
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        (self.workdir / "events").mkdir(parents=True)
        self.events = Events(self.workdir / "events")
        self.crash_file = self.workdir / "crash"

    def start_node(self, i: int) -> None:
        base = LAUNCHERS["torchrun" if self.launcher.startswith("torchrun") else "elasticrun"]
        cwd = {}
        if self.launcher == "elasticrun-base":  # an earlier elasticrun, from --baseline's checkout
            self.env = {**self.env, "PYTHONPATH": BASELINE}
            cwd = {"cwd": Path(BASELINE)}  # `python -m` looks in the working folder first
        argv = [
            *base,
            f"--nnodes={self.nnodes}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}",
            f"--rdzv-id={self.run_id}",
            f"--rdzv-conf=is_host={'true' if i == 1 else 'false'}",
            f"--local-addr=127.0.0.{i}",
            f"--max-restarts={MAX_RESTARTS}",
            *self.extra,
            *(["--warm-imports=off"] if self.launcher == "elasticrun-cold" else []),
            str(self.script),
        ]
        env = base_env(BENCH_EVENTS=str(self.workdir / "events"), BENCH_NODE=f"n{i}",
                       BENCH_CRASH_FILE=str(self.crash_file), **self.env)
        if self.launcher == "torchrun-noshare":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        proc = self.tracker.start(argv, env=env, log=self.workdir / f"n{i}.log", **cwd)
        self.nodes[i] = proc.pid

    def standbys_ready(self, nodes: tuple[int, ...], after: float, cap: float) -> None:
        """Warm elasticrun: wait (at most `cap` s) until each of `nodes` said its standbys are ready after `after`."""
        if self.launcher != "elasticrun":
            return
        deadline = time.monotonic() + cap
        while time.monotonic() < deadline:
            if all(_ready_since(self.workdir / f"n{i}.log", after) for i in nodes):
                return
            time.sleep(0.05)

    def step_at(self, world: int, after: float, cap: float) -> float | None:
        e = self.events.first(lambda e: e["ev"] == "step" and e["world"] == world and float(e["t"]) > after, cap)  # type: ignore[arg-type]
        return None if e is None else float(e["t"])  # type: ignore[arg-type]


def _ready_since(log: Path, after: float) -> bool:
    """Whether the agent's log says `standby workers ready` at a time after `after`."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return False
    for stamp in re.findall(r"\[elasticrun (\S+) INFO [^\]]*\] standby workers ready", text):
        if datetime.datetime.fromisoformat(stamp).timestamp() > after:
            return True
    return False


def _assigned_to_init(job: Job, t0: float, nodes: tuple[int, ...]) -> float | None:
    """elasticrun: the time from the new round's opening (the leader's `round N: ...` line
    after `t0`; no node has its place before) to the last of `nodes`' new workers' gloo
    group up (`init`)."""
    if not job.launcher.startswith("elasticrun"):
        return None
    job.events.refresh()
    inits = [float(e["t"]) for e in job.events.events  # type: ignore[arg-type]
             if e["ev"] == "init" and float(e["t"]) > t0 and e["node"] in {f"n{i}" for i in nodes}]  # type: ignore[arg-type]
    opened = [
        stamp
        for log in job.workdir.glob("n*.log")
        for text in re.findall(r"\[elasticrun (\S+) INFO [^\]]*\] round \d+: ", log.read_text(errors="replace"))
        if (stamp := datetime.datetime.fromisoformat(text).timestamp()) > t0
    ]
    if len(inits) < len(nodes) or not opened:
        return None
    return max(inits) - min(opened)


def _spawned(job: Job, t0: float, world: int, exclude: set[object] = frozenset()) -> float | None:  # type: ignore[assignment]
    """When the last of the `world` workers of the new round had started (its first line)."""
    job.events.refresh()
    first: dict[object, float] = {}
    for e in job.events.events:
        if e["ev"] == "start" and e["world"] == world and float(e["t_script"]) > t0 and e["pid"] not in exclude:  # type: ignore[arg-type]
            first[e["node"]] = min(first.get(e["node"], 1e18), float(e["t_script"]))  # type: ignore[arg-type]
    return max(first.values()) if len(first) == world else None


def _errors(job: Job, node: int | str = "*") -> list[str]:
    """The distinct exception lines in the agents' logs (why a phase did not happen);
    `node` picks one agent's log."""
    seen: list[str] = []
    for log in sorted(job.workdir.glob(f"n{node}.log")):
        for line in log.read_text(errors="replace").splitlines():
            line = line.strip()
            if (("Error:" in line or "error:" in line) and not line.startswith("File ")
                    and f"{log.stem}: {line}" not in seen):
                seen.append(f"{log.stem}: {line[:300]}")
    return seen[-6:]


def _phase(result: dict[str, object], name: str, t0: float, t1: float | None, cap: float,
           spawned: float | None = None, job: Job | None = None,
           labels: tuple[str, str] = ("first step", "workers started"), **extra: object) -> bool:
    """Record a phase: t0 -> first step (`s`) and t0 -> all new workers started (`spawn_s`),
    or whatever two moments `labels` names."""
    spawn_s = None if spawned is None else spawned - t0
    if t1 is None and job is not None:
        extra["errors"] = _errors(job)
        for line in extra["errors"]:  # type: ignore[union-attr]
            print(f"      {line}", flush=True)
    result[name] = {"s": None if t1 is None else t1 - t0, "spawn_s": spawn_s, "cap": cap, **extra}
    status = f"did not complete within {cap:g}s" if t1 is None else f"{t1 - t0:.2f} s"
    print(f"    {name}: {labels[0]} {status}; {labels[1]} {fmt(spawn_s)} s", flush=True)
    return t1 is not None


def run_rdzv(job: Job, n: int, cap: float) -> dict[str, object]:
    result: dict[str, object] = {}
    t0 = time.time()
    for i in range(1, n + 1):
        job.start_node(i)
    starts: set[object] = set()
    deadline = time.monotonic() + cap
    t_all = None
    while time.monotonic() < deadline:
        job.events.refresh()
        round_starts = [e for e in job.events.events if e["ev"] == "start" and e["world"] == n]
        starts = {e["node"] for e in round_starts}
        if len(starts) == n:
            t_all = max(float(e["t_script"]) for e in round_starts)  # type: ignore[arg-type]
            break
        time.sleep(0.05)
    _phase(result, "first_step", t0, job.step_at(n, t0, max(deadline - time.monotonic(), 1.0)), cap,
           spawned=t_all, job=job)
    return result


def run_grow(job: Job, cap: float) -> dict[str, object]:
    result: dict[str, object] = {}
    t0 = time.time()
    job.start_node(1)
    job.start_node(2)
    first = job.events.first(lambda e: e["ev"] == "start", cap)
    result["first_round_world"] = None if first is None else first["world"]
    t1 = job.step_at(2, t0, cap)
    if not _phase(result, "formation", t0, t1, cap, _spawned(job, t0, 2), job,
                  first_round_world=result["first_round_world"]):
        return result
    t0 = time.time()
    job.start_node(3)
    t1 = job.step_at(3, t0, cap)
    if not _phase(result, "scale_up", t0, t1, cap, _spawned(job, t0, 3), job):
        return result
    time.sleep(0.5)
    job.standbys_ready((1, 2, 3), t1, cap)
    job.events.refresh()
    before = {e["pid"] for e in job.events.events}
    t0 = time.time()
    job.crash_file.write_text("crash once")
    crash = job.events.first(lambda e: e["ev"] == "crash", cap)
    t1 = None
    if crash is not None:
        back = job.events.first(lambda e: e["ev"] == "step" and e["pid"] not in before, cap)
        t1 = None if back is None else float(back["t"])  # type: ignore[arg-type]
        t_crash = float(crash["t"])  # type: ignore[arg-type]
        if not _phase(result, "crash", t_crash, t1, cap, _spawned(job, t_crash, 3, before), job,
                      world_after=None if back is None else back["world"]):
            return result
    else:
        _phase(result, "crash", t0, None, cap, None, job, note="no worker claimed the crash file")
        return result
    job.step_at(3, t1, cap)  # stepping again at 3 before the next phase
    time.sleep(0.5)
    t0 = time.time()
    os.kill(job.nodes[3], signal.SIGTERM)
    t1 = job.step_at(2, t0, cap)
    _phase(result, "sigterm", t0, t1, cap, _spawned(job, t0, 2), job)
    return result


def _form(job: Job, result: dict[str, object], cap: float, n: int) -> bool:
    """Start n1..n`n` together and record the phase up to their first step at world `n`."""
    t0 = time.time()
    for i in range(1, n + 1):
        job.start_node(i)
    t1 = job.step_at(n, t0, cap)
    return _phase(result, f"formation_{n}_of_max_{n}", t0, t1, cap, _spawned(job, t0, n), job)


def run_kill(job: Job, cap: float) -> dict[str, object]:
    result: dict[str, object] = {}
    formed = time.time()
    if not _form(job, result, cap, 3):
        return result
    time.sleep(0.5)
    job.standbys_ready((1, 2), formed, cap)
    t0 = time.time()
    kill_tree(job.nodes[3], signal.SIGKILL)
    t1 = job.step_at(2, t0, cap)
    _phase(result, "sigkill", t0, t1, cap, _spawned(job, t0, 2), job,
           assigned_to_init=_assigned_to_init(job, t0, (1, 2)))
    return result


def run_spare(job: Job, cap: float) -> dict[str, object]:
    """--nnodes=3 with a fourth agent waiting: SIGKILL of a participant ->
    the first step at world 3 again, the waiting agent in the dead one's place."""
    return _spare_steps_in(job, cap, spares=(4,), phase="sigkill_spare_in")


def run_dead_spare(job: Job, cap: float) -> dict[str, object]:
    """--nnodes=3 with two agents waiting: the first SIGKILLed, then a participant ->
    the first step at world 3 again, the live spare in the dead participant's place."""
    return _spare_steps_in(job, cap, spares=(4, 5), phase="sigkill_live_spare_in", dead_spare=True)


def _spare_steps_in(job: Job, cap: float, spares: tuple[int, ...], phase: str, dead_spare: bool = False
                    ) -> dict[str, object]:
    result: dict[str, object] = {}
    if not _form(job, result, cap, 3):
        return result
    for i in spares:  # one after the other: the first registered is the first picked
        job.start_node(i)
        time.sleep(SPARE_SETTLE)  # the agent registers and waits
    job.step_at(3, time.time(), cap)  # still stepping at 3 (torchrun may have re-formed)
    time.sleep(0.5)
    if dead_spare:
        kill_tree(job.nodes[spares[0]], signal.SIGKILL)
        time.sleep(DEAD_SPARE_GAP)
    t0 = time.time()
    kill_tree(job.nodes[3], signal.SIGKILL)
    t1 = job.step_at(3, t0 + 0.05, cap)
    _phase(result, phase, t0, t1, cap, _spawned(job, t0, 3), job)
    return result


def run_dead_waiting(job: Job, cap: float) -> dict[str, object]:
    """--nnodes=3: a node dies while it waits for the first round ->
    the first step at world 3 of the three live nodes started after it."""
    result: dict[str, object] = {}
    for i in (1, 2):
        job.start_node(i)
    time.sleep(SPARE_SETTLE)  # both register and wait for a third
    kill_tree(job.nodes[2], signal.SIGKILL)
    time.sleep(DEAD_SPARE_GAP)
    t0 = time.time()
    for i in (3, 4):
        job.start_node(i)
    t1 = job.step_at(3, t0, cap)
    job.events.refresh()
    end = math.inf if t1 is None else t1
    starts = len([e for e in job.events.events if e["ev"] == "start" and t0 < float(e["t_script"]) <= end])  # type: ignore[arg-type]
    _phase(result, "sigkill_waiting_first_round", t0, t1, cap, _spawned(job, t0, 3), job, worker_starts=starts)
    print(f"      workers started until the first step: {starts}", flush=True)
    return result


def _alive(pid: int) -> bool:
    """Whether `pid` still runs; a zombie (exited, an orphan not yet reaped by us) does not."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _runs(pid: int, script: str) -> bool:
    """Whether process `pid` runs `script` (its name is one of its arguments)."""
    try:
        return any(Path(arg.decode()).name == script for arg in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
    except OSError:
        return False


def run_host_kill(job: Job, cap: float) -> dict[str, object]:
    result: dict[str, object] = {}
    if not _form(job, result, cap, 2):
        return result
    time.sleep(0.5)
    agents = {i: p for i in (2,) for p in job.tracker.procs if p.pid == job.nodes[i]}
    # the workers: not elasticrun's warden, which lives as long as its agent
    workers = [pid for i in agents for pid in descendants(job.nodes[i]) if _runs(pid, job.script.name)]
    t0 = time.time()
    kill_tree(job.nodes[1], signal.SIGKILL)
    exited: dict[int, float] = {}
    t_workers = None
    while time.time() < t0 + cap and (len(exited) < len(agents) or t_workers is None):
        for i, p in agents.items():
            if i not in exited and p.poll() is not None:
                exited[i] = time.time()
        if t_workers is None and not any(_alive(pid) for pid in workers):
            t_workers = time.time()
        time.sleep(0.02)
    t1 = max(exited.values()) if len(exited) == len(agents) else None
    codes = {f"n{i}": p.returncode for i, p in agents.items()}
    last_errors = {f"n{i}": (_errors(job, i) or [None])[-1] for i in agents}
    _phase(result, "host_lost", t0, t1, cap, t_workers, job,
           labels=("last surviving agent exited", "their workers gone"),
           exit_codes=codes, exit_s={f"n{i}": t - t0 for i, t in exited.items()}, last_errors=last_errors)
    print(f"      exit codes {codes}", flush=True)
    for line in last_errors.values():
        print(f"      {line}", flush=True)
    return result


def run_head_restart(job: Job, cap: float) -> dict[str, object]:
    """SIGKILL of n1 (the store's host) and a new n1 at the same address
    HEAD_RESTART_DELAY later -> the first step at world 3 after the new agent started."""
    result: dict[str, object] = {}
    if not _form(job, result, cap, 2):
        return result
    time.sleep(0.5)
    survivors = {i: p for i in (2,) for p in job.tracker.procs if p.pid == job.nodes[i]}
    exited: dict[str, float] = {}  # when a survivor's agent exited, should it

    def exit_of(i: int, p: subprocess.Popen[bytes]) -> None:
        p.wait()
        exited[f"n{i}"] = time.time()

    for i, p in survivors.items():
        threading.Thread(target=exit_of, args=(i, p), daemon=True).start()
    t0 = time.time()
    kill_tree(job.nodes[1], signal.SIGKILL)
    time.sleep(HEAD_RESTART_DELAY)
    waiting = [f"n{i}" for i, p in survivors.items() if p.poll() is None]
    restarted = time.time()
    job.start_node(1)
    t1 = job.step_at(2, restarted, cap)
    job.events.refresh()
    after = [e for e in job.events.events if e["ev"] == "step" and float(e["t"]) > restarted]  # type: ignore[arg-type]
    first_after = min(after, key=lambda e: float(e["t"]), default=None)  # type: ignore[arg-type]
    codes = {f"n{i}": p.poll() for i, p in survivors.items()}  # None: still running
    # elasticrun: the rounds the new head ran its workers in, as (number, nodes)
    new_head = (job.workdir / "n1.log").read_text(errors="replace").rsplit("hosting the rendezvous store", 1)[-1]
    rounds = [(int(n), int(k)) for n, k in re.findall(r"-> healthy: round (\d+): node rank \d+/(\d+)", new_head)]
    _phase(result, "head_back", t0, t1, cap, _spawned(job, restarted, 2), job,
           labels=("first step at world 2", "its 2 workers started"),
           from_restart_s=None if t1 is None else t1 - restarted, survivors_at_restart=waiting,
           survivor_exit_codes=codes, survivor_exit_s={n: t - t0 for n, t in exited.items()},
           first_world_after=None if first_after is None else first_after["world"], new_head_rounds=rounds)
    print(f"      survivors running when the new head started: {waiting}; exit codes {codes}, "
          f"after {', '.join(f'{n} {t - t0:.2f} s' for n, t in sorted(exited.items())) or '-'}; "
          f"first step after it at world {None if first_after is None else first_after['world']}; "
          f"the new head's rounds (number, nodes): {rounds}", flush=True)
    return result


def run_host_failover(job: Job, cap: float, sig: signal.Signals = signal.SIGKILL) -> dict[str, object]:
    """SIGKILL of n1 (the store's host, agent and worker) with four nodes stepping ->
    the first step of the three others at world 3; `sig`=SIGTERM: to n1's agent alone."""
    result: dict[str, object] = {}
    if not _form(job, result, cap, 4):
        return result
    time.sleep(0.5)
    survivors = {i: p for i in (2, 3, 4) for p in job.tracker.procs if p.pid == job.nodes[i]}
    t0 = time.time()
    if sig is signal.SIGKILL:
        kill_tree(job.nodes[1], sig)
    else:
        os.kill(job.nodes[1], sig)
    t1 = job.step_at(3, t0, cap)
    codes = {f"n{i}": p.poll() for i, p in survivors.items()}  # None: still running
    _phase(result, "host_sigkill" if sig is signal.SIGKILL else "host_sigterm", t0, t1, cap,
           _spawned(job, t0, 3), job, labels=("first step at world 3", "its 3 workers started"),
           survivor_exit_codes=codes)
    print(f"      survivors' exit codes (None: running) {codes}", flush=True)
    return result


def run_host_preempt(job: Job, cap: float) -> dict[str, object]:
    return run_host_failover(job, cap, signal.SIGTERM)


PHASES = {
    "rdzv-2": ["first_step"],
    "rdzv-4": ["first_step"],
    "rdzv-8": ["first_step"],
    "grow": ["formation", "scale_up", "crash", "sigterm"],
    "kill": ["formation_3_of_max_3", "sigkill"],
    "host-kill": ["formation_2_of_max_2", "host_lost"],
    "head-restart": ["formation_2_of_max_2", "head_back"],
    "host-failover": ["formation_4_of_max_4", "host_sigkill"],
    "host-preempt": ["formation_4_of_max_4", "host_sigterm"],
    "spare": ["formation_3_of_max_3", "sigkill_spare_in"],
    "dead-spare": ["formation_3_of_max_3", "sigkill_live_spare_in"],
    "dead-waiting": ["sigkill_waiting_first_round"],
}
TARGETS = {"grow/formation": "≤ 3 s", "grow/scale_up": "≤ 5 s", "kill/sigkill": "≤ 10 s", "grow/sigterm": "≤ 3 s",
           "grow/crash": "≤ 3 s", "host-kill/host_lost": "store_host_grace (30 s) + ≤ 3 s",
           "host-failover/host_sigkill": "≤ 5 s", "host-preempt/host_sigterm": "≤ 5 s"}
RUNNERS: dict[str, Callable[[Job, float], dict[str, object]]] = {
    "grow": run_grow, "kill": run_kill, "host-kill": run_host_kill, "spare": run_spare, "dead-spare": run_dead_spare,
    "dead-waiting": run_dead_waiting, "head-restart": run_head_restart, "host-failover": run_host_failover,
    "host-preempt": run_host_preempt,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cap", type=float, default=120.0, help="seconds each phase may take")
    ap.add_argument("--only", nargs="*", default=list(PHASES), choices=list(PHASES))
    ap.add_argument("--launchers", nargs="*", default=["elasticrun", "elasticrun-cold", "torchrun", "torchrun-noshare"])
    ap.add_argument("--max-restarts", type=int, default=MAX_RESTARTS, help="passed to every agent (default 3)")
    ap.add_argument("--json", help="write every trial here")
    ap.add_argument("--baseline", default="",
                    help="a checkout of an earlier elasticrun (e.g. from git archive) to run side by side "
                         "as elasticrun-base")
    args = ap.parse_args()
    globals()["MAX_RESTARTS"] = args.max_restarts
    globals()["BASELINE"] = args.baseline
    info, root = start_run("bench_elastic_")
    trials: list[dict[str, object]] = []
    started = time.monotonic()
    for rep in range(args.reps):
        for scenario in args.only:
            launchers = (["elasticrun", "torchrun"] + (["torchrun-noshare"] if scenario == "grow" else [])
                         + (["elasticrun-cold"] if scenario in ("grow", "kill") else []))
            launchers = [x for x in launchers if x in args.launchers] + (["elasticrun-base"] if args.baseline else [])
            if rep % 2:
                launchers.reverse()
            for launcher in launchers:
                nnodes = (scenario.split("-")[1] if scenario.startswith("rdzv")
                          else "3" if scenario in ("spare", "dead-spare", "dead-waiting")
                          else "1:2" if scenario in ("host-kill", "head-restart")
                          else "3:4" if scenario in ("host-failover", "host-preempt") else "1:3")
                job = Job(launcher, nnodes, root / f"rep{rep}-{scenario}-{launcher}")
                print(f"rep {rep} {scenario} {launcher} (load {loadavg()}, {time.monotonic() - started:.0f} s in)",
                      flush=True)
                try:
                    if scenario.startswith("rdzv"):
                        res = run_rdzv(job, int(nnodes), args.cap)
                    else:
                        res = RUNNERS[scenario](job, args.cap)
                finally:
                    job.tracker.stop_all()
                trials.append({"rep": rep, "scenario": scenario, "launcher": launcher, "dir": str(job.workdir),
                               "load": loadavg(), **res})

    print(f"\nall done in {time.monotonic() - started:.0f} s; load {loadavg()}; logs under {root}\n")
    print("Cells: median seconds to the first step at the new world size / to all new workers started "
          "(the script's first line), (runs that got there / runs); for host-kill / host_lost: to the last "
          "surviving agent's exit / to its workers gone.\n")
    base_col = " elasticrun before (--baseline) |" if args.baseline else ""
    print("| scenario / phase | elasticrun | torchrun | torchrun, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
          "| ours / torchrun, first step "
          f"| ours / torchrun, workers started | target | elasticrun --warm-imports=off | warm / cold, first step |"
          f"{base_col}")
    print("|---|---|---|---|---|---|---|---|---|" + ("---|" if args.baseline else ""))
    summary: dict[str, dict[str, object]] = {}
    for scenario in args.only:
        for phase in PHASES[scenario]:
            cells: dict[str, dict[str, object]] = {}
            for launcher in ("elasticrun", "torchrun", "torchrun-noshare", "elasticrun-base", "elasticrun-cold"):
                rs = [t.get(phase) for t in trials if t["scenario"] == scenario and t["launcher"] == launcher]
                runs = sum(1 for t in trials if t["scenario"] == scenario and t["launcher"] == launcher)
                steps = [r["s"] for r in rs if isinstance(r, dict) and r["s"] is not None]  # type: ignore[index]
                spawns = [r["spawn_s"] for r in rs if isinstance(r, dict) and r["spawn_s"] is not None]  # type: ignore[index]
                cells[launcher] = {"step": median(steps), "spawn": median(spawns), "ok": len(steps), "runs": runs,
                                   "steps": steps, "spawns": spawns}
            summary[f"{scenario}/{phase}"] = cells

            # called within this iteration only; `cells` is bound here to say so
            def cell(launcher: str, cells: dict[str, dict[str, object]] = cells) -> str:
                c = cells[launcher]
                return "—" if not c["runs"] else f"{fmt(c['step'])} / {fmt(c['spawn'])} ({c['ok']}/{c['runs']})"  # type: ignore[arg-type]

            e, t = cells["elasticrun"], cells["torchrun"]
            print(f"| {scenario} / {phase} | {cell('elasticrun')} | {cell('torchrun')} | {cell('torchrun-noshare')} | "
                  f"{ratio(e['step'], t['step'])} | {ratio(e['spawn'], t['spawn'])} | "  # type: ignore[arg-type]
                  f"{TARGETS.get(f'{scenario}/{phase}', '')} | {cell('elasticrun-cold')} | "
                  f"{ratio(e['step'], cells['elasticrun-cold']['step'])} |"  # type: ignore[arg-type]
                  + (f" {cell('elasticrun-base')} |" if args.baseline else ""))
    for launcher in ("elasticrun", "elasticrun-cold"):
        waits = [t["sigkill"]["assigned_to_init"] for t in trials  # type: ignore[index]
                 if t["launcher"] == launcher and isinstance(t.get("sigkill"), dict)
                 and t["sigkill"].get("assigned_to_init") is not None]  # type: ignore[union-attr]
        if waits:
            print(f"kill / sigkill, {launcher}: the new round opened -> the survivors' gloo groups up, "
                  f"median {fmt(median(waits))} s over {len(waits)} runs")
    # the workers' own start-up (script start -> gloo group up), the same script under both
    inits = []
    for t in trials:
        evs = Events(Path(str(t["dir"])) / "events")
        evs.refresh()
        start = {e["pid"]: float(e["t_script"]) for e in evs.events if e["ev"] == "start"}  # type: ignore[arg-type]
        inits += [float(e["t"]) - start[e["pid"]] for e in evs.events if e["ev"] == "init" and e["pid"] in start]  # type: ignore[arg-type]
    print(f"\nworker start-up (script start -> gloo group up, import torch included), all trials: "
          f"median {fmt(median(inits))} s over {len(inits)} workers")
    write_json(args.json, {"machine": info, "trials": trials, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
