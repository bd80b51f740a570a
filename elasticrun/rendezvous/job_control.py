"""ElasticJobControl: one node's reports and the job's stacks, over its membership.

The elastic rendezvous's side of `JobControl` (`rendezvous/handler.py`): the node's status,
output, events and step timing published for `elasticrun status`, `logs` and the
leader's straggler check (`reports.py`), and the job-wide stacks (`stacks.py`): a
request every node answers, the answers gathered by whoever asked, the summary written
back. None of it decides membership; it reads what the membership knows (`Membership`,
which `ElasticRendezvous` is) and publishes under the node's lease while it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Protocol

from elasticrun.errors import StoreError
from elasticrun.first_of import first_of
from elasticrun.rendezvous.codec import decode, encode
from elasticrun.rendezvous.handler import AgentStatus, JobControl
from elasticrun.rendezvous.job_records import JobRecords
from elasticrun.rendezvous.keys import Keys
from elasticrun.rendezvous.records import NodeStacks, ReplicaPost, StacksRequest, StepReport
from elasticrun.rendezvous.reports import Reporter
from elasticrun.rendezvous.rounds import RoundHead
from elasticrun.rendezvous.stacks import ANSWER_WAIT, JobStacks, answer, ask, conclude, gather, new_request
from elasticrun.rendezvous.stragglers import Judgement
from elasticrun.store.interface import Store

log = logging.getLogger("elasticrun.rendezvous")

#: how much longer than whoever asked a node that joined a request for the job's stacks
#: waits for the summary (whoever asked waits ANSWER_WAIT for the answers, then writes it)
SUMMARY_MARGIN = 2.0


class Membership(Protocol):
    """What job control reads of this node's membership (`ElasticRendezvous`)."""

    @property
    def job(self) -> JobRecords:
        """What this node knows of the job's records."""

    @property
    def ran(self) -> RoundHead | None:
        """The round this node last ran."""

    @property
    def last_round(self) -> int:
        """The number of the round this node last ran (0: none yet)."""

    def live_lease(self) -> int | None:
        """This node's lease while its membership holds; None before it registers or once lost."""

    async def changed(self, timeout: float | None = None) -> None:
        """Wait until what this node knows of the job changes, or `timeout` passes."""

    def judgement(self) -> Judgement | None:
        """The straggler verdict of the leader this node runs; None when it does not lead."""


class ElasticJobControl(JobControl):
    """This node's job control, published under its membership's lease."""

    def __init__(
        self,
        member: Membership,
        store: Store,
        keys: Keys,
        node_id: str,
        reports: Reporter,
        *,
        addr: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.addr = addr
        self._member = member
        self._store = store
        self._keys = keys
        self._node_id = node_id
        self._reports = reports
        self._clock = clock
        #: the revision of the latest request for the job's stacks this node answered,
        #: and when (self._clock) this node's watch brought the request record last
        self._stacks_answered = 0
        self._stacks_seen_at = -math.inf

    def saw_stacks_request(self) -> None:
        """The node's watch brought the request record (a request, or its summary)."""
        self._stacks_seen_at = self._clock()

    async def post_replicas(self, node_rank: int, post: ReplicaPost) -> None:
        lease = self._member.live_lease()
        if lease is not None:
            await self._store.put(self._keys.replica(node_rank), encode(post), lease=lease)

    async def replica_post(self, node_rank: int, round_number: int, timeout: float) -> ReplicaPost | None:
        """Read, then watch from that read on: one key, however large the job.

        None too once a later round opened: that node will never post in this one."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                return await first_of(self._post_of(node_rank, round_number), self._round_after(round_number))
        return None

    async def _post_of(self, node_rank: int, round_number: int) -> ReplicaPost | None:
        key = self._keys.replica(node_rank)
        now = await self._store.get_prefix(key)
        for kv in now.kvs:
            if kv.key == key and (post := decode(ReplicaPost, kv.value)).round >= round_number:
                return post
        async for event in self._store.watch(key, start_revision=now.revision + 1):
            if event.value and (post := decode(ReplicaPost, event.value)).round >= round_number:
                return post
        return None

    async def _round_after(self, round_number: int) -> None:
        while (head := self._member.job.head) is None or head.number <= round_number:
            await self._member.changed()

    async def stacks_asked(self) -> StacksRequest:
        while True:
            request, revision = self._member.job.stacks, self._member.job.stacks_revision
            if request is not None and not request.done and revision > self._stacks_answered:
                self._stacks_answered = revision
                if request.round == self._member.last_round:  # else: about workers this node no longer runs
                    return request
            await self._member.changed()

    async def answer_stacks(self, stacks: NodeStacks) -> None:
        lease = self._member.live_lease()
        if lease is None:
            return
        try:
            await answer(self._store, self._keys, stacks, lease)
        except StoreError as e:
            log.debug("could not publish this node's stacks: %s", e)

    async def job_stacks(self, mine: NodeStacks, reason: str) -> JobStacks | None:
        """The first request stands.

        A node that finds one of its round made moments ago (all the watchdogs of a hung
        job fire at once), done or not, or that loses the race to write its own, takes
        part in it, and only whoever asked reads the answers."""
        lease, ran = self._member.live_lease(), self._member.ran
        if lease is None or ran is None:
            return None
        store, keys = self._store, self._keys
        try:
            current, at = self._member.job.stacks, self._member.job.stacks_revision
            recent = self._clock() - self._stacks_seen_at < ANSWER_WAIT
            if current is None or current.round != ran.number or not recent:
                request = new_request(self._node_id, reason, ran.number, ran.nodes)
                revision = await ask(store, keys, request, at)
                if revision is not None:
                    self._stacks_answered = max(self._stacks_answered, revision)
                    await answer(store, keys, replace(mine, request=request.id), lease)
                    answers = await gather(store, keys, request.id, revision, ran.nodes, ANSWER_WAIT)
                    done = await conclude(store, keys, request, revision, list(answers.values()))
                    return JobStacks(done, tuple(answers.values()))
                kv = await store.get(keys.stacks)  # another request came first: take part in it
                if kv is None:
                    return None
                current, at = decode(StacksRequest, kv.value), kv.mod_revision
            if current.done:
                return JobStacks(current)
            await answer(store, keys, replace(mine, request=current.id), lease)
            return await self._summary_of(current.id, at)
        except StoreError as e:
            log.debug("could not ask the job's nodes for their stacks: %s", e)
            return None

    async def _summary_of(self, request_id: str, revision: int) -> JobStacks | None:
        """Request `request_id` (written at `revision`), once whoever asked concluded it (bounded wait).

        None if it did not in time, or a newer request replaced it."""
        deadline = self._clock() + ANSWER_WAIT + SUMMARY_MARGIN
        while (left := deadline - self._clock()) > 0:
            current = self._member.job.stacks
            if current is not None and current.id == request_id and current.done:
                return JobStacks(current)
            if current is not None and current.id != request_id and self._member.job.stacks_revision > revision:
                return None
            await self._member.changed(left)
        return None

    def report_status(self, status: AgentStatus) -> None:
        self._reports.status(status)

    def report_output(self, rank: int, stream: str, lines: list[str]) -> None:
        self._reports.output(rank, stream, lines)

    def report_event(self, kind: str, detail: str) -> None:
        self._reports.event(kind, detail)

    def report_steps(self, report: StepReport) -> None:
        self._reports.steps(report)

    def straggler_scores(self) -> Mapping[str, tuple[float, float, bool]]:
        judgement = self._member.judgement()
        if judgement is None:
            return {}
        return {n: (s.relative, s.individual, n in judgement.named) for n, s in judgement.scored().items()}
