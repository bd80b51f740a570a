"""Step timing: what it costs a step, and how many steps a straggler takes to name.

    python bench/bench_steptime.py overhead     # ~1 minute: the cost on a 50 ms step
    python bench/bench_steptime.py detect       # ~6 minutes: real agents, a 1.5x and a 3x node
    python bench/bench_steptime.py ddp          # ~3 minutes: DDP and FSDP2, cost and time to name

`overhead`, in this process, with torch and a gloo group of one, with the recorder of
`elasticrun.worker.steptime` installed as the worker boot installs it:

- the hot path, timed over many calls: a step mark (what every optimizer step costs),
  and a wrapped `all_reduce` against the original function (`__wrapped__`);
- the writer thread: one summary taken and its file written, which happens at most twice
  a second;
- the whole, A/B: a 50 ms step (busy compute, then 10 small all_reduces and an optimizer
  step) with the wrapped calls and the hook against the same loop on the originals and
  no step mark, alternating rounds; the ratio of the medians.

`detect`: three real agents on 127.0.0.x with a store, each running the plain gloo
script of the tests (tests/workers/straggler_worker.py: a sleep as the step's compute,
then all_reduce and an optimizer step), one node slower by a factor; the steps the job
made, and the seconds since its first step, when the leader logs the node a straggler.
With the default settings (`straggler_interval=5`, `straggler_after=3`) and with the
tests' (1 s, 2).

`ddp`: first, in this process (a gloo group of one), a DDP module's forward and backward
with the timed hook against the same on a module DDP made before the hook was installed
(its built-in all-reduce), alternating rounds; then the plain DDP (and FSDP2) script of
the tests (tests/workers/ddp_worker.py: real compute, the gradients reduced by DDP's hook
or FSDP2's collectives), two ranks on gloo: the seconds a run of its steps takes with the
step timing (the worker boot, DDP's hook wrapped) against the same run without it,
alternating; then three real agents with one node computing three times as much a step,
and the steps and seconds until the leader names it (the tests' settings). Nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from common import ProcessTracker, become_subreaper, free_port, machine  # noqa: E402

WORKER = REPO / "tests" / "workers" / "straggler_worker.py"
DDP_WORKER = REPO / "tests" / "workers" / "ddp_worker.py"
STEP = 0.050  # the step's compute, seconds
COLLECTIVES = 10  # all_reduces per step


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def per_call(fn, n: int, repeats: int = 7) -> float:  # type: ignore[no-untyped-def]
    """Median seconds per call of fn() over `repeats` runs of `n` calls."""
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - start) / n)
    return statistics.median(runs)


def overhead(rounds: int, steps: int) -> None:
    from elasticrun.worker import steptime

    folder = Path(tempfile.mkdtemp(prefix="bench_steptime_"))
    steptime.install(str(folder / "rank_0.json"))
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{folder / 'store'}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    assert getattr(dist.all_reduce, "_elasticrun_timed", False), "the boot's install did not wrap all_reduce"
    recorder = steptime._recorder
    assert recorder is not None
    tensor = torch.zeros(256)
    timed, original = dist.all_reduce, dist.all_reduce.__wrapped__  # type: ignore[attr-defined]

    def nothing() -> None:
        pass

    wrapped_nothing = steptime._timed(nothing, "nothing", torch.compiler.is_compiling)
    mark = per_call(lambda: steptime.mark("optimizer"), 200_000)
    wrapper = per_call(wrapped_nothing, 200_000) - per_call(nothing, 200_000)
    call_timed = per_call(lambda: timed(tensor), 5_000)
    call_plain = per_call(lambda: original(tensor), 5_000)
    summary = per_call(lambda: steptime._write(recorder.path, recorder.summary(time.time())), 2_000)
    added = mark + COLLECTIVES * wrapper
    print(f"step mark: {mark * 1e6:.2f} us; the wrapper around a call: {wrapper * 1e6:.2f} us; "
          f"all_reduce of 256 floats (world 1): {call_plain * 1e6:.1f} us plain, {call_timed * 1e6:.1f} us wrapped")
    print(f"writer: one summary and file write {summary * 1e6:.0f} us, at most twice a second: "
          f"{summary * 2 * 100:.4f}% of a core")
    print(f"hot path per {STEP * 1000:.0f} ms step with {COLLECTIVES} collectives: {added * 1e6:.1f} us = "
          f"{added / STEP * 100:.4f}% of the step")

    leader_cost(1000)

    weight = torch.nn.Parameter(torch.zeros(256))
    optimizer = torch.optim.SGD([weight], lr=0.01)
    weight.grad = torch.zeros(256)

    def loop(collective, with_marks: bool) -> list[float]:  # type: ignore[no-untyped-def]
        if not with_marks:
            recorder.mark = lambda source: None  # type: ignore[method-assign] # the hook's mark does nothing
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            busy(STEP)
            for _ in range(COLLECTIVES):
                collective(tensor)
            optimizer.step()
            times.append(time.perf_counter() - start)
        vars(recorder).pop("mark", None)
        return times

    on: list[float] = []
    off: list[float] = []
    for _ in range(rounds):
        off += loop(original, with_marks=False)
        on += loop(timed, with_marks=True)
    for what, pick in (("median", statistics.median), ("fastest", min)):
        a, b = pick(off), pick(on)
        print(f"A/B, {rounds} alternating rounds of {steps} steps: {what} step {a * 1000:.3f} ms untimed, "
              f"{b * 1000:.3f} ms timed: ratio {b / a:.4f}")
    dist.destroy_process_group()


def leader_cost(nodes: int) -> None:
    """What one evaluation costs the leader at `nodes` nodes: decoding their reports (one
    read of c/steps/) and judging them."""
    from elasticrun.rendezvous.codec import decode, encode
    from elasticrun.rendezvous.records import StepReport
    from elasticrun.rendezvous.rounds import Participant, Round
    from elasticrun.rendezvous.settings import RendezvousSettings
    from elasticrun.rendezvous.stragglers import Judgement, judge

    names = [f"host{i:05d}_1234" for i in range(nodes)]
    current = Round(number=1, participants=tuple(Participant(n, "10.0.0.1", 8) for n in names), restart_count=0,
                    reason="", opened_at=0.0)
    settings = RendezvousSettings(run_id="job", min_nodes=1, max_nodes=nodes)
    judged, times, size = Judgement(), [], 0
    for evaluation in range(10):
        raw = [encode(StepReport(node_id=n, round=1, steps=10 + 10 * evaluation, compute=0.2 + i % 13 * 0.001,
                                 wall=0.3, rank=8 * i, source="optimizer", at=time.time()))
               for i, n in enumerate(names)]
        size = sum(map(len, raw))
        start = time.perf_counter()
        reports = {r.node_id: r for r in (decode(StepReport, b) for b in raw)}
        judged = judge(judged, current, reports, settings, time.time())
        times.append(time.perf_counter() - start)
    print(f"leader: one evaluation of {nodes} nodes' reports ({size / 1000:.0f} kB read): decode and judge "
          f"{statistics.median(times) * 1000:.1f} ms (median of 10)")


def ddp_hook_cost(rounds: int, steps: int) -> None:
    """One process, a gloo group of one: a DDP step with the timed hook against the same step
    on a DDP module made before the hook was installed (DDP's built-in all-reduce), alternating."""
    from elasticrun.worker import steptime

    folder = Path(tempfile.mkdtemp(prefix="bench_ddp_hook_"))
    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo", init_method=f"file://{folder / 'store'}", rank=0, world_size=1)

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    plain = nn.parallel.DistributedDataParallel(mlp())  # before the install: DDP's own all-reduce
    steptime.install(str(folder / "rank_0.json"))
    steptime.install_torch(torch)
    timed = nn.parallel.DistributedDataParallel(mlp())
    x, y = torch.randn(1024, 256), torch.randint(0, 10, (1024,))

    def loop(model: nn.Module) -> list[float]:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            nn.functional.cross_entropy(model(x), y).backward()
            times.append(time.perf_counter() - start)
        return times

    loop(plain), loop(timed)  # warm-up: the first forward registers the hook
    off: list[float] = []
    on: list[float] = []
    for _ in range(rounds):
        off += loop(plain)
        on += loop(timed)
    a, b = statistics.median(off), statistics.median(on)
    print(f"DDP hook, one process, {rounds} alternating rounds of {steps} steps: median forward+backward "
          f"{a * 1000:.3f} ms built-in, {b * 1000:.3f} ms timed hook: ratio {b / a:.4f} "
          f"({(b - a) * 1e6:+.0f} us a step)", flush=True)
    dist.destroy_process_group()


def ddp_cost(fsdp: bool, rounds: int, steps: int) -> None:
    """Seconds for `steps` steps of the DDP (FSDP2) script on two ranks, timed and untimed, alternating."""
    import subprocess

    from elasticrun.agent.boot import boot_env

    folder = Path(tempfile.mkdtemp(prefix="bench_ddp_"))
    results: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for timed in (False, True):
            port, procs = free_port(), []
            for rank in (0, 1):
                env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICRUN_", "PYTHONPATH"))}
                env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                           GLOO_SOCKET_IFNAME="lo")
                if timed:
                    env.update(boot_env(env), ELASTICRUN_STEPS_FILE=str(folder / f"rank_{rank}.json"))
                argv = [sys.executable, str(DDP_WORKER), "--steps", str(steps), *(["--fsdp"] if fsdp else [])]
                procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
            starts, ends = [], []
            for proc in procs:
                first = last = None
                for line in proc.stdout or ():
                    if line.startswith("step="):
                        last = time.perf_counter()
                        first = first or last
                proc.wait()
                starts.append(first)
                ends.append(last)
            results[timed].append(max(ends) - min(starts))  # type: ignore[type-var,operator]
    off, on = statistics.median(results[False]), statistics.median(results[True])
    print(f"{'FSDP2' if fsdp else 'DDP'}: {steps - 1} steps on 2 ranks, median of {rounds}: {off:.3f} s untimed, "
          f"{on:.3f} s timed: ratio {on / off:.4f} ({(on - off) / (steps - 1) * 1e3:+.2f} ms a step of "
          f"{off / (steps - 1) * 1e3:.0f} ms)", flush=True)


def detect(factor: float, conf: str, step_time: float, nodes: int, log_dir: Path,
           worker: tuple[str, ...] = ()) -> tuple[int, float]:
    """Steps and seconds from the job's first step until the leader names the slow node.

    `worker`: another script and its arguments (it takes --slow-dir), instead of the
    straggler worker slowed by `factor`."""
    tracker = ProcessTracker()
    try:
        port = free_port()
        store = tracker.start(
            [sys.executable, "-m", "elasticrun", "store", "serve", "--host", "127.0.0.1", "--port", str(port)],
            log=log_dir / "store.log",
        )
        del store
        slow_dir = log_dir / "slow"
        slow_dir.mkdir(exist_ok=True)
        run = f"bench-{os.getpid()}-{factor}-{int(time.time())}"
        logs = []
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", LOGLEVEL="INFO")
        for i in range(nodes):
            log = log_dir / f"{run}-{i}.log"
            logs.append(log)
            agent = tracker.start(
                [sys.executable, "-m", "elasticrun", f"--nnodes={nodes}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run}",
                 f"--rdzv-conf=is_host=false,last_call_timeout=0.5{conf}", f"--local-addr=127.0.0.{i + 2}",
                 f"--log-dir={log_dir / 'agents'}",
                 *(worker or (str(WORKER), "--step-time", str(step_time), "--slow-factor", str(factor))),
                 "--slow-dir", str(slow_dir)],
                env=env, log=log,
            )
            if i == nodes - 1:
                (slow_dir / f"{socket.gethostname()}_{agent.pid}").touch()
        first = None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            texts = [log.read_text(errors="replace") if log.exists() else "" for log in logs]
            if first is None and any(re.search(r"step=[01] rank=", t) for t in texts):
                first = time.monotonic()
            for text in texts:
                named = re.search(r"node \S+ is a straggler", text)
                if named and first is not None:
                    steps = max(int(m) for t in texts for m in re.findall(r"step=(\d+) rank=", t[: named.start()]
                                                                          if t is text else t))
                    return steps, time.monotonic() - first
            time.sleep(0.1)
        raise RuntimeError(f"no straggler named in 300 s; see {log_dir}")
    finally:
        tracker.stop_all()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["overhead", "detect", "ddp"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-time", type=float, default=0.2, help="detect: each step's compute on a normal node")
    p.add_argument("--nodes", type=int, default=3)
    args = p.parse_args()
    print(machine())
    if args.what == "overhead":
        overhead(args.rounds, args.steps)
        return
    become_subreaper()
    log_dir = Path(tempfile.mkdtemp(prefix="bench_straggler_"))
    if args.what == "ddp":
        ddp_hook_cost(args.rounds * 4, args.steps)
        for fsdp in (False, True):
            ddp_cost(fsdp, args.rounds, args.steps)
        tests = ",straggler_interval=1,straggler_after=2"
        for fsdp in (False, True):
            steps, seconds = detect(3.0, tests, 0.0, args.nodes, log_dir,
                                    (str(DDP_WORKER), *(["--fsdp"] if fsdp else [])))
            print(f"{'FSDP2' if fsdp else 'DDP'}, the tests' settings (interval 1 s, after 2): a node computing 3x "
                  f"named after {steps} steps, {seconds:.1f} s after the first step ({args.nodes} nodes)", flush=True)
        return
    for name, conf in (("default (interval 5 s, after 3)", ""),
                       ("the tests' (interval 1 s, after 2)", ",straggler_interval=1,straggler_after=2")):
        for factor in (1.5, 3.0):
            steps, seconds = detect(factor, conf, args.step_time, args.nodes, log_dir)
            print(f"{name}: {factor}x named after {steps} steps, {seconds:.1f} s after the first step "
                  f"({args.nodes} nodes, {args.step_time:g} s of compute a step on the others)", flush=True)


if __name__ == "__main__":
    main()
