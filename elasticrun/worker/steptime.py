"""Step timing: each worker's own compute time per step, for the agent's straggler check.

Why compute time. In a synchronous job every rank's step takes the same wall time: the
fast ranks wait for the slow one in the collectives. So the wall step cannot say which
rank is slow; the time a rank spends *outside* those waits can. A step's compute time
is its wall time less the time the rank was blocked in a collective.

Where the steps are. A step is the time between two marks, from the most precise
source the script has (a mark of a lower source is ignored once a higher one was seen):

1. `State.commit()` (in-process mode), once per step by design;
2. `elasticrun.worker.heartbeat()`, which the Lightning and Hugging Face callbacks of
   `elasticrun.worker.callbacks` call;
3. otherwise every `torch.optim` optimizer's step (a global post-hook, torch >= 2.0), so
   a plain script needs no change.

Where the waits are. Once the script imports torch, torch.distributed's collective
calls (`all_reduce`, `barrier`, `send`/`recv`, ...) and `Work.wait()` of the async ones
are wrapped: the time inside them, on the main thread, is time blocked. `waiting()`
marks the same for a collective of the script's own. DDP's gradient all-reduce (C++,
inside `backward()`) is timed through its communication hook (elasticrun.worker.
ddp_waits); its broadcast of the model's buffers from rank 0 at each forward, by
wrapping the call it makes (`_broadcast_coalesced`). With NCCL a call returns once the
collective is queued: its wait is timed on the GPU, with CUDA events (elasticrun.worker.
gpu_waits). Not seen: collectives inside `torch.compile`d code: see docs/concepts.md, "How slow is judged".

What it costs. A mark or a wrapped call is a few clock reads (about a microsecond); a
thread writes the summary at most twice a second, and only when it changed, to the file
the agent named (`install`). The same thread touches the progress file of the hang
watchdog (`--progress-timeout`) when steps were made since its last look, so a plain
script is watched without calling `heartbeat()`.

No torch here: this module is loaded by the worker boot (elasticrun/worker/boot) in
every worker, and installs the torch part only when the script imports torch itself.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from elasticrun.collectives import COLLECTIVES
from elasticrun.worker.gpu_waits import GpuWaits, on_cuda

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec
    from types import ModuleType

#: the variable naming this worker's summary file (set by the agent, read by the boot)
STEPS_FILE_ENV = "ELASTICRUN_STEPS_FILE"
#: steps whose times the summary's medians are taken over
WINDOW = 16
#: at most one write of the summary per this many seconds
WRITE_INTERVAL = 0.5

#: step sources, by precedence: a mark of a lower one is ignored once a higher one came
SOURCES = ("optimizer", "heartbeat", "commit")

class Recorder:
    """One process's steps and waits, and the summary the agent reads.

    The hot path (`mark`, `enter`, `leave`) only reads the clock and updates a few
    numbers; `summary()` (the writer thread's) takes the medians.
    """

    def __init__(self, path: str, clock: Callable[[], float] = time.perf_counter) -> None:
        self.path = path
        self._clock = clock
        self._main = threading.main_thread().ident
        #: the source whose marks count (its index in SOURCES; -1: none seen yet)
        self.level = -1
        self.steps = 0
        self._started: float | None = None  # the current step's start (None: before a first mark)
        self._blocked = 0.0  # seconds blocked in the current step so far
        self._depth = 0  # nested wrapped calls (all_gather_object calls all_gather)
        self._entered = 0.0  # when the outermost blocked call began
        self._entered_in = ""
        self.compute: deque[float] = deque(maxlen=WINDOW)
        self.wall: deque[float] = deque(maxlen=WINDOW)
        #: the waits of collectives on GPUs (set once torch is loaded)
        self.gpu: GpuWaits | None = None
        self._on_gpu = False  # whether the last collective with a tensor ran on a GPU

    def mark(self, source: str) -> None:
        """A step boundary from `source` (one of SOURCES), on the main thread only.

        A thread that calls heartbeat() while the main one imports or loads marks no
        step."""
        level = SOURCES.index(source)
        if level < self.level or threading.get_ident() != self._main:
            return
        now = self._clock()
        if level > self.level:  # a better source: count its steps from here
            self.level = level
            self.restart()
        if self.gpu is not None:
            self._blocked += self.gpu.harvest()
        started = self._started
        if started is None:  # the first mark starts the first step
            self._started, self._blocked = now, 0.0
            return
        wall = now - started
        self.wall.append(wall)
        self.compute.append(max(wall - self._blocked, 0.0))
        self.steps += 1
        self._started, self._blocked = now, 0.0

    def restart(self) -> None:
        """Count steps afresh from the next mark.

        On a better source, or a new round of an in-process worker: its join and state
        sync are no step."""
        self.steps, self._started, self._blocked = 0, None, 0.0
        self.compute.clear()
        self.wall.clear()
        if self.gpu is not None:
            self.gpu.forget()

    def enter(self, name: str) -> bool:
        """The main thread starts waiting for its peers in `name`.

        False (ignored) on another thread: a background thread's collective does not
        hold up the step."""
        if threading.get_ident() != self._main:
            return False
        if self._depth == 0:
            self._entered, self._entered_in = self._clock(), name
        self._depth += 1
        return True

    def leave(self, counted: bool = True) -> None:
        """The wait that `enter` began (and returned True for) is over.

        `counted` False: the host's time in it is not the wait (a GPU collective, whose
        wait `gpu_waits_for` times on the GPU)."""
        self._depth -= 1
        if self._depth == 0:
            if counted:
                self._blocked += self._clock() - self._entered
            self._entered, self._entered_in = 0.0, ""

    def gpu_waits_for(self, name: str, first: Any) -> GpuWaits | None:
        """Where to time the wait just entered on the GPU, if it is the outermost and runs there.

        `first` is the call's first argument. A `Work.wait()` carries no device: it is
        taken to be where the last collective with a tensor was (a process runs its
        collectives on GPUs or on the CPU, not both by turns)."""
        if self._depth != 1 or self.gpu is None:
            return None
        if name != "wait":
            device = on_cuda(first)
            if device is None:
                return None  # barrier(), object collectives: the host waits
            self._on_gpu = device
        return self.gpu if self._on_gpu else None

    def waited(self, seconds: float) -> None:
        """The current step waited `seconds` for its peers where no wrapper sees it (any thread).

        DDP's reducer waits for its gradient all-reduce inside `backward()`
        (elasticrun.worker.ddp_waits)."""
        self._blocked += seconds

    def has_news(self) -> bool:
        """Whether there is anything to write: a step source seen, or a wait now.

        A worker that makes no step and waits for nobody leaves no file."""
        return self.level >= 0 or bool(self._entered_in)

    def summary(self, wall_now: float) -> dict[str, Any]:
        """What the agent reads: recent medians, the step count, and the wait now."""
        compute, wall = list(self.compute), list(self.wall)
        entered, name = self._entered, self._entered_in
        return {
            "pid": os.getpid(),
            "source": SOURCES[self.level] if self.level >= 0 else "",
            "steps": self.steps,
            "compute": _median(compute),
            "wall": _median(wall),
            "waiting": name if entered else "",
            "waiting_since": wall_now - (self._clock() - entered) if entered and name else 0.0,
        }


def _median(values: list[float]) -> float:
    """The median (0 of none): the statistics module costs every worker's start 5 ms."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return 0.0
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


#: this process's recorder, once `install` made it (None in a fork's child: not a worker)
_recorder: Recorder | None = None
#: set as the script ends: the writer thread stops, and is joined before the interpreter
#: finalizes (a daemon thread that takes the GIL back then ends in pthread_exit, which
#: aborts the process where a C++ frame is on its stack)
_stop_writing = threading.Event()
_writer: threading.Thread | None = None


def install(path: str, progressed: Callable[[], None] = lambda: None) -> None:
    """Record this process's steps into `path` (the worker boot calls this once).

    `progressed` is called (from the writer thread) when steps were made since its last
    look: the boot passes the hang watchdog's touch of the progress file
    (elasticrun.worker.progress, which imports this module: not the other way round)."""
    global _recorder, _writer
    if _recorder is not None:
        return
    _recorder = Recorder(path)
    os.register_at_fork(after_in_child=_forget)
    atexit.register(_write_last)
    sys.excepthook = _shown_without_wrappers(sys.excepthook)
    threading.excepthook = _shown_without_wrappers(threading.excepthook)
    _writer = threading.Thread(
        target=_write_loop, args=(_recorder, progressed), name="elasticrun step timing", daemon=True
    )
    _writer.start()
    if "torch" in sys.modules and hasattr(sys.modules["torch"], "optim"):
        install_torch(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, _AfterTorch())


def _shown_without_wrappers(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook` (sys.excepthook, threading.excepthook), shown tracebacks without our wrappers' frames.

    Python shows every frame an exception passed through, so each timed collective would
    add one or two `steptime.py ... in timed` lines to the script's tracebacks."""

    @functools.wraps(hook)
    def shown(*args: Any) -> Any:
        exc = args[0].exc_value if len(args) == 1 else args[1]  # threading's hook takes one argument
        _drop_wrappers(exc, set())
        if len(args) == 3 and exc is not None:
            args = (args[0], exc, exc.__traceback__)
        return hook(*args)

    return shown


def _drop_wrappers(exc: BaseException | None, seen: set[int]) -> None:
    """Take the wrappers' frames out of `exc`'s traceback, its cause's and its context's."""
    import types

    from elasticrun.collectives import is_wrapper_frame

    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        entries = []
        tb = exc.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            if not is_wrapper_frame(code.co_filename, code.co_name):
                entries.append(tb)
            tb = tb.tb_next
        rebuilt: types.TracebackType | None = None
        for entry in reversed(entries):
            rebuilt = types.TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
        exc.__traceback__ = rebuilt
        _drop_wrappers(exc.__cause__, seen)
        exc = exc.__context__


def _write_last() -> None:
    """The summary as the script ends, once the writer thread has stopped."""
    _stop_writing.set()
    if _writer is not None:
        _writer.join(timeout=2.0)  # at most one write of its own left
    recorder = _recorder
    if recorder is not None and recorder.has_news():
        _write(recorder.path, {**recorder.summary(time.time()), "at": time.time()})


def _forget() -> None:
    """A forked child (a data loader's worker) is no worker: it records nothing."""
    global _recorder
    _recorder = None


def new_round() -> None:
    """This process's training goes on in a new round (in-process mode).

    Its steps are counted afresh, as the agent's report is the round's."""
    recorder = _recorder
    if recorder is not None:
        recorder.restart()


def mark(source: str) -> None:
    """A step boundary (a no-op unless the agent asked for step timing)."""
    recorder = _recorder
    if recorder is not None:
        recorder.mark(source)


@contextlib.contextmanager
def waiting(name: str) -> Iterator[None]:
    """Count the time inside as blocked waiting for peers.

    For a collective of the script's own (e.g. over sockets); torch.distributed's
    collectives are counted already."""
    recorder = _recorder
    counted = recorder is not None and recorder.enter(name)
    try:
        yield
    finally:
        if counted:
            assert recorder is not None
            recorder.leave()


def _waited(seconds: float) -> None:
    recorder = _recorder
    if recorder is not None:
        recorder.waited(seconds)


def _gpu_waits() -> GpuWaits | None:
    recorder = _recorder
    return recorder.gpu if recorder is not None else None


def _write_loop(recorder: Recorder, progressed: Callable[[], None]) -> None:
    """Write the summary when it changed, at most every WRITE_INTERVAL.

    Call `progressed` when the worker made steps since the last look."""
    written: dict[str, Any] = {}
    progress = (-1, 0)
    while _recorder is recorder and not _stop_writing.wait(WRITE_INTERVAL):
        now = (recorder.level, recorder.steps)
        if now != progress and recorder.steps:
            progressed()
        progress = now
        summary = recorder.summary(time.time())
        if summary != written and recorder.has_news():
            written = summary
            _write(recorder.path, {**summary, "at": time.time()})


def _write(path: str, summary: dict[str, Any]) -> None:
    """Replace the file whole (the agent never reads half of one); never raise."""
    import json

    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(summary, separators=(",", ":")))
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)


# --- the torch part: installed once the script has imported torch ----------------------


class _AfterTorch:
    """Runs `install_torch` as soon as `import torch` has finished, then steps aside.

    A finder on sys.meta_path; not an importlib.abc subclass, which costs every worker's
    start 17 ms of imports."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if fullname != "torch":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            install_torch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign] # this spec's loader only
        return spec


def install_torch(torch: Any) -> None:
    """Mark a step at every optimizer step, and time torch.distributed's collectives.

    Never breaks the script: what cannot be installed is said in one line on stderr.
    """
    try:
        import importlib

        optimizer = importlib.import_module("torch.optim.optimizer")  # torch.optim hides the module's name
        optimizer.register_optimizer_step_post_hook(lambda *_: mark("optimizer"))
        dist = torch.distributed
        if not dist.is_available():
            return
        c10d = dist.distributed_c10d
        is_compiling = torch.compiler.is_compiling
        for name in COLLECTIVES:
            original = getattr(c10d, name, None) or getattr(dist, name, None)
            if original is None or getattr(original, "_elasticrun_timed", False):
                continue
            timed = _timed(original, name, is_compiling)
            for module in (c10d, dist):  # where torch's own callers look it up
                if getattr(module, name, None) is original:
                    setattr(module, name, timed)
        work = torch._C._distributed_c10d.Work
        if not getattr(work.wait, "_elasticrun_timed", False):
            work.wait = _timed(work.wait, "wait", is_compiling)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        from elasticrun.worker import ddp_waits

        if _recorder is not None:
            _recorder.gpu = GpuWaits(lambda: torch.cuda.Event(enable_timing=True))
        ddp = torch.nn.parallel.DistributedDataParallel
        ddp_waits.install(ddp, dist.GradBucket, allreduce_hook, _waited, _gpu_waits)
    except Exception as e:  # a torch this was not written for: train untimed
        print(f"elasticrun: step timing is off in this worker: {type(e).__name__}: {e}", file=sys.stderr)


def _timed(call: Callable[..., Any], name: str, is_compiling: Callable[[], bool]) -> Callable[..., Any]:
    """`call`, its time on the main thread counted as blocked.

    While torch.compile traces it, only `call` is seen, so the compiled graph holds the
    collective itself."""

    @functools.wraps(call)
    def timed(*args: Any, **kwargs: Any) -> Any:
        recorder = _recorder
        if recorder is None or is_compiling() or not recorder.enter(name):
            return call(*args, **kwargs)
        gpu = recorder.gpu_waits_for(name, args[0] if args else next(iter(kwargs.values()), None))
        start = gpu.start() if gpu is not None else None
        try:
            return call(*args, **kwargs)
        finally:
            if gpu is not None:
                gpu.end(start)
            recorder.leave(counted=gpu is None)

    timed._elasticrun_timed = True  # type: ignore[attr-defined]
    return timed
