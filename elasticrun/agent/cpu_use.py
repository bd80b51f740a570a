"""How much CPU a changing set of processes used between two looks.

For the straggler check: a node's standbys (elasticrun.agent.standby) import beside its
workers at the lowest priority, and whether that took anything from the workers depends
on the machine (under a CPU quota it does, whatever the priority). What they used is
the fact to go by, read from /proc/PID/stat's times: no thread, no sampling of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from elasticrun.agent.sessions import cpu_seconds


class CpuUse:
    """The CPU time processes used since the last look, as a share of one CPU."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._at = clock()
        #: each process's CPU time at the last look
        self._seen: dict[int, float] = {}

    def share(self, pids: Iterable[int]) -> float:
        """CPU seconds the processes `pids` used since the last call, per second of wall time.

        A process not seen at the last call counts from its start (it started
        meanwhile); one that is gone counts nothing."""
        now = self._clock()
        used = {pid: cpu_seconds(pid) for pid in pids}
        spent = sum(max(cpu - self._seen.get(pid, 0.0), 0.0) for pid, cpu in used.items())
        elapsed, self._seen, self._at = now - self._at, used, now
        return spent / elapsed if elapsed > 0 else 0.0
