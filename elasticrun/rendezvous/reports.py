"""What a node publishes for job control: its status, its ranks' latest output, events.

The agent reports synchronously and never waits on the store; a `Reporter` keeps the
latest of everything in memory (bounded) and publishes it in the background, batched:
at most one batch per interval, so a chatty worker costs the store a write per rank
every half second at most. Status, output windows and the step report are bound to
the node's lease and vanish with it; events stay (the leader prunes the oldest). The
step report changes with every step, and the leader reads it once per evaluation, so
it is published at most once per `steps_interval` (straggler_interval).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

from elasticrun.errors import StoreError
from elasticrun.rendezvous.codec import encode
from elasticrun.rendezvous.handler import AgentStatus
from elasticrun.rendezvous.keys import Keys
from elasticrun.rendezvous.records import Event, LogLine, LogWindow, NodeInfo, NodeStatus, StepReport
from elasticrun.store.interface import Store

log = logging.getLogger("elasticrun.rendezvous")

#: a node publishes its status, output windows and events at most this often
REPORT_INTERVAL = 0.5
#: lines of each rank's output kept in the store, and the longest line kept whole
LOG_WINDOW_LINES = 100
_LOG_LINE_CHARS = 1000


class Reporter:
    """The latest reports of one node, and their publication."""

    def __init__(self, store: Store, keys: Keys, me: NodeInfo, *, steps_interval: float = 5.0) -> None:
        self._store = store
        self._keys = keys
        self._me = me
        self._steps_interval = steps_interval
        self._steps: StepReport | None = None
        self._steps_published_at = -1e9  # monotonic
        self._due = asyncio.Event()
        self._status: AgentStatus | None = None
        self._status_dirty = False
        self._windows: dict[int, deque[LogLine]] = {}
        self._line_seq: dict[int, int] = {}
        self._dirty_logs: set[int] = set()
        self._events: list[Event] = []

    def status(self, status: AgentStatus) -> None:
        self._status, self._status_dirty = status, True
        self._due.set()

    def output(self, rank: int, stream: str, lines: list[str]) -> None:
        window = self._windows.setdefault(rank, deque(maxlen=LOG_WINDOW_LINES))
        seq = self._line_seq.get(rank, 0)
        for text in lines[-LOG_WINDOW_LINES:]:
            seq += 1
            window.append(LogLine(seq=seq, stream=stream, text=text[:_LOG_LINE_CHARS]))
        self._line_seq[rank] = seq + max(len(lines) - LOG_WINDOW_LINES, 0)
        self._dirty_logs.add(rank)
        self._due.set()

    def event(self, kind: str, detail: str) -> None:
        self._events.append(Event(at=time.time(), node=self._me.node_id, kind=kind, detail=detail))
        self._due.set()

    def steps(self, report: StepReport) -> None:
        self._steps = report
        self._due.set()

    def _steps_due_in(self) -> float | None:
        """Seconds until the pending step report may go (None: none pending)."""
        if self._steps is None:
            return None
        return max(self._steps_published_at + self._steps_interval - time.monotonic(), 0.0)

    async def publish(self, lease: int) -> None:
        """Publish for as long as the node holds `lease` (until cancelled)."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._steps_due_in()):
                    await self._due.wait()
            try:
                await self.flush(lease)
            except StoreError as e:
                log.debug("could not publish this node's status: %s", e)
            await asyncio.sleep(REPORT_INTERVAL)

    async def flush(self, lease: int) -> None:
        """Publish what is pending now (lease 0: events only, the node is gone)."""
        self._due.clear()
        keys, store = self._keys, self._store
        if lease and self._status_dirty and self._status is not None:
            self._status_dirty = False
            await store.put(keys.status(self._me.node_id), encode(self._node_status(self._status)), lease=lease)
        while lease and self._dirty_logs:
            rank = self._dirty_logs.pop()
            window = LogWindow(rank=rank, node_id=self._me.node_id, lines=tuple(self._windows[rank]))
            await store.put(keys.log(rank), encode(window), lease=lease)
        while self._events:
            event = self._events.pop(0)
            await store.put(keys.event(event.at, event.node), encode(event))
        if lease and self._steps is not None and self._steps_due_in() == 0.0:
            report, self._steps = self._steps, None
            self._steps_published_at = time.monotonic()
            await store.put(keys.step_report(self._me.node_id), encode(report), lease=lease)

    async def keep(self, ttl: float) -> None:
        """Publish this node's last status and output windows again, on a lease that lives `ttl`.

        `ttl` is the job's closed_ttl: the node is done with an ended job, and `status`
        and `logs` should still tell what happened, not go blank with its membership."""
        if self._status is None and not self._windows:
            return
        lease = await self._store.grant_lease(ttl)
        self._dirty_logs.update(self._windows)
        self._status_dirty = self._status is not None
        await self.flush(lease)

    def _node_status(self, status: AgentStatus) -> NodeStatus:
        a, me = status.assignment, self._me
        return NodeStatus(
            node_id=me.node_id,
            host=me.host,
            addr=me.addr,
            state=status.state,
            reason=status.reason,
            round=a.round if a else 0,
            node_rank=a.node_rank if a else -1,
            ranks=f"{a.rank_offset}-{a.rank_offset + me.nproc - 1}" if a else "",
            world_size=a.world_size if a else 0,
            restarts=a.restart_count if a else 0,
            attempt=status.attempt,
            pids=status.pids,
            gpus=me.gpus,
            started_at=me.started_at,
            updated_at=time.time(),
            standby=status.standby,
            state_held=status.state_held,
            state_replicated=status.state_replicated,
        )
