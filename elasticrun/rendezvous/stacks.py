"""Every node's workers' stacks, job-wide: the request, the answers, the summary.

Whoever wants the job's stacks (an agent whose watchdog found a hang, `elasticrun
stacks`) writes a `StacksRequest` to `r/job/stacks`, which every node's job watch
brings it (one event per node: no new watch, nothing read); each node running workers
captures them and puts its `NodeStacks` at `c/stacks/<node id>` on its lease, so they
go with the node; whoever asked watches `c/stacks/` until every node of the round has
answered or `ANSWER_WAIT` has passed, and writes the request again, `done`, with the
summary: every node's watch brings that too, and `elasticrun status` shows it.

Only whoever asked reads the answers (a few KB a node, once per request). When every
node's watchdog fires at once (a hang stops every rank's progress), the first request
stands and the others join it (`ask` is a compare-and-put): one node reads the
answers, not all of them.

What a node publishes is bounded (`bounded`): `FRAMES` frames a thread (never cutting
off the innermost frame of user code, which the summary names), `THREADS` threads a
rank, `NODE_BYTES` a node. The whole stacks stay in the node's run folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from elasticrun.errors import RendezvousError
from elasticrun.rendezvous.codec import decode, encode
from elasticrun.rendezvous.keys import Keys
from elasticrun.rendezvous.records import NodeStacks, RankStacks, StacksRequest, ThreadStack
from elasticrun.rendezvous.stack_summary import is_library, summarise
from elasticrun.store.interface import EventType, Store

#: how long whoever asked waits for the nodes' answers
ANSWER_WAIT = 5.0
#: what one node publishes at most: frames a thread, threads a rank, bytes in all
FRAMES = 32
THREADS = 8
NODE_BYTES = 32 * 1024


@dataclass(frozen=True, slots=True)
class JobStacks:
    """A job-wide capture as whoever took part in it knows it.

    The request (done, with the summary, once concluded) and the answers (only whoever
    asked reads them)."""

    request: StacksRequest
    answers: tuple[NodeStacks, ...] = ()


def new_request(by: str, reason: str, round_number: int, nodes: int) -> StacksRequest:
    return StacksRequest(
        id=secrets.token_hex(6), by=by, reason=reason, at=time.time(), round=round_number, nodes=nodes
    )


async def ask(store: Store, keys: Keys, request: StacksRequest, expected_revision: int) -> int | None:
    """Write `request` unless the record changed since `expected_revision` (another request came first).

    The revision it was written at, or None."""
    if not await store.compare_and_put(keys.stacks, encode(request), expected_mod_revision=expected_revision):
        return None
    kv = await store.get(keys.stacks)
    if kv is None or decode(StacksRequest, kv.value).id != request.id:
        return None
    return kv.mod_revision


async def answer(store: Store, keys: Keys, stacks: NodeStacks, lease: int) -> None:
    """Publish a node's stacks (bounded) on its lease."""
    await store.put(keys.stack_answer(stacks.node_id), encode(bounded(stacks)), lease=lease)


async def gather(
    store: Store, keys: Keys, request_id: str, after: int, nodes: int, timeout: float
) -> dict[str, NodeStacks]:
    """The answers to request `request_id` by node, once `nodes` have answered or after `timeout` s.

    The request was written at revision `after`."""
    answers: dict[str, NodeStacks] = {}
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            async for event in store.watch(keys.stack_answers, start_revision=after + 1, prefix=True):
                if event.type is not EventType.PUT:
                    continue
                try:
                    stacks = decode(NodeStacks, event.value)
                except RendezvousError:
                    continue
                if stacks.request == request_id:
                    answers[stacks.node_id] = stacks
                if len(answers) >= nodes:
                    break
    return answers


async def conclude(
    store: Store, keys: Keys, request: StacksRequest, revision: int, answers: Sequence[NodeStacks]
) -> StacksRequest:
    """The request, done, with the summary of `answers`.

    Written back unless a newer request replaced it meanwhile."""
    ranks = [r for node in answers for r in node.ranks]
    summary = (*summarise(ranks), *left_out(answers))
    done = replace(request, answered=len(answers), summary=summary, done=True)
    await store.compare_and_put(keys.stacks, encode(done), expected_mod_revision=revision)
    return done


async def latest(store: Store, keys: Keys) -> list[NodeStacks]:
    """Every node's latest published stacks (to whatever request they answered)."""
    found = []
    for kv in (await store.get_prefix(keys.stack_answers)).kvs:
        with contextlib.suppress(RendezvousError):
            found.append(decode(NodeStacks, kv.value))
    return found


# --- bounds ------------------------------------------------------------------------------


def _cut_thread(thread: ThreadStack, frames: int) -> ThreadStack:
    user = next((i for i, f in enumerate(thread.frames) if not is_library(f.file)), -1)
    keep = max(frames, user + 1)
    if len(thread.frames) <= keep:
        return thread
    return replace(thread, frames=thread.frames[:keep], more=thread.more + len(thread.frames) - keep)


def _cut_rank(stacks: RankStacks, frames: int, threads: int) -> RankStacks:
    kept = tuple(_cut_thread(t, frames) for t in stacks.threads[:threads])
    dropped = len(stacks.threads) - len(kept)
    return replace(stacks, threads=kept, more_threads=stacks.more_threads + dropped)


def bounded(
    stacks: NodeStacks, frames: int = FRAMES, threads: int = THREADS, limit: int = NODE_BYTES
) -> NodeStacks:
    """`stacks` within the bounds.

    Fewer threads and frames until the record fits in `limit` bytes; past one thread of
    one frame, the last ranks are left out (counted)."""
    while True:
        cut = replace(stacks, ranks=tuple(_cut_rank(r, frames, threads) for r in stacks.ranks))
        if len(encode(cut)) <= limit:
            return cut
        if frames == 1 and threads == 1:
            break
        frames, threads = max(frames // 2, 1), max(threads // 2, 1)
    kept = len(cut.ranks)
    while kept and len(encode(replace(cut, ranks=cut.ranks[:kept], left_out=len(cut.ranks) - kept))) > limit:
        kept = kept * 3 // 4 if kept > 8 else kept - 1
    return replace(cut, ranks=cut.ranks[:kept], left_out=stacks.left_out + len(cut.ranks) - kept)


def left_out(answers: Sequence[NodeStacks]) -> list[str]:
    """A line for each node that left ranks out of its answer."""
    return [
        f"{n.left_out} ranks of node {n.node_id} left out (too large for the store; its run folder has them)"
        for n in answers
        if n.left_out
    ]
