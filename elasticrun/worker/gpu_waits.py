"""The time a CUDA stream waited in collectives, read from CUDA events, for the step timing.

Why. With NCCL a collective call returns as soon as the collective is queued: the wait
for a slow peer happens on the GPU, where a host clock sees nothing, and the host waits
later, for its own GPU, outside any collective (`loss.item()`). So every rank's compute
time came out alike and a slow GPU was never named.

How. Around a collective on CUDA tensors (and around `Work.wait()` of one, and from DDP's
last gradient bucket to its completion) two events are recorded on the current stream;
the stream reaches the second only once the collective is done, so the time between them
is what the stream spent in it: the transfer and the wait for the slowest peer, as a
gloo call's host time is. Their time is read later, once both are done (`query()`),
never by synchronising: the host keeps running ahead of the GPU, and the waits are
counted in the step in which they are read (`harvest()`, at each step's mark), which
over a window of steps is the same.

What it costs: two event records per collective (microseconds); pairs left unread (a
script that stops marking steps) are bounded.

No torch here: the caller passes the event factory (`torch.cuda.Event(enable_timing=True)`),
which runs only once a CUDA tensor is seen, so a CPU worker never touches CUDA.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

#: pairs kept unread at most; older ones are dropped (their waits are lost, not wrong)
LIMIT = 1024


class GpuWaits:
    """Pairs of CUDA events bracketing collectives, summed once the GPU has passed them.

    `start`/`end` run on the thread that launches (the main thread, or DDP's hook and
    callback threads); `harvest` on the main thread: a lock keeps the queue."""

    def __init__(self, new_event: Callable[[], Any], limit: int = LIMIT) -> None:
        self._new_event = new_event
        self._pending: deque[tuple[Any, Any]] = deque(maxlen=limit)
        self._lock = threading.Lock()

    def start(self) -> Any:
        """An event on the current stream, before the collective is queued."""
        event = self._new_event()
        event.record()
        return event

    def end(self, start: Any) -> None:
        """The collective that began at `start` is done once the current stream gets here."""
        event = self._new_event()
        event.record()
        with self._lock:
            self._pending.append((start, event))

    def harvest(self) -> float:
        """Seconds the stream spent in the collectives done since the last harvest.

        Stops at the first pair the GPU has not passed: streams run in order."""
        total = 0.0
        with self._lock:
            while self._pending and self._pending[0][1].query():
                start, end = self._pending.popleft()
                total += start.elapsed_time(end) / 1000.0  # milliseconds
        return total

    def forget(self) -> None:
        """Drop what is pending (a new round counts afresh)."""
        with self._lock:
            self._pending.clear()


def on_cuda(value: Any) -> bool | None:
    """Whether a collective's first argument lives on a GPU; None if it is no tensor.

    A tensor, or a list of them (all_gather's outputs), as torch.distributed takes them."""
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    is_cuda = getattr(value, "is_cuda", None)
    return is_cuda if isinstance(is_cuda, bool) else None
