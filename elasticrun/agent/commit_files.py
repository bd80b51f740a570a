"""The agent's own reads and writes of a state file's commits, without torch.

A state file (elasticrun.agent.state_files) is written by its worker; a replica file
(elasticrun.agent.state_replicas) by the agent, with what a buddy node sent. Both have
the layout elasticrun.state_layout describes, and a commit moves between them as its
record plus the bytes of its slot up to the end of its structure (the tensors, then the
structure): `payload(record)`. A commit is written the way the worker writes one: into
a slot that holds neither the newest nor a pinned one (state_layout.free_slot), whose
record is cleared first and written last,
with a generation above the file's, so a copy cut short leaves the newest whole commit
as it was, and a worker reading the file takes the copy only once it is whole.

Space is reserved (`posix_fallocate`) before it is written, so a full tmpfs is a clear
StateMemoryError here, never a SIGBUS.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from elasticrun.state_layout import (
    RECORD,
    RECORD_BYTES,
    RECORD_SPACING,
    Record,
    crc_holds,
    free_slot,
    held,
    mapped_bytes,
    packed_record,
    parsed_record,
    pins,
    reserve,
    set_ack,
    set_pins,
    slot_bytes_of,
    slot_start,
)


def payload_bytes(record: Record) -> int:
    """The bytes of a commit's slot that hold it: its tensors, then its structure."""
    return record.structure_at + record.structure_bytes


class CommitFile:
    """One state or replica file, mapped by the agent."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = os.fstat(self._fd).st_size
            self.slot_bytes = slot_bytes_of(size)
            self._map = mmap.mmap(self._fd, mapped_bytes(self.slot_bytes)) if self.slot_bytes > 0 else None
        except BaseException:
            os.close(self._fd)
            raise

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
        os.close(self._fd)

    def held(self) -> list[Record]:
        """The whole commits the file holds, oldest first."""
        return held(self._map, self.slot_bytes) if self._map is not None else []

    def newest(self) -> Record | None:
        commits = self.held()
        return commits[-1] if commits else None

    def candidate(self) -> int:
        """The generation of the commit the worker pinned for the buddy node (0: none: it pins nothing)."""
        return pins(self._map)[0] if self._map is not None else 0

    def pin(self, candidate: int, safe: int) -> None:
        """Keep the commits of generations `candidate` and `safe` (0: none) from the next commits written here."""
        if self._map is not None:
            set_pins(self._map, candidate, safe)

    def acknowledge(self, generation: int) -> None:
        """Tell the worker that the buddy node holds its commit of `generation`."""
        if self._map is not None:
            set_ack(self._map, generation)

    def raw_record(self, record: Record) -> bytes:
        assert self._map is not None  # a record was read from it
        at = record.slot * RECORD_SPACING
        return bytes(self._map[at : at + RECORD_BYTES])

    def payload(self, record: Record) -> memoryview:
        """The commit's bytes, as mapped: valid while its slot is not written again (see `still`).

        Release it (a `with` block) once read: the file cannot be closed while it lives."""
        assert self._map is not None
        start = slot_start(record.slot, self.slot_bytes)
        return memoryview(self._map)[start : start + payload_bytes(record)]

    def still(self, record: Record) -> bool:
        """Whether `record`'s slot still holds that commit, whole.

        A worker clears a slot's record before it writes the slot's data: a record
        found unchanged after the data was read means the data read was that commit's."""
        return record in self.held()  # a new commit there has another generation

    # --- writing a commit that came from elsewhere --------------------------------------

    def fits(self, raw: bytes) -> Record | None:
        """The record `raw` names, if its commit fits a slot of this file; None if it is no record or too big."""
        return parsed_record(raw, 0, self.slot_bytes) if self._map is not None else None

    def begin(self, record: Record, keep: frozenset[int] = frozenset()) -> tuple[int, int]:
        """Make room for `record`'s commit: (its slot, where its bytes start in the file).

        A free slot (state_layout.free_slot), not one of the slots `keep`; its record is cleared now."""
        assert self._map is not None
        slot = free_slot(self._map, self.slot_bytes, keep)
        at = slot * RECORD_SPACING
        self._map[at : at + RECORD_BYTES] = bytes(RECORD_BYTES)
        start = slot_start(slot, self.slot_bytes)
        reserve(
            self._fd, start, payload_bytes(record),
            f"no room left in {self.path.parent} for a copy of commit {record.commits} of rank {record.rank} "
            f"({payload_bytes(record) / (1 << 20):.1f} MiB)",
        )
        return slot, start

    def write(self, at: int, data: bytes | memoryview) -> None:
        assert self._map is not None
        self._map[at : at + len(data)] = data

    def finish(self, slot: int, raw: bytes) -> Record | None:
        """Write the record of the commit now in `slot` (its sender's record `raw`, under a generation of this file's).

        None, and the slot left empty, when the bytes are not the commit the record
        names (its CRC): torn in transit or by its sender."""
        assert self._map is not None
        record = parsed_record(raw, slot, self.slot_bytes)
        if record is None:
            return None
        start = slot_start(slot, self.slot_bytes) + record.structure_at
        structure = bytes(self._map[start : start + record.structure_bytes])
        if not crc_holds(raw, structure):
            return None
        generation = max((r.generation for r in self.held()), default=0) + 1
        fields = RECORD.unpack_from(raw)
        mine = packed_record(generation, record.commits, record.round, record.rank, record.world, fields[6], structure)
        at = slot * RECORD_SPACING
        self._map[at : at + len(mine)] = mine
        return parsed_record(mine, slot, self.slot_bytes)
