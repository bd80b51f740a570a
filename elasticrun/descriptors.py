"""File descriptors: as many as the host allows, and running out of them survived.

The agent and the store serve connections from anyone who can reach them, and each
connection is a descriptor. A process that runs out (EMFILE, or ENFILE for the whole
host) must not die of it: accepting a connection, reading /proc, opening a log file
each fail then, and each such failure is a wait or a refusal, never a crash, and it is
said once a minute (`say_exhausted`), not once per failure (a flood of connections
made 4,096 tracebacks, 8.6 MB of log, before).

A module of its own, below every layer: the agent, the store and the launcher use it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import time
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: the errors of a process, or a host, out of descriptors
EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE})
#: the soft limit asked for at most: the hard limit may be "unlimited" (2**63 - 1)
MOST_DESCRIPTORS = 1 << 20
#: how often running out is said, at most
SAY_EVERY = 60.0
#: how long a blocking step (a scan of /proc) waits for descriptors before it gives up
WAIT_LIMIT = 10.0

_said_at: dict[str, float] = {}


def raise_soft_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (at most `MOST_DESCRIPTORS`).

    Returns the soft and hard limits now. The common soft limit (1,024) is a shell's
    default, not the host's: the hard limit is what the operator allows, and a store
    that serves a thousand agents needs more than a thousand descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MOST_DESCRIPTORS if hard == resource.RLIM_INFINITY else min(hard, MOST_DESCRIPTORS)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (OSError, ValueError):  # refused (a sandbox): the limit stays as it was
            pass
    return soft, hard


def soft_limit() -> int:
    """This process's soft RLIMIT_NOFILE (`MOST_DESCRIPTORS` when unlimited)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return MOST_DESCRIPTORS if soft == resource.RLIM_INFINITY else soft


def exhausted(error: BaseException | None) -> bool:
    """Whether `error` says this process (or host) is out of descriptors."""
    return isinstance(error, OSError) and error.errno in EXHAUSTED


def say_exhausted(where: str) -> None:
    """Log that `where` ran out of descriptors: once per `SAY_EVERY` s for each `where`."""
    now = time.monotonic()
    if now - _said_at.get(where, -SAY_EVERY) >= SAY_EVERY:
        _said_at[where] = now
        logger.warning(
            "%s: out of file descriptors (soft limit %d); waiting for some to be freed "
            "(said at most once a minute)", where, soft_limit(),
        )


def waiting_for_descriptors(where: str, step: Callable[[], T], limit: float = WAIT_LIMIT) -> T:
    """`step()`, tried again while it fails for want of descriptors, for `limit` s at most.

    For blocking steps that must not be skipped (a scan of /proc before killing a tree):
    a scan that failed would otherwise read as "no process left". Past the limit the
    error is raised."""
    deadline = time.monotonic() + limit
    while True:
        try:
            return step()
        except OSError as e:
            if not exhausted(e) or time.monotonic() >= deadline:
                raise
            say_exhausted(where)
            time.sleep(0.05)


def quiet_exhaustion(loop: asyncio.AbstractEventLoop) -> None:
    """Make `loop` say a failed accept for want of descriptors once a minute, not with a traceback each time.

    asyncio already pauses a listening socket for a second after such a failure; other
    errors go to the loop's default handler as before."""

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if exhausted(context.get("exception")):
            say_exhausted("accepting connections")
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
