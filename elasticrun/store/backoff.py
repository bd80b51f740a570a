"""Backoff: one operation's retries, the pauses between them and the deadline they stop at.

Every store client retries the same way: a call that failed in a way worth another try
pauses, the pause doubling from a first to a longest one, until a deadline. The built-in
store's clients (`client/grpc_store.py`, `client/c10d.py`, `client/first_contact.py`)
and the etcd client (`etcd/cluster.py`) keep their own judgement of which failure is
worth a try, and of what to say when time is up; the counting is this, once.

Why ours and not a retry library (tenacity, backoff): each client decides per failure
what ends its retries at once and what to say then, some of it asynchronously (whether
the server refused our TLS is asked in a thread), and not every loop is a call: a
watch's deadline runs from when its stream broke and starts again with each reply; the
etcd client pauses only once every member failed in a row, with jitter. A library's
decorator owns the loop, so each of those would become a callback around it, for what is
here some thirty lines; and it would be one more package in what every training script
imports with the workers' client (`client/c10d.py`, kept to what talking to the server
needs).
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: The first pause before retrying a call that found the server unreachable, and the
#: longest: the pause doubles in between.
FIRST_BACKOFF = 0.05
MAX_BACKOFF = 1.0


class Backoff:
    """The pauses of one operation's retries, and the deadline they stop at.

    The pause doubles from `first` to `longest`; the deadline is `timeout` from now, by
    `clock` (`time.monotonic`, or an event loop's `time`)."""

    __slots__ = ("_clock", "_delay", "_first", "_longest", "deadline")

    def __init__(
        self,
        timeout: float,
        *,
        first: float = FIRST_BACKOFF,
        longest: float = MAX_BACKOFF,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._first = first
        self._longest = longest
        self._delay = first
        self.deadline = clock() + timeout

    def left(self) -> float:
        """The time left until the deadline (0 once past it)."""
        return max(self.deadline - self._clock(), 0.0)

    def out_of_time(self) -> bool:
        """Whether the next pause would end at or past the deadline: no try after it."""
        return self._clock() + self._delay >= self.deadline

    def pause(self) -> float:
        """The pause to take before the next try; the one after it is twice as long."""
        delay = self._delay
        self._delay = min(2 * delay, self._longest)
        return delay
