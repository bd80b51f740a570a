"""Who serves the job's store after the agent that serves it now: its successors.

The serving agent names the first members of each round by node rank (itself left
out) in `r/job/successors` (`name_successors`); each successor keeps a copy of the
job's records in a store of its own, fed by a watch of the serving store (`follow`),
and serves it once every node before it is gone (`predecessors_gone`). Written over the
`Store` interface: the launcher gives the engine, serves it, and says when
(launcher/succession.py). docs/concepts.md, "When the store's host goes", says why.
"""

from __future__ import annotations

import asyncio
import logging
from typing import NoReturn

from elasticrun.first_of import first_of
from elasticrun.rendezvous.codec import decode, encode
from elasticrun.rendezvous.job_records import JobRecords
from elasticrun.rendezvous.keys import Keys
from elasticrun.rendezvous.liveness import Verdict, probe
from elasticrun.rendezvous.records import NodeInfo, Successor, Successors
from elasticrun.rendezvous.rounds import Round
from elasticrun.store.interface import EventType, Store

log = logging.getLogger("elasticrun.rendezvous")

#: how many successors the serving agent names: the second serves only when the first is
#: gone too
SUCCESSORS = 2
#: the fewest nodes a round needs for its successors to be named: without its host, a
#: round of two has no majority left (`quorum`), so it cannot fail over
MIN_NODES_TO_FAIL_OVER = 3


def quorum(nodes: int) -> int:
    """A majority of a round of `nodes` nodes: the two sides of a partition never both have one."""
    return nodes // 2 + 1


def endpoint_at(addr: str, port: int) -> str:
    """host:port, an IPv6 address in brackets."""
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def successors_of(
    current: Round, serving: str, nodes: dict[str, NodeInfo], port: int, ranks: str = ""
) -> Successors | None:
    """Who takes the store over from `serving` after round `current`; None when it cannot fail over.

    The first members by node rank but the serving node, registered (for the address
    and the liveness port they serve and answer at)."""
    if len(current.participants) < MIN_NODES_TO_FAIL_OVER or current.closed:
        return None
    named = []
    for member in current.participants:
        info = nodes.get(member.node_id)
        if member.node_id == serving or info is None or not info.liveness_port:
            continue
        named.append(Successor(info.node_id, endpoint_at(info.addr, port), info.addr, info.liveness_port))
        if len(named) == SUCCESSORS:
            break
    if not named:
        return None
    return Successors(serving=serving, round=current.number, quorum=quorum(len(current.participants)),
                      nodes=tuple(named), ranks=ranks)


async def name_successors(store: Store, keys: Keys, serving: str, port: int) -> NoReturn:
    """Name the successors of each round that opens, for as long as this agent serves `store`.

    Reads the round and the registrations as they change (the serving agent reads its
    own engine: no network). A round too small to fail over keeps the record of the
    last one that was not: its nodes may still serve elsewhere, and the majority rule
    (`round_policy._no_majority`) must go on counting them."""
    records = JobRecords(keys)
    snapshot = await store.get_prefix(keys.rdzv)
    for kv in snapshot.kvs:
        records.apply(kv.key, kv.value, kv.mod_revision)
    named_round = records.successors.round if records.successors is not None else 0
    revision = snapshot.revision + 1
    while True:
        current = records.round
        if current is not None and current.number > named_round:
            ranks = records.head.ranks if records.head is not None else ""
            wanted = successors_of(current, serving, records.nodes, port, ranks)
            if wanted is not None:
                await store.put(keys.successors, encode(wanted))
                named_round = wanted.round
                log.info(
                    "the store's successors after round %d: %s", wanted.round,
                    ", ".join(f"{s.node_id} ({s.endpoint})" for s in wanted.nodes),
                )
        async for event in store.watch(keys.rdzv, start_revision=revision, prefix=True):
            revision = event.revision + 1
            records.apply(event.key, event.value if event.type is EventType.PUT else None, event.revision)
            if event.key == keys.round or event.key.startswith(keys.ranks):
                break


def copied(keys: Keys, key: str) -> bool:
    """Whether a successor copies `key`: the job's records that outlive their writers.

    What is bound to a lease (registrations, acks, the leader's keys, statuses, output
    windows, step reports) belongs to agents that register again at the new store, and
    a pending restart request to a round that is over."""
    return (
        key in (keys.spec, keys.launch, keys.round, keys.quarantine, keys.successors)
        or key.startswith((keys.ranks, keys.holds, keys.drains, keys.departures, keys.events))
    )


async def follow(source: Store, copy: Store, keys: Keys) -> None:
    """Keep `copy` holding what `source` holds of the job's copied records (`copied`).

    Read once, then followed by two watches (r/ and the events: never the busy output
    windows); returns never, raises what the source raises (StoreGoneError: its agent
    is gone)."""
    await first_of(_follow(source, copy, keys, keys.rdzv), _follow(source, copy, keys, keys.events))


async def _follow(source: Store, copy: Store, keys: Keys, prefix: str) -> None:
    snapshot = await source.get_prefix(prefix)
    await copy.delete_prefix(prefix)
    for kv in snapshot.kvs:
        if copied(keys, kv.key):
            await copy.put(kv.key, kv.value)
    async for event in source.watch(prefix, start_revision=snapshot.revision + 1, prefix=True):
        if not copied(keys, event.key):
            continue
        if event.type is EventType.PUT:
            await copy.put(event.key, event.value)
        else:
            await copy.delete(event.key)


async def predecessors_gone(successors: Successors, me: str) -> bool:
    """Whether no successor named before `me` answers: its liveness port refuses, or is silent.

    The serving agent before them is known gone or cut off by whoever asks (its store
    refused them, or did not answer for longer than a lease). One cut off may serve
    the other side of a partition: the majority rule, not this, keeps the two sides
    from both training (`round_policy._no_majority`)."""
    before = []
    for node in successors.nodes:
        if node.node_id == me:
            break
        before.append(node)
    verdicts = await asyncio.gather(*(probe(n.addr, n.liveness_port) for n in before))
    return all(v is not Verdict.LISTENING for v in verdicts)


def named(successors: Successors | None, me: str) -> bool:
    return successors is not None and any(n.node_id == me for n in successors.nodes)


async def read_successors(store: Store, keys: Keys) -> Successors | None:
    kv = await store.get(keys.successors)
    return decode(Successors, kv.value) if kv is not None else None
