"""A round, as the leader decides it (`Round`) and as it is stored: a head and its shards.

A round is stored in two parts so that what a node reads of it does not grow with the
job: the head (`r/job/round`, a few hundred bytes, seen by every node's watch) and
its members in shards of about `SHARD_SIZE` (`r/ranks/`, which no node watches); a
node reads the one shard its id hashes to (`shard_of`). A round's bytes are then O(N)
in total, not O(N) to every node. The leader, which watches `r/`, and job control,
which reads the whole job, put the shards back together into the `Round` that
`decide_round()` made (`JobRecords.round`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, fields

#: members per stored round shard, on average: what one node reads of a round
SHARD_SIZE = 64


@dataclass(frozen=True, slots=True)
class Participant:
    """A node's place in a round: the order of participants is the node rank."""

    node_id: str
    addr: str
    nproc: int


@dataclass(frozen=True, slots=True)
class Round:
    """One round of the job, as the leader decided it.

    A round with no participants stops every group without starting one: it is what the
    leader writes when a node is lost and fewer than `min` remain. A round with `closed`
    set is the job's end ("succeeded", "failed", "stopped"); `detail` says why.
    """

    number: int
    participants: tuple[Participant, ...]
    restart_count: int
    reason: str
    opened_at: float  # wall-clock time
    closed: str = ""
    detail: str = ""
    #: of `restart_count`, the restarts forgiven because the workers had made progress
    #: since the previous failure (--forgive-progress): not counted against the budget
    forgiven: int = 0

    def node_ranks(self) -> dict[str, int]:
        """Each participant's node rank, by node id.

        Built once by a caller that looks up many nodes (a lookup per node that scanned
        the members was O(N^2) a round, seconds of the leader's loop at 10,000 nodes)."""
        return {p.node_id: rank for rank, p in enumerate(self.participants)}

    @property
    def world_size(self) -> int:
        return sum(p.nproc for p in self.participants)


@dataclass(frozen=True, slots=True)
class RoundHead:
    """A round as every node sees it (r/job/round): all of `Round` but its members.

    `nodes` and `world_size` are the round's; its members are in `shards` records
    (`RankShard`). `kept_since` is the oldest round number all of whose members are
    still in this one (so far as each round kept all of the one before): a node that
    ran round r lost a peer if `kept_since > r`.
    """

    number: int
    restart_count: int
    reason: str
    opened_at: float
    closed: str = ""
    detail: str = ""
    forgiven: int = 0
    nodes: int = 0
    world_size: int = 0
    shards: int = 0
    #: the folder of its shards under r/ranks/: the round number and the leader that
    #: wrote them, so that a stale leader's shards never mix with the round's
    ranks: str = ""
    kept_since: int = 0
    #: when the job was closed (wall clock; 0 while open)
    closed_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Placed:
    """A member of a round: its node rank and the global rank of its first worker."""

    node_id: str
    addr: str
    nproc: int
    rank: int
    offset: int


@dataclass(frozen=True, slots=True)
class RankShard:
    """The members of round `round` whose node id hashes to this shard (`shard_of`)."""

    round: int
    placed: tuple[Placed, ...]


def shard_of(node_id: str, shards: int) -> int:
    """The shard that holds `node_id`'s place: a stable hash, the same on every host."""
    return zlib.crc32(node_id.encode()) % max(shards, 1)


#: the fields a round's head copies from the `Round`, and back
_HEAD_FIELDS = tuple(f.name for f in fields(Round) if f.name != "participants")


def split_round(
    new: Round, leader: str, before: RoundHead | None, previous: Round | None
) -> tuple[RoundHead, list[RankShard]]:
    """`new` as stored by `leader`: its head and its shards.

    `before` and `previous` are the round it follows (head and members), for
    `kept_since`."""
    count = len(new.participants)
    shards = math.ceil(count / SHARD_SIZE)
    members = {p.node_id for p in new.participants}
    kept = (
        before is not None
        and previous is not None
        and not previous.closed
        and {p.node_id for p in previous.participants} <= members
    )
    head = RoundHead(
        **{name: getattr(new, name) for name in _HEAD_FIELDS},
        nodes=count,
        world_size=new.world_size,
        shards=shards,
        ranks=f"{new.number:08d}-{leader}",
        kept_since=(before.kept_since or before.number) if kept and before else new.number,
    )
    buckets: list[list[Placed]] = [[] for _ in range(shards)]
    offset = 0
    for rank, p in enumerate(new.participants):
        buckets[shard_of(p.node_id, shards)].append(Placed(p.node_id, p.addr, p.nproc, rank, offset))
        offset += p.nproc
    return head, [RankShard(round=new.number, placed=tuple(b)) for b in buckets]


def join_round(head: RoundHead, shards: Mapping[int, RankShard]) -> Round | None:
    """The `Round` that `split_round` stored, once every shard of it is at hand."""
    complete = len(shards) >= head.shards and all(s.round == head.number for s in shards.values())
    if not complete and not head.closed:
        return None
    placed = sorted((p for s in shards.values() for p in s.placed), key=lambda p: p.rank)
    return Round(
        participants=tuple(Participant(p.node_id, p.addr, p.nproc) for p in placed),
        **{name: getattr(head, name) for name in _HEAD_FIELDS},
    )
