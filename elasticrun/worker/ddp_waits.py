"""DDP's gradient all-reduce, timed where DDP waits for it, for the step timing.

Why. DDP launches its gradient all-reduce from C++ (its reducer), bucket by bucket, while
`backward()` still computes, and waits for the last one inside `backward()`: the Python
collectives that `elasticrun.worker.steptime` wraps never see it, so a fast rank's wait
for a slow one counts as its compute, and every rank of a DDP job looked equally slow.

How. Every DDP module's communication hook is wrapped: the script's own (registered
through `register_comm_hook`, as Lightning and the Hugging Face Trainer do when asked),
or, when the script registers none by its first forward, torch's own `allreduce_hook`,
which does what DDP's built-in all-reduce does. A rank's wait is the time from the launch
of the iteration's last bucket (`GradBucket.is_last()`: its local backward is done) to the
completion of every bucket it launched: a fast rank waits there for the slow one, the
slow one finds the others ready. The hook's future is chained (`then`), and DDP waits
for the chained one, so the wait is counted before `backward()` returns.

GPU buckets (NCCL). Their futures complete when the collective is queued, not done, so a
host clock measures nothing there. Their wait is timed on the GPU instead
(elasticrun.worker.gpu_waits): an event on the current stream as the last bucket is
launched, and one in the callback of its future, which torch runs on a stream that waits
for the bucket's all-reduce; the buckets of one process group run in order, so the last
one's end is every one's.

What it does not time. A built-in hook (`_register_builtin_comm_hook`) cannot be wrapped
and runs untimed.

Torch is imported by the caller (`steptime.install_torch`), never here at import time.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from elasticrun.worker.gpu_waits import GpuWaits

#: a DDP module's attribute: its hook is (to be) wrapped; True once one is registered
_HOOKED = "_elasticrun_hooked"


class BucketWaits:
    """One DDP module's waits for its buckets, reported to `blocked` once per iteration.

    The hooks run on the backward's thread, the futures' callbacks on the process
    group's threads: a lock keeps the count."""

    def __init__(
        self,
        blocked: Callable[[float], None],
        gpu: Callable[[], GpuWaits | None] = lambda: None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._blocked = blocked
        self._gpu = gpu
        self._clock = clock
        self._lock = threading.Lock()
        self._pending = 0  # buckets launched and not yet done
        self._last_launched: float | None = None  # when this iteration's last bucket was launched

    def launched(self, last: bool) -> None:
        with self._lock:
            self._pending += 1
            if last:
                self._last_launched = self._clock()

    def done(self) -> None:
        with self._lock:
            self._pending -= 1
            if self._pending or self._last_launched is None:
                return
            waited, self._last_launched = self._clock() - self._last_launched, None
        self._blocked(waited)

    def wrap(self, hook: Callable[..., Any], grad_bucket: Any) -> Callable[..., Any]:
        """`hook`, timed for the buckets of this module that live on the host."""

        @functools.wraps(hook)
        def timed(state: Any, bucket: Any) -> Any:
            # DDP's Python reducer (compiled autograd) passes (grad, param), not a bucket
            if not isinstance(bucket, grad_bucket):
                return hook(state, bucket)
            if bucket.buffer().is_cuda:
                return self._on_gpu(hook, state, bucket)
            self.launched(bucket.is_last())
            try:
                future = hook(state, bucket)
            except BaseException:
                self.done()
                raise
            return future.then(self._finished)

        return timed

    def _finished(self, future: Any) -> Any:
        self.done()
        return future.value()

    def _on_gpu(self, hook: Callable[..., Any], state: Any, bucket: Any) -> Any:
        """`hook` for a GPU bucket: the last one's launch to its end, timed on the GPU."""
        gpu = self._gpu()
        if gpu is None or not bucket.is_last():
            return hook(state, bucket)
        start = gpu.start()

        def finished(future: Any) -> Any:
            gpu.end(start)  # on a stream that waits for the bucket's all-reduce
            return future.value()

        return hook(state, bucket).then(finished)


def install(ddp_class: Any, grad_bucket: Any, allreduce_hook: Callable[..., Any],
            blocked: Callable[[float], None], gpu: Callable[[], GpuWaits | None] = lambda: None) -> None:
    """Time every DDP module's gradient all-reduce from now on (class-wide, once)."""
    if getattr(ddp_class, _HOOKED, False):
        return
    setattr(ddp_class, _HOOKED, True)
    init, register, register_builtin = (
        ddp_class.__init__, ddp_class.register_comm_hook, ddp_class._register_builtin_comm_hook)

    def waits_of(ddp: Any) -> BucketWaits:
        waits: BucketWaits | None = ddp.__dict__.get("_elasticrun_waits")
        if waits is None:
            waits = ddp.__dict__["_elasticrun_waits"] = BucketWaits(blocked, gpu)
        return waits

    @functools.wraps(register)
    def register_comm_hook(self: Any, state: object, hook: Callable[..., Any]) -> None:
        self.__dict__[_HOOKED] = True
        register(self, state, waits_of(self).wrap(hook, grad_bucket))

    @functools.wraps(register_builtin)
    def register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        self.__dict__[_HOOKED] = True
        register_builtin(self, comm_hook_type)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if getattr(self, "reducer", None) is None:
            return
        handles: list[Any] = []

        def default_hook_at_first_forward(*_: Any) -> None:
            # by now the script has registered its own hook, if it has one
            handles.pop().remove()
            if not self.__dict__.get(_HOOKED):
                self.register_comm_hook(self.process_group, allreduce_hook)

        handles.append(self.register_forward_pre_hook(default_hook_at_first_forward))

    ddp_class.__init__ = __init__
    ddp_class.register_comm_hook = register_comm_hook
    ddp_class._register_builtin_comm_hook = register_builtin_comm_hook
