"""Waiting on several things at once, the first to finish deciding.

Shared by the agent (a round, a signal, a drain, a watch) and the job-control commands,
so that every such wait cancels and awaits the rest the same way (no task left running
unobserved)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def first_of(*awaitables: Awaitable[T]) -> T:
    """The result of whichever awaitable finishes first (or its exception).

    The others are cancelled and awaited.

    When several finish together, the earliest in argument order wins.
    """
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    winner = next(t for t in tasks if t.done() and not t.cancelled())
    return winner.result()
