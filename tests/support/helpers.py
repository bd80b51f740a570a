"""What every kind of test shares: a free port, waits for an event, the launcher's command.

- `wait_until` polls a condition with no event to wait on (a file appears, a process is
  gone); `eventually` does the same inside an event loop, which keeps running.
- `next_events` takes the next events of a store watch, bounded.
- `ELASTICRUN` is how a test starts the launcher: `python -m elasticrun`, as a user runs
  it (`Cluster.launch` starts an agent or a subcommand with it).
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TypeVar

from elasticrun.store.interface import WatchEvent

T = TypeVar("T")

#: `python -m elasticrun` with this interpreter: the launcher as a user starts it
ELASTICRUN = (sys.executable, "-m", "elasticrun")

#: Bounds a wait for a store watch's events; far above any healthy latency.
EVENT_WAIT = 10.0


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(
    predicate: Callable[[], T], timeout: float = 60.0, what: str = "a condition", interval: float = 0.05
) -> T:
    """Poll `predicate` until it returns something truthy (returned) or fail after `timeout`.

    For conditions with no event to wait on (a file appears, a process is gone); the
    one polling loop of the tests.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def all_threads_stopped(pid: int) -> bool:
    """Whether every thread of process `pid` is stopped (state T), as after a SIGSTOP took hold.

    kill() returns before that: one thread is woken to take the signal and stops the
    others on its way, so on a loaded machine the process serves on for a while (an
    etcd member SIGSTOPped answered a renewal sent right after it: a test's flake)."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rpartition(")")[2].split()[0])
        except (OSError, IndexError):
            continue  # a thread that ended meanwhile
    return bool(states) and all(s in ("T", "t") for s in states)


async def eventually(predicate: Callable[[], object], timeout: float, interval: float = 0.01) -> None:
    """`wait_until` inside an event loop: the loop keeps running while it waits.

    Raises TimeoutError after `timeout`.
    """
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(interval)


async def next_events(it: AsyncIterator[WatchEvent], n: int, within: float = EVENT_WAIT) -> list[WatchEvent]:
    """The next `n` events of a watch, or a test failure if they do not come `within` seconds."""
    async with asyncio.timeout(within):
        return [await anext(it) for _ in range(n)]
