"""Shared helpers for the launcher and rendezvous benchmarks (bench-only code).

Process hygiene: the driver makes itself a child subreaper, so every process it starts,
and every process those start (workers whose agent died), stays its descendant; at the
end of each trial `ProcessTracker.stop_all()` SIGKILLs exactly those descendants by PID
and reaps them. Nothing is killed by name.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import ctypes
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "bench" / "workers"
PYTHON = sys.executable

#: the two launchers, as one runs them
LAUNCHERS = {
    "elasticrun": [PYTHON, "-m", "elasticrun"],
    "torchrun": [PYTHON, "-m", "torch.distributed.run"],
}

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to us (not init), so we can find and stop them."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _parents() -> dict[int, int]:
    """pid -> ppid for every process now visible in /proc."""
    result = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        result[int(entry.name)] = int(text.rsplit(")", 1)[1].split()[1])
    return result


def descendants(root: int) -> list[int]:
    """Every process below `root` (children first found, breadth first)."""
    parents = _parents()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found, queue = [], [root]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal `pid` and all its descendants (a whole node dying at once)."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def reap() -> None:
    """Collect every exited child (our own and adopted orphans)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class ProcessTracker:
    """Processes a trial started; `stop_all()` kills them and their descendants by PID."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self, argv: Sequence[str], *, env: dict[str, str] | None = None, log: Path | None = None, cwd: Path = REPO
    ) -> subprocess.Popen[bytes]:
        out = open(log, "ab") if log else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(
                list(argv), env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=cwd
            )
        finally:
            if log:
                out.close()  # type: ignore[union-attr]
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        """SIGKILL every process started here and every descendant of this driver."""
        for _ in range(3):
            pids = descendants(os.getpid())
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
            for proc in self.procs:
                if proc.poll() is None:
                    try:
                        proc.wait(2)
                    except subprocess.TimeoutExpired:
                        pass
            reap()
        self.procs.clear()


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def median(values: Iterable[float]) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def fmt(value: float | None, digits: int = 2, unit: str = "") -> str:
    return "—" if value is None else f"{value:.{digits}f}{unit}"


def ratio(ours: float | None, theirs: float | None) -> str:
    if ours is None or theirs is None or theirs == 0:
        return "—"
    return f"{ours / theirs:.2f}"


def start_run(prefix: str) -> tuple[dict[str, object], Path]:
    """What every benchmark does first: become the subreaper of what it starts, print
    the machine, and make the folder its logs go to. Returns (machine info, folder)."""
    import tempfile

    become_subreaper()
    info = machine()
    print(f"machine: {info}", flush=True)
    return info, Path(tempfile.mkdtemp(prefix=prefix))


def machine() -> dict[str, object]:
    import importlib.metadata as md

    def version(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "?"

    return {
        "cores": os.cpu_count(),
        "loadavg_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "grpcio": version("grpcio"),
        "kernel": platform.release(),
    }


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def write_json(path: str | None, data: object) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2, default=str))


def base_env(**extra: str) -> dict[str, str]:
    """The environment both launchers get: ours, loopback gloo, no stray PET_ flags."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env.update(GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", LOGLEVEL="INFO")
    env.update(extra)
    return env


def run_profiled(main: Callable[[], Coroutine[object, object, object]], profile: str | None) -> None:
    """`asyncio.run(main())`, under cProfile (stats dumped to `profile`) when a path is given."""
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    asyncio.run(main())
    if profiler:
        profiler.disable()
        profiler.dump_stats(profile)


#: Set (and inherited by every child) when a run keeps CPython's GC defaults.
_DEFAULT_GC_ENV = "BENCH_DEFAULT_GC"


def add_default_gc_flag(parser: argparse.ArgumentParser) -> None:
    """--default-gc: our store server and clients keep CPython's GC defaults."""
    parser.add_argument(
        "--default-gc",
        action="store_true",
        help="our store server and clients keep CPython's GC defaults instead of "
        "elasticrun's settings (elasticrun/launcher/gc_settings.py)",
    )


def apply_default_gc_flag(args: argparse.Namespace) -> None:
    """Hand --default-gc down to the children this driver starts."""
    if args.default_gc:
        os.environ[_DEFAULT_GC_ENV] = "1"


def settle_gc() -> None:
    """In a child standing for `elasticrun store serve` or an agent: collect garbage as
    they do, unless the run compares against CPython's defaults (--default-gc)."""
    from elasticrun.launcher.gc_settings import settle_gc as settle

    if not os.environ.get(_DEFAULT_GC_ENV):
        settle()
