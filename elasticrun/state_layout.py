"""The layout of a state file: what the agent and the worker both read in it.

A state file (elasticrun.agent.state_files makes them) holds SLOTS slots and, in its
first page, one record per slot, then two words that pin commits:

    [record 0] .. [record 3] [pins] [ack] | slot 0 | slot 1 | slot 2 | slot 3 |

A slot holds one commit: the bytes of its tensors, each at a 64-byte boundary, then its
structure (elasticrun.worker.elastic.structure, nothing pickled). A record says what its
slot holds (a generation number, the commit count, the round, rank and world size it was
made at, where the structure is) with a CRC-32 over all that and the structure, so a
record torn in its own write, or a slot whose structure was overwritten since, reads as
no commit.

A new commit goes to a free slot: one that holds neither the newest commit (so a worker
killed while it writes leaves the previous one whole) nor a pinned one. Pins are a
ShardedState's (elasticrun.worker.elastic.buddy_pins): the commit its agent is to copy
to the buddy node (the candidate) and the last one every rank's buddy holds (the safe
one), kept in every rank's file until a newer one is safe, so that a node lost at any
moment leaves one commit held for each of its ranks by a buddy and by every other rank.
The worker writes the pins; the agent writes the ack: the generation of the candidate
its buddy holds. A replica file (elasticrun.agent.state_replicas) pins the last two
candidates its sender sent: its agent writes them. A pin read torn names a wrong commit
at worst, whose ack then matches no candidate: the copy waits a look. A State pins
nothing, and its commits take two slots of the four.

Only the worker writes commits to a file (elasticrun.worker.elastic.host_copy, which
imports torch), or the agent, with what a buddy sent; this module needs no torch, so
that the agent can say which commit each file holds.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import zlib
from dataclasses import dataclass

from elasticrun.errors import StateMemoryError

#: what names a worker's state file in its environment (the agent sets it in restart mode)
STATE_FILE_VAR = "ELASTICRUN_STATE_FILE"
#: the generations of the commits in that file that its agent fetched from a buddy node
#: (comma-separated; elasticrun.agent.state_replicas): a restore from one says so
STATE_BUDDY_VAR = "ELASTICRUN_STATE_BUDDY"
#: the replica files this node holds of its predecessor's ranks (comma-separated paths),
#: given to local rank 0: a ShardedState at a new world size offers their commits too
STATE_REPLICAS_VAR = "ELASTICRUN_STATE_REPLICAS"

#: the slots of a file: the newest commit, the one being written, and the two pinned
SLOTS = 4
#: the first page: the records, the pins, the ack
HEADER_BYTES = 4096
ALIGN = 64
MAGIC = b"ERSTATE1"
#: magic, generation, commits, round, rank, world size, structure offset, structure length
RECORD = struct.Struct("<8sQqqqqQQ")
CRC = struct.Struct("<I")
RECORD_BYTES = RECORD.size + CRC.size
RECORD_SPACING = 512
#: where the worker's pins are: (the candidate's generation, the safe commit's); 0: none
PINS_AT = 3072
PINS = struct.Struct("<QQ")
#: where the agent's ack is: the generation of the candidate the buddy node holds
ACK_AT = 3584
ACK = struct.Struct("<Q")
#: the largest structure a record may name (elasticrun.worker.elastic.structure's bound)
MAX_STRUCTURE_BYTES = 64 << 20

#: a file's bytes, as mapped or as read
FileBytes = bytes | memoryview | mmap.mmap


@dataclass(frozen=True)
class Record:
    """What one slot holds: a whole commit."""

    slot: int
    generation: int
    commits: int
    round: int
    rank: int
    world: int
    structure_at: int
    structure_bytes: int


def reserve(fd: int, at: int, length: int, no_room: str) -> None:
    """Make the tmpfs hold bytes [at, at + length) of file `fd` before they are written.

    A full tmpfs is then StateMemoryError(`no_room`) here, never a SIGBUS in the middle of a copy."""
    try:
        os.posix_fallocate(fd, at, length)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EFBIG):
            raise
        raise StateMemoryError(no_room) from None


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def slot_bytes_of(file_bytes: int) -> int:
    """Each slot's bytes in a file of `file_bytes`: a SLOTS-th of what is left after the first page, in whole pages."""
    return (file_bytes - HEADER_BYTES) // SLOTS // mmap.PAGESIZE * mmap.PAGESIZE


def mapped_bytes(slot_bytes: int) -> int:
    """The bytes of a file that its first page and its slots take."""
    return HEADER_BYTES + SLOTS * slot_bytes


def slot_start(slot: int, slot_bytes: int) -> int:
    return HEADER_BYTES + slot * slot_bytes


def record_at(data: FileBytes, slot: int, slot_bytes: int) -> Record | None:
    """The whole commit slot `slot` of a file's bytes `data` holds, or None (none, or torn)."""
    view = memoryview(data)
    at = slot * RECORD_SPACING
    raw = bytes(view[at : at + RECORD_BYTES])
    record = parsed_record(raw, slot, slot_bytes)
    if record is None:
        return None
    start = slot_start(slot, slot_bytes) + record.structure_at
    return record if crc_holds(raw, view[start : start + record.structure_bytes]) else None


def parsed_record(raw: bytes, slot: int, slot_bytes: int) -> Record | None:
    """The fields of a record's bytes `raw` for a slot of `slot_bytes`, unchecked against its CRC; None if not one.

    Also how a record that came over the network (elasticrun.agent.replica_wire) is
    first judged: its commit must fit in a slot before a byte of it is taken."""
    if len(raw) != RECORD_BYTES:
        return None
    magic, generation, commits, round_, rank, world, where, length = RECORD.unpack_from(raw)
    if magic != MAGIC or not 0 < length <= MAX_STRUCTURE_BYTES or where + length > slot_bytes:
        return None
    return Record(slot, generation, commits, round_, rank, world, where, length)


def crc_holds(raw: bytes, structure: FileBytes) -> bool:
    """Whether record bytes `raw` match the structure they name: the commit is whole."""
    crc = zlib.crc32(structure, zlib.crc32(raw[: RECORD.size]))
    return bool(CRC.unpack_from(raw, RECORD.size)[0] == crc)


def held(data: FileBytes, slot_bytes: int) -> list[Record]:
    """The whole commits a file's bytes hold (up to SLOTS), oldest first."""
    records = [r for r in (record_at(data, slot, slot_bytes) for slot in range(SLOTS)) if r is not None]
    return sorted(records, key=lambda r: r.generation)


def pins(data: FileBytes) -> tuple[int, int]:
    """The generations a file's worker pinned: (the candidate, the safe commit); 0 where none."""
    candidate, safe = PINS.unpack_from(data, PINS_AT)
    return candidate, safe


def set_pins(data: mmap.mmap, candidate: int, safe: int) -> None:
    """Pin the commits of generations `candidate` and `safe` (0: none) in a file's mapping `data`."""
    data[PINS_AT : PINS_AT + PINS.size] = PINS.pack(candidate, safe)


def ack(data: FileBytes) -> int:
    """The generation of the candidate the agent's buddy node holds (0: none)."""
    return int(ACK.unpack_from(data, ACK_AT)[0])


def set_ack(data: mmap.mmap, generation: int) -> None:
    """Say in a file's mapping `data` that the buddy node holds the commit of `generation`."""
    data[ACK_AT : ACK_AT + ACK.size] = ACK.pack(generation)


def free_slot(data: FileBytes, slot_bytes: int, keep: frozenset[int] = frozenset()) -> int:
    """The first slot that holds neither the newest commit, nor a pinned one, nor one of the slots `keep`.

    Where a new commit goes. (SLOTS leave one: the newest, two pins, and the one written.)"""
    records = held(data, slot_bytes)
    busy = set(keep) | {r.slot for r in records if r.generation in pins(data)}
    if records:
        busy.add(records[-1].slot)
    return min(set(range(SLOTS)) - busy)


def packed_record(
    generation: int, commits: int, round_number: int, rank: int, world: int, structure_at: int, structure: bytes
) -> bytes:
    """A slot's record, its CRC over the fields and the structure."""
    fields = RECORD.pack(MAGIC, generation, commits, round_number, rank, world, structure_at, len(structure))
    return fields + CRC.pack(zlib.crc32(structure, zlib.crc32(fields)))
