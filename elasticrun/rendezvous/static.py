"""`--rdzv-backend=static`: a fixed place in a fixed-size job, no elasticity.

As torchrun's static backend: every node is told its rank and the master address on the
command line, nothing is negotiated, and a restart after a worker failure is decided
locally (the workers meet again at MASTER_ADDR:MASTER_PORT). It needs no store, which also
makes it the handler the agent's own tests run on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from elasticrun.errors import RendezvousClosedError, RendezvousError, UsageError
from elasticrun.loglines import HEADLINE
from elasticrun.rendezvous.handler import Assignment, JobControl, RendezvousHandler

logger = logging.getLogger("elasticrun.rendezvous")


def _waits_for(place: Assignment) -> str:
    """What a static node's workers wait for.

    Nothing is negotiated, so nobody else can tell that a node is missing (the workers
    block in init_process_group, silent)."""
    at = f"{place.master_addr}:{place.master_port}"
    if place.node_rank == 0:
        others = "node rank 1" if place.node_count == 2 else f"node ranks 1-{place.node_count - 1}"
        return (
            f"static rendezvous: node rank 0 of {place.node_count}: its rank-0 worker hosts the job's store at "
            f"{at}; the workers wait there for {others} (each started with its own --node-rank)"
        )
    return (
        f"static rendezvous: node rank {place.node_rank} of {place.node_count}: the workers wait for node rank 0, "
        f"whose rank-0 worker hosts the job's store at {at}, and for every other node rank"
    )


class StaticRendezvous(RendezvousHandler):
    """One fixed assignment; each restart request yields it again, one restart later."""

    def __init__(
        self,
        run_id: str,
        *,
        node_rank: int,
        nnodes: int,
        nproc_per_node: int,
        master_addr: str,
        master_port: int,
    ) -> None:
        if nnodes < 1:
            raise UsageError(f"--nnodes must be at least 1, got {nnodes}")
        if not 0 <= node_rank < nnodes:
            raise UsageError(
                f"--node-rank must be in [0, {nnodes - 1}] for --nnodes={nnodes}, "
                f"got {node_rank}"
            )
        if not 0 < master_port < 65536:
            raise UsageError(f"--master-port must be in [1, 65535], got {master_port}")
        self.run_id = run_id
        self.control = JobControl()  # no store: nothing to publish, no job to ask
        self._next: Assignment | None = Assignment(
            round=0,
            node_rank=node_rank,
            node_count=nnodes,
            rank_offset=node_rank * nproc_per_node,
            world_size=nnodes * nproc_per_node,
            master_addr=master_addr,
            master_port=master_port,
            restart_count=0,
        )
        self._current: Assignment | None = None
        self._closed: RendezvousClosedError | None = None

    async def next_round(self) -> Assignment:
        if self._closed is not None:
            raise self._closed
        if self._next is None:
            raise RendezvousError(
                f"static rendezvous '{self.run_id}': no new round without a restart "
                "request"
            )
        if self._current is None and self._next.node_count > 1:  # once: nothing else will say it
            logger.info("%s", _waits_for(self._next), extra=HEADLINE)
        self._current, self._next = self._next, None
        return self._current

    @property
    def waiting_status(self) -> str | None:
        if self._closed is not None:
            return None
        place = self._next or self._current
        assert place is not None  # one of them is set until the rendezvous closes
        return (
            f"static rendezvous: node rank {place.node_rank} of {place.node_count}, "
            f"master {place.master_addr}:{place.master_port}"
        )

    async def round_ended(self) -> str:
        """Never: membership is fixed, so nothing here ends a round."""
        never: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        return await never

    async def request_restart(self, reason: str, *, forgiven: bool = False) -> None:
        if self._current is None:
            raise RendezvousError("request_restart() before any round")
        self._next = dataclasses.replace(
            self._current,
            round=self._current.round + 1,
            restart_count=self._current.restart_count + 1,
            forgiven=self._current.forgiven + forgiven,
        )
        logger.info("static rendezvous: restart requested: %s", reason)

    async def fail(self, report: str) -> None:
        self._closed = RendezvousClosedError(self.run_id, "failed", report)

    async def finish(self) -> None:
        self._closed = RendezvousClosedError(self.run_id, "succeeded")

    async def leave(self, reason: str, *, keep_out: bool = False) -> None:
        self._closed = RendezvousClosedError(self.run_id, "stopped", reason)
