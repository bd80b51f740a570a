"""A state's commits in host memory that the agent owns, so they outlive the worker.

In restart mode the agent makes one file per local rank on a tmpfs (/dev/shm), sized by
`--state-memory`, and names it in `ELASTICRUN_STATE_FILE` (elasticrun.agent.state_files);
the file is the agent's: a worker that dies, and the worker that replaces it, find it as
it was. The worker maps it; `State.commit()` copies the state into it and the next
worker's `@elastic.run` reads it back before calling the function: memory, never a file
on disk, never a pickle.

The file's layout (four slots, a record for each, what makes a commit whole, the pins)
is elasticrun.state_layout's. A commit goes to a slot that holds neither the newest
commit nor a pinned one: first that slot's record is cleared, then the data is written,
then the record, last. A worker killed anywhere in between leaves the newest commit
whole in its own slot; a record torn in its own write fails its CRC.

Space on the tmpfs is reserved (`posix_fallocate`) before it is written: a full /dev/shm
is a StateMemoryError at the commit, never a SIGBUS in the middle of a copy.

A commit need not stall the training: the parameters of the optimizers in the state
and those optimizers' own state change only in `optimizer.step()`, so their copy is
left to finish while the next step's forward and backward run, and each of those
optimizers waits for it before its next step (a step pre-hook, `guard()`). The rest
(buffers, which a forward may change; plain tensors) is copied before `commit()`
returns. CPU tensors are copied by a thread of this class (torch's copy releases the
GIL); CUDA tensors on a side stream into the mapping (each part registered as pinned
memory as it is reserved), which the training's stream waits for on the GPU, never on
the CPU. The slot's record is written once every copy is done, by that thread, so a
commit whose copy is in flight when the worker dies was never whole: the previous one is
restored. The CUDA path runs in bench/gpu_check.py's `state` row (on an NVIDIA H200: a
1 GiB state's commit adds 2% to a 100 ms step); the tests run the CPU path.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from elasticrun.errors import StateMemoryError
from elasticrun.state_layout import (
    RECORD_BYTES,
    RECORD_SPACING,
    SLOTS,
    STATE_BUDDY_VAR,
    STATE_FILE_VAR,
    STATE_REPLICAS_VAR,
    Record,
    ack,
    aligned,
    free_slot,
    held,
    mapped_bytes,
    packed_record,
    reserve,
    set_pins,
    slot_bytes_of,
    slot_start,
)
from elasticrun.worker.elastic.dtensors import local
from elasticrun.worker.elastic.structure import TensorHole, decode, encode


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class HostCopy:
    """The worker's side of its state file: write a commit to a slot, read the newest back."""

    def __init__(self, path: Path, from_buddy: frozenset[int] = frozenset()) -> None:
        """`from_buddy`: the generations of the commits the agent fetched from a buddy node into the file."""
        self.path = path
        self._from_buddy = from_buddy
        self._fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        size = os.fstat(self._fd).st_size
        #: each slot's bytes: a SLOTS-th of what is left after the first page
        self.slot_bytes = slot_bytes_of(size)
        if self.slot_bytes <= 0:
            os.close(self._fd)
            raise StateMemoryError(
                f"the state file {path} holds {size} bytes: too small for {SLOTS} copies (raise --state-memory)"
            )
        self._map = mmap.mmap(self._fd, mapped_bytes(self.slot_bytes))
        #: the whole mapping as bytes; the tensors written and read are views of it
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        #: per slot, how many of its bytes are reserved on the tmpfs
        self._reserved = [0] * SLOTS
        self._generation = max((r.generation for r in self.held()), default=0)
        self._side_stream: Any = None
        #: finishes a commit's deferred copies, then writes its record (made at the first such commit)
        self._finisher: ThreadPoolExecutor | None = None
        #: the commit in flight: done once its record is written
        self._in_flight: Future[None] | None = None
        #: set once the copies in flight no longer read what an optimizer's step changes
        self._copied = threading.Event()
        self._copied.set()
        #: the end of the deferred CUDA copies, which the training's stream waits for before a step
        self._cuda_done: Any = None

    @classmethod
    def from_env(cls) -> HostCopy | None:
        """The file the agent named for this worker; None outside restart mode."""
        path = os.environ.get(STATE_FILE_VAR)
        fetched = frozenset(int(g) for g in os.environ.get(STATE_BUDDY_VAR, "").split(",") if g.isdigit())
        return cls(Path(path), fetched) if path else None

    @classmethod
    def replicas_from_env(cls) -> list[HostCopy]:
        """The replica files of another node's ranks that the agent handed this worker (local rank 0's)."""
        copies = []
        for path in (p for p in os.environ.get(STATE_REPLICAS_VAR, "").split(",") if p):
            try:
                copies.append(cls(Path(path)))
            except FileNotFoundError:  # the agent dropped it since: its ranks are another node's now
                continue
        return copies

    def source(self, record: Record) -> str:
        """Where commit `record` came from: "buddy" (another node kept it), else "own memory"."""
        return "buddy" if record.generation in self._from_buddy else "own memory"

    # --- reading -----------------------------------------------------------------------

    def held(self) -> list[Record]:
        """The whole commits the file holds (up to SLOTS), oldest first."""
        return held(self._map, self.slot_bytes)

    def read(self, record: Record, device: torch.device) -> Any:
        """The commit `record` describes: its structure with the tensors in place.

        A tensor that was on the CPU when committed is a view of the mapping, valid until
        the next commit overwrites its slot: load it into its place, or clone it (no
        copy is made that the caller would make again). The others are copied to `device`."""
        start = self._slot_start(record.slot)
        at = start + record.structure_at
        structure = decode(bytes(self._map[at : at + record.structure_bytes]))
        offsets = _layout(structure)
        return _filled(structure, lambda hole: self._tensor(start + offsets[hole.index], hole, device))

    def _tensor(self, at: int, hole: TensorHole, device: torch.device) -> torch.Tensor:
        size = _nbytes(hole)
        if size == 0:
            return torch.empty(hole.shape, dtype=hole.dtype)
        tensor = self._bytes[at : at + size].view(hole.dtype).view(hole.shape)
        return tensor if hole.on_cpu else tensor.to(device)

    # --- writing -----------------------------------------------------------------------

    def write(
        self,
        named: Iterable[tuple[str, Any]],
        commits: int,
        round_number: int,
        rank: int,
        world: int,
        deferrable: frozenset[int] = frozenset(),
    ) -> None:
        """Copy a commit (name -> payload) into a free slot (state_layout.free_slot).

        A tensor whose `data_ptr()` is in `deferrable` changes only in a step that calls
        `guard()` first: its copy may end after this returns (see the module doc). The
        slot's record is cleared first and written last."""
        self.settle()
        slot = free_slot(self._map, self.slot_bytes)
        start = self._slot_start(slot)
        self._map[slot * RECORD_SPACING : slot * RECORD_SPACING + RECORD_BYTES] = bytes(RECORD_BYTES)
        used = 0
        structure: dict[str, Any] = {}
        count = 0
        fits = True
        #: (where in the mapping, the tensor): copied before this returns, or may be after
        now: list[tuple[int, torch.Tensor]] = []
        later: list[tuple[int, torch.Tensor]] = []
        for name, payload in named:
            tensors: list[torch.Tensor] = []
            structure[name] = _hollow(payload, tensors, count)
            for tensor in tensors:
                size = tensor.nelement() * tensor.element_size()
                fits = fits and used + size <= self.slot_bytes  # else only counted, for the message
                if fits and size:
                    self._reserve(slot, used + size, commits)
                    (later if tensor.data_ptr() in deferrable else now).append((start + used, tensor.detach()))
                used = aligned(used + size)
            count += len(tensors)
        data = encode(structure)
        if not fits or used + len(data) > self.slot_bytes:
            raise StateMemoryError(
                f"the state does not fit in the host memory each worker has for it: commit {commits} takes "
                f"{_mib(used + len(data))}, and room is made for {SLOTS} copies, of {_mib(self.slot_bytes)} each; "
                f"raise --state-memory to at least {_mib(mapped_bytes(aligned(used + len(data))))}"
            )
        self._reserve(slot, used + len(data), commits)
        self._map[start + used : start + used + len(data)] = data
        self._generation += 1
        record = packed_record(self._generation, commits, round_number, rank, world, used, data)
        cuda_now = self._copy_on_side_stream([(at, t) for at, t in now if t.is_cuda])
        self._copy_in([(at, t) for at, t in now if not t.is_cuda])
        if cuda_now is not None:  # the training changes them next: its stream waits for their copy
            torch.cuda.current_stream().wait_event(cuda_now)
        self._cuda_done = self._copy_on_side_stream([(at, t) for at, t in later if t.is_cuda])
        cpu_later = [(at, t) for at, t in later if not t.is_cuda]
        if cuda_now is None and self._cuda_done is None and not cpu_later:
            self._put_record(slot, record)
            return
        if self._finisher is None:
            self._finisher = ThreadPoolExecutor(1, thread_name_prefix="elasticrun-commit")
        self._copied.clear()
        last = self._cuda_done or cuda_now
        self._in_flight = self._finisher.submit(self._finish, cpu_later, last, slot, record)

    def _finish(self, copies: list[tuple[int, torch.Tensor]], cuda_done: Any, slot: int, record: bytes) -> None:
        """The finisher thread: the deferred CPU copies, the wait for the CUDA ones, then the record."""
        try:
            self._copy_in(copies)
        finally:
            self._copied.set()
        if cuda_done is not None:
            cuda_done.synchronize()
        self._put_record(slot, record)

    def guard(self) -> None:
        """Before an optimizer changes what a commit in flight is copying: wait for that copy.

        CPU copies are waited for here; for CUDA ones the training's stream waits on the GPU."""
        self._copied.wait()
        if self._cuda_done is not None:
            torch.cuda.current_stream().wait_event(self._cuda_done)
            self._cuda_done = None

    def settle(self) -> None:
        """Wait until the commit in flight is whole (its record written); raise what its copy raised."""
        self.guard()
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            in_flight.result()

    # --- pins (a ShardedState's) --------------------------------------------------------

    @property
    def next_generation(self) -> int:
        """The generation the next commit written will have."""
        return self._generation + 1

    def pin(self, candidate: int, safe: int) -> None:
        """Keep the commits of generations `candidate` (the one the agent is to copy to the buddy node) and `safe`.

        Neither slot is written again until another pin; 0 pins nothing."""
        set_pins(self._map, candidate, safe)

    def buddy_holds(self, generation: int) -> bool:
        """Whether the agent said that its buddy node holds the commit of `generation`."""
        return generation > 0 and ack(self._map) == generation

    def _put_record(self, slot: int, record: bytes) -> None:
        at = slot * RECORD_SPACING
        self._map[at : at + len(record)] = record

    def _slot_start(self, slot: int) -> int:
        return slot_start(slot, self.slot_bytes)

    def _reserve(self, slot: int, end: int, commits: int) -> None:
        """Make sure the tmpfs holds bytes [0, end) of `slot`: a clear error, never a SIGBUS.

        Reserved in whole pages; where CUDA is in use each new range is also registered
        as pinned memory (only what is reserved: pinning a page allocates it)."""
        if end <= self._reserved[slot]:
            return
        end = min(-(-end // mmap.PAGESIZE) * mmap.PAGESIZE, self.slot_bytes)
        at = self._slot_start(slot) + self._reserved[slot]
        reserve(
            self._fd, at, end - self._reserved[slot],
            f"no room left in {self.path.parent} for the state's copy (commit {commits} needs "
            f"{_mib(end)}): give the tmpfs more room, or lower --state-memory to what it holds",
        )
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.cudart().cudaHostRegister(self._bytes[at:].data_ptr(), end - self._reserved[slot], 0)
        self._reserved[slot] = end

    def _view(self, at: int, tensor: torch.Tensor) -> torch.Tensor:
        """The bytes of the mapping at `at` as a tensor shaped as `tensor`."""
        size = tensor.nelement() * tensor.element_size()
        return self._bytes[at : at + size].view(tensor.dtype).view(tensor.shape)

    def _copy_in(self, copies: list[tuple[int, torch.Tensor]]) -> None:
        for at, tensor in copies:
            self._view(at, tensor).copy_(tensor)

    def _copy_on_side_stream(self, copies: list[tuple[int, torch.Tensor]]) -> Any:
        """Start CUDA tensors' copies on the side stream, after what the training queued; their end's event."""
        if not copies:
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        self._side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side_stream):
            for at, tensor in copies:
                self._view(at, tensor).copy_(tensor, non_blocking=True)
                tensor.record_stream(self._side_stream)
        return self._side_stream.record_event()


def _nbytes(hole: TensorHole) -> int:
    count = 1
    for n in hole.shape:
        count *= n
    return count * torch.empty((), dtype=hole.dtype).element_size()


def _layout(structure: Any) -> dict[int, int]:
    """Each tensor's offset in its slot, from the holes alone (as `HostCopy.write` laid them)."""
    holes: list[TensorHole] = []
    _filled(structure, lambda hole: holes.append(hole))
    offsets, used = {}, 0
    for hole in sorted(holes, key=lambda h: h.index):
        offsets[hole.index] = used
        used = aligned(used + _nbytes(hole))
    return offsets


def _hollow(obj: Any, tensors: list[torch.Tensor], first: int) -> Any:
    """`obj` with each tensor replaced by a TensorHole numbered from `first`; the tensors go to `tensors`.

    A DTensor goes as its local tensor: this rank's shard (dtensors.py)."""
    if isinstance(obj, torch.Tensor):
        mine = local(obj)
        tensors.append(mine)
        return TensorHole(first + len(tensors) - 1, tuple(mine.shape), mine.dtype, mine.device.type == "cpu")
    if isinstance(obj, dict):
        return {k: _hollow(v, tensors, first) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_hollow(v, tensors, first) for v in obj)
    return obj


def _filled(obj: Any, tensor_for: Any) -> Any:
    """`obj` with each TensorHole replaced by `tensor_for(hole)`."""
    if isinstance(obj, TensorHole):
        return tensor_for(obj)
    if isinstance(obj, dict):
        return {k: _filled(v, tensor_for) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_filled(v, tensor_for) for v in obj)
    return obj
