"""The GPU paths of elasticrun, run on a real GPU: one table, in under 11 minutes.

    python bench/gpu_check.py                      # every row (a machine with one NVIDIA GPU)
    python bench/gpu_check.py --rows reclaim,inprocess
    python bench/gpu_check.py --dry-run            # the rows and their bounds; runs nothing
    python bench/gpu_check.py --json out.json      # the table as JSON too

Everything else in the suite fakes NVML and runs on CPUs; these rows run the real
launcher (`python -m elasticrun --standalone`) on the GPU:

  nproc-gpu    --nproc-per-node=gpu through real NVML: one worker per GPU, each seeing
               its GPU (CUDA_VISIBLE_DEVICES)
  health       the NVML health check of every GPU (timed), and --health-check on the
               GPU node: a GPU query that passes, a check that fails and keeps the node out
  reclaim      a CUDA worker holding several GiB is SIGKILLed: how long until NVML no
               longer lists it, and until the next worker runs (the agent waits for the
               memory; `waiting up to 60s ...` in its log when it had to)
  inprocess    a world-size-1 nccl group aborted (ProcessGroup.abort, ncclCommAbort, as
               the wrapper does when a peer is lost; here the rank calls it, a job of one
               rank having no peer to lose) and re-formed in the same process by the
               in-process wrapper: the time from the abort to the first step in the new group
  lightning    examples/lightning on the GPU: its worker SIGKILLed mid-run, restarted,
               resumed from its checkpoint, to the end
  state        a restart-mode elastic.State of 1 GiB on the GPU (a 512 MB model and its
               momentum): a step with commit() against one without (the copy runs on a
               side stream into pinned host memory); the worker SIGKILLed right after a
               commit, restored exactly from host memory, timed against torch.load
  waits        a plain DDP script on nccl under the worker boot: its steps timed from
               the optimizer, its all-reduce waits from CUDA events
  standby      a warm standby on the GPU node (--warm-imports, the default): NVML shows
               no CUDA context of its own; after the worker's SIGKILL it is the next
               worker; the time to the next worker's first GPU work, warm against cold

Each row is bounded (BOUNDS, under 11 minutes in all), runs whatever it started in the
driver's own process tree and kills it all at its end (bench.common.ProcessTracker),
and its failure (or an exception) does not stop the rows after it. A row prints its
line as it ends; the table comes last, then where the logs are. Exit status 0 when no
row failed. Without a GPU (no NVML, no driver) a row that needs one is skipped; the
others run their CPU variant (gloo, memory in RAM): that is what tests/test_gpu_check.py
runs in the suite. The rows whose workers use torch on the GPU need a CUDA build of
torch: with a CPU build they fail at once, saying so.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PYTHON, REPO, WORKERS, ProcessTracker, base_env, become_subreaper, descendants  # noqa: E402

#: each row's bound in seconds: 625 in all, so the table is out within 11 minutes
#: (plus at most 20 s to ask torch what it is, and a few to kill what a row left)
BOUNDS = {"nproc-gpu": 35.0, "health": 45.0, "reclaim": 100.0, "inprocess": 90.0, "lightning": 140.0,
          "state": 100.0, "waits": 45.0, "standby": 70.0}
#: what the reclaim row's worker holds: this much, or half the GPU's free memory if less
HOLD_GIB = 8.0
LIGHTNING = REPO / "examples" / "lightning" / "train.py"


@dataclass(frozen=True)
class Row:
    """One row of the table: ok, failed or skipped, with its figure (or why)."""

    name: str
    status: str
    figure: str
    seconds: float = 0.0


class RowFailed(Exception):
    """The row's check did not hold: the message is its figure."""


class Skipped(Exception):
    """The row cannot run here: the message says why."""


@dataclass(frozen=True)
class Gpu:
    """The machine's GPUs as NVML shows them (count 0: none), and the torch the rows use."""

    count: int
    name: str = ""
    note: str = ""  # why there is none
    #: python, torch, CUDA and driver versions, as the table's first line shows them
    software: str = ""
    #: whether that torch can use the GPU (a CPU build of torch cannot)
    torch_cuda: bool = False


class Context:
    """What one row gets: the GPU, its folder, its deadline, its processes."""

    def __init__(self, gpu: Gpu, folder: Path, deadline: float) -> None:
        self.gpu = gpu
        self.folder = folder
        self.deadline = deadline
        self.tracker = ProcessTracker()

    @property
    def cuda(self) -> bool:
        return self.gpu.count > 0

    def need_torch_cuda(self) -> None:
        """A row whose worker uses torch on the GPU: torch must be a CUDA build."""
        if self.cuda and not self.gpu.torch_cuda:
            raise RowFailed(f"NVML sees {self.gpu.name}, but this torch cannot use it ({self.gpu.software}): "
                            "install a CUDA build of torch")

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RowFailed("out of time (the row's bound)")
        return left

    def launch(
        self, name: str, flags: list[str], command: list[str], **env: str
    ) -> tuple[subprocess.Popen[bytes], Path]:
        """`python -m elasticrun --standalone FLAGS COMMAND`, its output in <folder>/<name>.log."""
        log = self.folder / f"{name}.log"
        argv = [PYTHON, "-m", "elasticrun", "--standalone", f"--log-dir={self.folder / 'logs'}", *flags, *command]
        return self.tracker.start(argv, env=base_env(**env), log=log, cwd=self.folder), log

    def wait_exit(self, proc: subprocess.Popen[bytes], log: Path) -> int:
        try:
            return proc.wait(self.left())
        except subprocess.TimeoutExpired:
            raise RowFailed(f"still running at the row's bound; its last line: {last_line(log)}") from None

    def succeeded(self, proc: subprocess.Popen[bytes], log: Path) -> str:
        """The job's log once it exited 0; RowFailed with its last line if it did not."""
        code = self.wait_exit(proc, log)
        if code != 0:
            raise RowFailed(f"exit {code}: {last_line(log)}")
        return read(log)

    def wait_for(self, log: Path, pattern: str, proc: subprocess.Popen[bytes] | None = None) -> re.Match[str]:
        """The first match of `pattern` in the log, polled until the row's deadline."""
        regex = re.compile(pattern, re.M)
        while True:
            found = regex.search(read(log))
            if found:
                return found
            if proc is not None and proc.poll() is not None:
                raise RowFailed(f"exited with {proc.returncode} before /{pattern}/; its last line: {last_line(log)}")
            if time.monotonic() > self.deadline:
                raise RowFailed(f"no /{pattern}/ within the row's bound; its last line: {last_line(log)}")
            time.sleep(0.02)


def read(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


def last_line(log: Path) -> str:
    lines = [ln for ln in read(log).splitlines() if ln.strip()]
    return lines[-1][-300:] if lines else "(no output)"


def write_worker(ctx: Context, name: str, code: str) -> Path:
    path = ctx.folder / name
    path.write_text(code)
    return path


# --- the rows ------------------------------------------------------------------------------

NPROC_WORKER = """
import os
print(f"worker local rank {os.environ['LOCAL_RANK']} of {os.environ['LOCAL_WORLD_SIZE']}: "
      f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
"""


def row_nproc_gpu(ctx: Context) -> str:
    """--nproc-per-node=gpu: one worker per GPU that NVML counts."""
    if not ctx.cuda:
        raise Skipped(f"no GPU ({ctx.gpu.note})")
    worker = write_worker(ctx, "nproc_worker.py", NPROC_WORKER)
    proc, log = ctx.launch("nproc-gpu", ["--nproc-per-node=gpu"], [str(worker)])
    text = ctx.succeeded(proc, log)
    seen = sorted(set(re.findall(r"worker local rank (\d+) of (\d+): CUDA_VISIBLE_DEVICES=(\S+)", text)))
    if len(seen) != ctx.gpu.count or any(int(size) != ctx.gpu.count for _, size, _ in seen):
        raise RowFailed(f"{len(seen)} worker(s) for {ctx.gpu.count} GPU(s): {seen}")
    devices = ",".join(sorted({v for _, _, v in seen}))
    return f"{len(seen)} worker(s) for {ctx.gpu.count} GPU(s) ({ctx.gpu.name}); CUDA_VISIBLE_DEVICES={devices}"


#: the check a GPU node runs: the GPU answers NVML and is not too hot (pynvml is a dependency)
GPU_QUERY = (
    f"{PYTHON} -c \"import pynvml as n; n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0); "
    "t = n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU); "
    "print(n.nvmlDeviceGetName(h), t, 'C'); raise SystemExit(t >= 90)\""
)


def row_health(ctx: Context) -> str:
    """The NVML health check, timed; --health-check passing on the node, and failing."""
    parts = []
    if ctx.cuda:
        from elasticrun.agent.gpu import open_gpus

        gpus = open_gpus()
        try:
            started = time.perf_counter()
            health = gpus.check(range(gpus.count))
            took = time.perf_counter() - started
        finally:
            gpus.close()
        if not health.ok:
            raise RowFailed(f"NVML: {health.reason}")
        parts.append(f"NVML check {took * 1000:.1f} ms ({health.reason})")
    check = GPU_QUERY if ctx.cuda else "echo cpu node: nothing to query"
    worker = write_worker(ctx, "health_worker.py", "import time\ntime.sleep(2)\n")
    proc, log = ctx.launch("health-pass", ["--nproc-per-node=1", f"--health-check={check}", "--health-interval=0.5"],
                           [str(worker)])
    code = ctx.wait_exit(proc, log)
    passed = re.search(r"health check passed in (\S+): (.*)$", read(log), re.M)
    if code != 0 or passed is None:
        raise RowFailed(f"a passing --health-check: exit {code}: {last_line(log)}")
    parts.append(f"--health-check passed in {passed.group(1)} ({passed.group(2)!r})")
    proc, log = ctx.launch("health-fail", ["--nproc-per-node=1", "--health-check=echo 'GPU 0 too hot'; exit 1"],
                           [str(worker)])
    code = ctx.wait_exit(proc, log)
    if code != 200 or "this node does not join: health check failed (exit code 1): GPU 0 too hot" not in read(log):
        raise RowFailed(f"a failing --health-check: exit {code}: {last_line(log)}")
    parts.append("a failing one kept the node out (exit 200)")
    return "; ".join(parts)


def nvml() -> Any:
    """pynvml, initialised (NVML counts its inits: one more is harmless)."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml


def nvml_holding(pid: int) -> int | None:
    """Bytes NVML says `pid` holds on GPU 0 (0: unknown amount), None when not listed."""
    pynvml = nvml()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if p.pid == pid:
            return int(p.usedGpuMemory or 0)
    return None


def row_reclaim(ctx: Context) -> str:
    """A worker holding GPU memory SIGKILLed: memory freed, then the next worker runs."""
    ctx.need_torch_cuda()
    gib = 0.5
    if ctx.cuda:
        pynvml = nvml()
        free = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).free
        gib = min(HOLD_GIB, free / 2**30 / 2)
    proc, log = ctx.launch("reclaim", ["--nproc-per-node=1", "--max-restarts=1"],
                           [str(WORKERS / "gpu_hold.py"), "--gib", f"{gib:.2f}"])
    pid = int(ctx.wait_for(log, r"holding \S+ GiB on \S+, pid (\d+)$", proc).group(1))
    listed = nvml_holding(pid) if ctx.cuda else None
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    freed_after = None
    if listed is not None:
        while nvml_holding(pid) is not None:
            ctx.left()
            time.sleep(0.01)
        freed_after = time.time() - killed
    next_at = float(ctx.wait_for(log, r"next worker started at (\S+)", proc).group(1))
    text = ctx.succeeded(proc, log)
    waited = re.search(r"waiting up to \S+ for the previous workers' GPU memory", text) is not None
    runs = f"the next worker ran {next_at - killed:.2f} s after the kill"
    if not ctx.cuda:
        return f"{gib:.1f} GiB in RAM (no GPU: nothing to reclaim); {runs}"
    if listed is None:
        raise RowFailed(f"NVML never listed the worker (pid {pid}; another PID namespace?); {runs}")
    assert freed_after is not None
    if next_at < killed + freed_after - 0.05:
        raise RowFailed(f"the next worker ran {next_at - killed:.2f} s after the kill, before NVML freed its "
                        f"memory ({freed_after:.2f} s)")
    free = re.search(r"next worker sees (.*)$", text, re.M)
    return (f"{listed / 2**30:.1f} GiB held by pid {pid}: freed {freed_after:.2f} s after SIGKILL; {runs} "
            f"(the agent {'waited for it' if waited else 'found it free'}); "
            f"{free.group(1) if free else 'free memory not reported'}")


def row_inprocess(ctx: Context) -> str:
    """A world-size-1 group aborted and re-formed in place by the in-process wrapper."""
    ctx.need_torch_cuda()
    proc, log = ctx.launch("inprocess", ["--elastic-mode=in-process", "--nproc-per-node=1", "--max-restarts=1"],
                           [str(WORKERS / "gpu_inprocess.py"), "--steps", "30", "--abort-at", "10"])
    text = ctx.succeeded(proc, log)
    starts = re.findall(r"restart (\d+) starts at step (\d+), pid (\d+), backend (\w+)", text)
    aborted = re.search(r"aborting the group at step (\d+), at (\S+)", text)
    after = re.search(r"step (\d+) done at (\S+)", text)
    done = re.search(r"done at step (\d+), pid (\d+)", text)
    if len(starts) != 2 or aborted is None or after is None or done is None:
        raise RowFailed(f"not the expected run (2 rounds, an abort, the end): {last_line(log)}")
    pids = {pid for _, _, pid, _ in starts} | {done.group(2)}
    backend = starts[0][3]
    if len(pids) != 1 or (backend != "nccl") == ctx.cuda:
        raise RowFailed(f"pids {sorted(pids)}, backend {backend}: not one process on the expected backend")
    took = float(after.group(2)) - float(aborted.group(2))
    broken = "broken (an exception stands in for nccl's abort)"
    returned = re.search(r"abort returned at (\S+)", text)
    if returned is not None:
        broken = f"aborted (abort() took {float(returned.group(1)) - float(aborted.group(2)):.2f} s)"
    return (f"{backend} group {broken} at step {aborted.group(1)}, re-formed from commit {starts[1][1]} in the "
            f"same process (pid {done.group(2)}): first step {took:.2f} s after the abort; "
            f"done at step {done.group(1)}")


def row_lightning(ctx: Context) -> str:
    """examples/lightning on the GPU: killed mid-run, resumed from its checkpoint."""
    ctx.need_torch_cuda()
    if importlib.util.find_spec("pytorch_lightning") is None:
        raise Skipped("pytorch-lightning is not installed (pip install -e '.[test]')")
    nproc = "gpu" if ctx.cuda else "1"
    started = time.monotonic()
    proc, log = ctx.launch(
        "lightning", [f"--nproc-per-node={nproc}", "--max-restarts=1"],
        [str(LIGHTNING), "--max-steps", "40", "--checkpoint-every", "10", "--step-time", "0.05",
         "--checkpoint-dir", str(ctx.folder / "lightning-ckpt")],
    )
    ctx.wait_for(log, r"Step #25 ", proc)
    workers = [p for p in descendants(proc.pid) if str(LIGHTNING) in cmdline(p)]
    if not workers:
        raise RowFailed("no worker process of the example found to kill")
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    resumed = ctx.wait_for(log, r"start at step (\d+): world size (\d+), restart count 1", proc)
    text = ctx.succeeded(proc, log)
    done = re.search(r"done at step (\d+)", text)
    if done is None:
        raise RowFailed(f"no end of the run: {last_line(log)}")
    used = re.search(r"GPU available: (\w+) \((\w+)\), used: (\w+)", text)
    on_gpu = used is not None and used.group(3) == "True"
    if on_gpu != ctx.cuda:
        raise RowFailed(f"Lightning says {used.group(0) if used else 'nothing about GPUs'}")
    where = "on the GPU (cuda)" if on_gpu else "on CPU (gloo)"
    return (f"{done.group(1)} steps {where}; worker SIGKILLed after step 25, resumed from step {resumed.group(1)}; "
            f"{time.monotonic() - started:.0f} s in all")


def row_state(ctx: Context) -> str:
    """Restart-mode state on the GPU: a commit's cost per step, a SIGKILL, the restore against torch.load."""
    ctx.need_torch_cuda()
    mb, step_ms, memory = (512, 100, "5G") if ctx.cuda else (8, 20, "96M")  # room for four copies
    proc, log = ctx.launch(
        "state", ["--nproc-per-node=1", "--max-restarts=1", f"--state-memory={memory}"],
        [str(WORKERS / "gpu_state.py"), "--mb", str(mb), "--step-ms", str(step_ms), "--disk-dir", str(ctx.folder)],
    )
    text = ctx.succeeded(proc, log)
    size = re.search(r"state (\d+) MB on (\S+), a step (\S+) ms \(batch (\d+)\)", text)
    steps = re.search(r"steps without a commit (\S+) ms, with commit\(\) (\S+) ms", text)
    committed = dict(re.findall(r"committed step (\d+) checksum (-?\d+)", text))
    restored = re.search(r"restored=(\w+) from=([\w ]+) step=(\d+) checksum=(-?\d+) in (\S+) s", text)
    loaded = re.search(r"torch.load of the same state (\S+) s", text)
    if size is None or steps is None or restored is None or loaded is None or len(committed) != 2:
        raise RowFailed(f"not the expected run (timings, 2 commits, a restore): {last_line(log)}")
    ok, source, step, digest, took = restored.groups()
    if ok != "True" or source != "own memory" or committed.get(step) != digest:
        raise RowFailed(f"restored={ok} from {source} at step {step} (checksum {digest}); committed {committed}")
    bare, with_commit = float(steps.group(1)), float(steps.group(2))
    return (f"{size.group(1)} MB state on {size.group(2)}: a step {bare:.1f} ms, with commit() each step "
            f"{with_commit:.1f} ms ({(with_commit - bare) / bare:+.1%}); SIGKILLed after commit "
            f"{max(map(int, committed))}: restored commit {step} exactly from {source} in {float(took):.3f} s, "
            f"torch.load of the same state {float(loaded.group(1)):.3f} s "
            f"({float(took) / float(loaded.group(1)):.2f})")


def row_waits(ctx: Context) -> str:
    """A plain DDP script on nccl: the boot times its steps and its all-reduce waits with CUDA events."""
    ctx.need_torch_cuda()
    proc, log = ctx.launch("waits", ["--nproc-per-node=1"], [str(WORKERS / "gpu_ddp.py"), "--steps", "60"])
    text = ctx.succeeded(proc, log)
    found = re.search(r"steps file: (.*)$", text, re.M)
    if found is None:
        raise RowFailed(f"no steps file's summary: {last_line(log)}")
    summary = json.loads(found.group(1))
    if summary.get("source") != "optimizer" or summary.get("steps", 0) < 50 or "step timing is off" in text:
        raise RowFailed(f"the boot did not time the optimizer's steps: {summary}")
    compute, wall = summary["compute"], summary["wall"]
    if not 0 < compute <= wall:
        raise RowFailed(f"compute {compute} s of a {wall} s step")
    backend = "nccl, CUDA events" if ctx.cuda else "gloo"
    return (f"{summary['steps']} DDP steps timed from the optimizer ({backend}): a step {wall * 1e3:.1f} ms, "
            f"compute {compute * 1e3:.1f} ms, waits {(wall - compute) * 1e3:.1f} ms")


def row_standby(ctx: Context) -> str:
    """A warm standby on a GPU node: no CUDA context of its own; after a SIGKILL it is the next worker."""
    ctx.need_torch_cuda()
    took = {}
    for mode in ("warm", "cold"):
        flags = ["--nproc-per-node=1", "--max-restarts=1", *([] if mode == "warm" else ["--warm-imports=off"])]
        proc, log = ctx.launch(f"standby-{mode}", flags, [str(WORKERS / "gpu_hold.py"), "--gib", "1"],
                               LOGLEVEL="INFO")
        pid = int(ctx.wait_for(log, r"holding \S+ GiB on \S+, pid (\d+)$", proc).group(1))
        standby = None
        if mode == "warm":
            standby = int(ctx.wait_for(log, r"standby workers ready \(local rank: pid 0: (\d+)\)", proc).group(1))
            if ctx.cuda and nvml_holding(standby) is not None:
                raise RowFailed(f"NVML lists the standby (pid {standby}): it made a CUDA context before its round")
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        started = ctx.wait_for(log, r"next worker started at \S+ \(pid (\d+)\)", proc)
        done = float(ctx.wait_for(log, r"next worker's first work on \S+ done at (\S+)", proc).group(1))
        ctx.succeeded(proc, log)
        if standby is not None and int(started.group(1)) != standby:
            raise RowFailed(f"the next worker (pid {started.group(1)}) was not the standby (pid {standby})")
        took[mode] = done - killed
    where = "its GPU" if ctx.cuda else "the CPU"
    context = "no CUDA context in the standby (NVML); " if ctx.cuda else ""
    return (f"{context}SIGKILL to the next worker's first work on {where}: warm (the standby) "
            f"{took['warm']:.2f} s, cold {took['cold']:.2f} s ({took['warm'] / took['cold']:.2f})")


ROWS: dict[str, Callable[[Context], str]] = {
    "nproc-gpu": row_nproc_gpu,
    "health": row_health,
    "reclaim": row_reclaim,
    "inprocess": row_inprocess,
    "lightning": row_lightning,
    "state": row_state,
    "waits": row_waits,
    "standby": row_standby,
}


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# --- the driver ------------------------------------------------------------------------------


def find_gpu() -> Gpu:
    """The GPUs NVML sees and the torch the rows use; this process itself never touches
    CUDA (it holds no GPU memory): torch is asked in a child."""
    from elasticrun.agent.gpu import open_gpus

    gpus = open_gpus()
    try:
        facts = gpus.facts(range(1)) if gpus.count else ()
        count, note = gpus.count, "" if gpus.count else gpus.check(()).reason
    finally:
        gpus.close()
    code = ("import torch, platform; print(f'python {platform.python_version()}, torch {torch.__version__}, "
            "CUDA {torch.version.cuda}'); print(torch.cuda.is_available())")
    try:
        done = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=20)
        lines = done.stdout.split("\n")
        software, torch_cuda = (lines[0], lines[1] == "True") if done.returncode == 0 else (
            f"torch: {(done.stderr.strip().splitlines() or ['?'])[-1]}", False)
    except subprocess.TimeoutExpired:
        software, torch_cuda = "torch: no answer within 20 s", False
    if count:
        with contextlib.suppress(Exception):  # the driver's version is only shown
            software += f", driver {nvml().nvmlSystemGetDriverVersion()}"
    name = (facts[0].name if facts else None) or "GPU"
    return Gpu(count, name=name if count else "", note=note, software=software, torch_cuda=torch_cuda)


def run_row(name: str, gpu: Gpu, folder: Path) -> Row:
    """One row, to its end or its bound; whatever it started is killed after it."""
    started = time.monotonic()
    row_folder = folder / name
    row_folder.mkdir()
    ctx = Context(gpu, row_folder, started + BOUNDS[name])
    try:
        status, figure = "ok", ROWS[name](ctx)
    except Skipped as e:
        status, figure = "skipped", str(e)
    except RowFailed as e:
        status, figure = "failed", str(e)
    except Exception as e:  # noqa: BLE001 - a row's bug must not stop the others
        (row_folder / "traceback.txt").write_text(traceback.format_exc())
        status, figure = "failed", f"{type(e).__name__}: {e} (traceback in {row_folder / 'traceback.txt'})"
    finally:
        ctx.tracker.stop_all()
    return Row(name, status, figure, time.monotonic() - started)


def table(rows: list[Row]) -> str:
    head = ("ROW", "STATUS", "SECONDS", "FIGURE")
    cells = [head, *((r.name, r.status, f"{r.seconds:.0f}", r.figure) for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    return "\n".join(
        "  ".join([*(c[i].ljust(widths[i]) for i in range(3)), c[3]]).rstrip() for c in cells
    )


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[2],
    )
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated (default: all: {', '.join(ROWS)})")
    p.add_argument("--dry-run", action="store_true", help="list the rows and their bounds; run nothing")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON here")
    args = p.parse_args()
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown or not names:
        p.error(f"--rows: unknown {unknown or 'none given'}; the rows are {', '.join(ROWS)}")
    if args.dry_run:
        for name in names:
            print(f"{name:<10} at most {BOUNDS[name]:.0f} s: {(ROWS[name].__doc__ or '').strip()}")
        print(f"in all at most {sum(BOUNDS[n] for n in names):.0f} s")
        return 0
    become_subreaper()  # whatever a row starts stays ours to kill, even orphaned
    folder = Path(tempfile.mkdtemp(prefix="elasticrun_gpu_check_"))
    gpu = find_gpu()
    print(f"gpu: {f'{gpu.count} x {gpu.name}' if gpu.count else f'none ({gpu.note}): CPU variants'}; "
          f"{gpu.software}", flush=True)
    rows = []
    for name in names:
        row = run_row(name, gpu, folder)
        rows.append(row)
        print(f"[{row.name}] {row.status} ({row.seconds:.0f} s): {row.figure}", flush=True)
    print()
    print(table(rows))
    print(f"\nlogs: {folder}")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": asdict(gpu), "rows": [asdict(r) for r in rows]}, indent=2))
    return 1 if any(r.status == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
