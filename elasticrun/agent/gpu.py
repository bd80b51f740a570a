"""GPUs through NVML: discovery, selection, health checks and the facts `status` shows.

This is the only module that talks to NVML. Every NVML call goes through the small
`Nvml` boundary, so that tests (on machines without GPUs) can pass a fake of exactly that
and nothing else. `pynvml` is imported lazily by `Pynvml.init`: the launcher stays fast
to import, and a node without the library, the driver or any GPU simply has no GPUs.

Indices are NVML indices (the ones `nvidia-smi` shows, in PCI bus order). Workers get
`CUDA_DEVICE_ORDER=PCI_BUS_ID` with them, so the GPU checked here is the GPU they use.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import asdict, dataclass
from enum import StrEnum
from types import ModuleType
from typing import Protocol, TypeVar

from elasticrun.errors import ElasticrunError, UsageError

# The flags the launcher exposes for this module; messages name them.
NPROC_FLAG = "--nproc-per-node"
GPUS_FLAG = "--gpus"

# NVML return codes (stable values of the C API) that change what we do.
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15

# Without the library or the driver the node has no GPUs; any other failure to start
# NVML means GPUs are there but unusable, which is a health problem, not a CPU node.
_NO_NVML = frozenset({NVML_ERROR_LIBRARY_NOT_FOUND, NVML_ERROR_DRIVER_NOT_LOADED})

# NVML reports every Xid through its "critical" event type, including the ones an
# application causes (13, 31, 43) or that follow a killed process (45), which happen
# whenever workers are stopped. Only these mean the GPU needs a reset or a drain.
CRITICAL_XIDS: frozenset[int] = frozenset(
    {
        48,  # double-bit ECC error
        61,  # internal micro-controller breakpoint
        62,  # internal micro-controller halt
        64,  # ECC page retirement or row remapping failure
        74,  # NVLink error
        79,  # fallen off the bus
        95,  # uncontained ECC error
        119,  # GSP RPC timeout
        120,  # GSP error
        140,  # unrecovered ECC error
    }
)


T = TypeVar("T")

#: how long a restart waits at most for stopped workers' GPU memory (`Gpus.wait_released`):
#: a driver frees even a full GPU's in seconds; past this the memory is lost until a reset
RECLAIM_LIMIT = 60.0
#: how often NVML's process list is read while waiting
_RECLAIM_POLL = 0.1


class NvmlCallError(ElasticrunError):
    """An NVML call failed; `code` is NVML's return code, translated once at the boundary."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"NVML: {reason}")
        self.code = code
        self.reason = reason


class Nvml(Protocol):
    """The NVML calls elasticrun makes, by device index; each raises `NvmlCallError`."""

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def device_count(self) -> int: ...
    def uuid(self, index: int) -> str: ...
    def name(self, index: int) -> str: ...
    def pci_bus_id(self, index: int) -> str:
        """The device's PCI address, as NVML writes it (`00000000:3B:00.0`)."""
        ...

    def memory(self, index: int) -> tuple[int, int]:
        """Used and total bytes."""
        ...

    def utilisation(self, index: int) -> int: ...
    def volatile_uncorrected_ecc(self, index: int) -> int: ...
    def retired_pages_pending(self, index: int) -> bool: ...
    def remapped_rows(self, index: int) -> tuple[bool, bool]:
        """Whether a row remap is pending, and whether one has failed."""
        ...

    def watch_xid(self, index: int) -> None:
        """Start collecting critical Xid events of this device."""
        ...

    def next_xid(self) -> tuple[int, int] | None:
        """The next collected (device index, xid) without waiting, or None."""
        ...

    def compute_processes(self, index: int) -> tuple[tuple[int, int | None], ...]:
        """The processes with a compute context on the device.

        (pid, bytes of its memory there, None where NVML cannot tell). The pids are of
        NVML's PID namespace."""
        ...


class Pynvml:
    """The real `Nvml`, over nvidia-ml-py."""

    _nv: ModuleType  # set by init(), before any other call

    def __init__(self) -> None:
        self._events: object | None = None

    def init(self) -> None:
        try:
            import pynvml
        except ImportError as e:
            raise NvmlCallError(
                NVML_ERROR_LIBRARY_NOT_FOUND, f"nvidia-ml-py is not installed ({e})"
            ) from e
        self._nv = pynvml
        self._call(pynvml.nvmlInit)

    def shutdown(self) -> None:
        if self._events is not None:
            self._call(self._nv.nvmlEventSetFree, self._events)
            self._events = None
        self._call(self._nv.nvmlShutdown)

    def device_count(self) -> int:
        return int(self._call(self._nv.nvmlDeviceGetCount))

    def uuid(self, index: int) -> str:
        return str(self._call(self._nv.nvmlDeviceGetUUID, self._handle(index)))

    def name(self, index: int) -> str:
        return str(self._call(self._nv.nvmlDeviceGetName, self._handle(index)))

    def pci_bus_id(self, index: int) -> str:
        info = self._call(self._nv.nvmlDeviceGetPciInfo, self._handle(index))
        bus_id = info.busId
        return bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)

    def memory(self, index: int) -> tuple[int, int]:
        info = self._call(self._nv.nvmlDeviceGetMemoryInfo, self._handle(index))
        return int(info.used), int(info.total)

    def utilisation(self, index: int) -> int:
        rates = self._call(self._nv.nvmlDeviceGetUtilizationRates, self._handle(index))
        return int(rates.gpu)

    def volatile_uncorrected_ecc(self, index: int) -> int:
        nv = self._nv
        return int(
            self._call(
                nv.nvmlDeviceGetTotalEccErrors,
                self._handle(index),
                nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nv.NVML_VOLATILE_ECC,
            )
        )

    def retired_pages_pending(self, index: int) -> bool:
        status = self._call(self._nv.nvmlDeviceGetRetiredPagesPendingStatus, self._handle(index))
        return bool(status == self._nv.NVML_FEATURE_ENABLED)

    def remapped_rows(self, index: int) -> tuple[bool, bool]:
        _, _, pending, failed = self._call(self._nv.nvmlDeviceGetRemappedRows, self._handle(index))
        return bool(pending), bool(failed)

    def watch_xid(self, index: int) -> None:
        nv = self._nv
        if self._events is None:
            self._events = self._call(nv.nvmlEventSetCreate)
        self._call(
            nv.nvmlDeviceRegisterEvents,
            self._handle(index),
            nv.nvmlEventTypeXidCriticalError,
            self._events,
        )

    def next_xid(self) -> tuple[int, int] | None:
        if self._events is None:
            return None
        try:
            event = self._call(self._nv.nvmlEventSetWait, self._events, 0)
        except NvmlCallError as e:
            if e.code == NVML_ERROR_TIMEOUT:
                return None
            raise
        index = self._call(self._nv.nvmlDeviceGetIndex, event.device)
        return int(index), int(event.eventData)

    def compute_processes(self, index: int) -> tuple[tuple[int, int | None], ...]:
        found = self._call(self._nv.nvmlDeviceGetComputeRunningProcesses, self._handle(index))
        return tuple((int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory)) for p in found)

    def _handle(self, index: int) -> object:
        return self._call(self._nv.nvmlDeviceGetHandleByIndex, index)

    def _call(self, fn: Callable[..., T], *args: object) -> T:
        try:
            return fn(*args)
        except self._nv.NVMLError as e:
            raise NvmlCallError(e.value, str(e)) from e


class ProblemKind(StrEnum):
    """What is wrong with a GPU; stable strings for the event log and JSON."""

    NVML_ERROR = "nvml-error"
    LOST = "lost"
    ECC_UNCORRECTED = "ecc-uncorrected"
    RETIRED_PAGES_PENDING = "retired-pages-pending"
    ROW_REMAP_PENDING = "row-remap-pending"
    ROW_REMAP_FAILED = "row-remap-failed"
    XID = "xid"
    #: memory of stopped workers still held past the reclaim bound
    MEMORY_HELD = "memory-held"


@dataclass(frozen=True)
class GpuProblem:
    """One reason this node should not run work; `index` is None when NVML itself fails."""

    index: int | None
    kind: ProblemKind
    reason: str

    def to_dict(self) -> dict[str, object]:
        return {"index": self.index, "kind": str(self.kind), "reason": self.reason}


@dataclass(frozen=True)
class GpuHealth:
    """The outcome of one health check over some GPUs."""

    checked: tuple[int, ...]
    problems: tuple[GpuProblem, ...]
    note: str = ""  # why NVML is not there, when it is not

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def unhealthy(self) -> frozenset[int]:
        return frozenset(p.index for p in self.problems if p.index is not None)

    @property
    def reason(self) -> str:
        """One line for logs, the event log and `status`."""
        if self.problems:
            return "; ".join(p.reason for p in self.problems)
        if not self.checked:
            return f"no GPUs ({self.note})" if self.note else "no GPUs"
        return f"{len(self.checked)} GPU(s) healthy"

    def to_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "reason": self.reason,
            "checked": list(self.checked),
            "problems": [p.to_dict() for p in self.problems],
        }


@dataclass(frozen=True)
class GpuFacts:
    """What `status` shows for one GPU; a field is None when NVML could not read it."""

    index: int
    uuid: str | None
    name: str | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    utilisation_percent: int | None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class GpuSelection:
    """The GPUs this node's workers use, in local-rank order, and why there may be none."""

    devices: tuple[int, ...]
    health: GpuHealth
    cuda_visible_devices: str | None

    def nproc(self, value: str, cpu_count: int) -> int:
        """Workers for `--nproc-per-node=gpu|auto`: one per selected GPU (auto: else CPUs)."""
        if self.devices:
            return len(self.devices)
        if value == "auto":
            return cpu_count
        hidden = (
            f", CUDA_VISIBLE_DEVICES={self.cuda_visible_devices!r}"
            if self.cuda_visible_devices is not None
            else ""
        )
        raise UsageError(
            f"{NPROC_FLAG}=gpu needs a GPU, but this node has no usable one "
            f"({self.health.reason}{hidden}); use {NPROC_FLAG}=auto, cpu or a number"
        )


def parse_visible_devices(value: str | None, uuids: Sequence[str | None]) -> tuple[int, ...]:
    """The NVML indices an inherited CUDA_VISIBLE_DEVICES leaves visible.

    Entries are indices or (prefixes of) `GPU-` UUIDs. As CUDA does, the list ends at the
    first entry that names no new device, so "-1" or "" hide every GPU. Integer entries
    are read in PCI bus order (as nvidia-smi numbers GPUs).
    """
    if value is None:
        return tuple(range(len(uuids)))
    visible: list[int] = []
    for token in (t.strip() for t in value.split(",")):
        index = _device_of(token, uuids)
        if index is None or index in visible:
            break
        visible.append(index)
    return tuple(visible)


def _device_of(token: str, uuids: Sequence[str | None]) -> int | None:
    if token.isdecimal():
        index = int(token)
        return index if index < len(uuids) else None
    if not token.startswith("GPU-"):
        return None
    matches = [i for i, u in enumerate(uuids) if u is not None and u.startswith(token)]
    return matches[0] if len(matches) == 1 else None


def pick_devices(
    visible: Sequence[int], requested: str | None, unhealthy: Set[int]
) -> tuple[int, ...]:
    """The devices for the workers: the named ones, or else every healthy visible one.

    `requested` (the `--gpus` value, e.g. "0,2,3") counts within the visible devices,
    as `cuda:N` does in the launcher's environment. Named devices are kept even when
    unhealthy, so the health check refuses the node instead of quietly running fewer.
    """
    if requested is None:
        return tuple(i for i in visible if i not in unhealthy)
    picked: list[int] = []
    for token in (t.strip() for t in requested.split(",")):
        if not token.isdecimal() or int(token) >= len(visible):
            raise UsageError(
                f"{GPUS_FLAG}={requested}: {token!r} is not a visible GPU; "
                f"this node shows {len(visible)} (0 to {len(visible) - 1})"
                if visible
                else f"{GPUS_FLAG}={requested}: this node shows no GPU"
            )
        device = visible[int(token)]
        if device in picked:
            raise UsageError(f"{GPUS_FLAG}={requested}: GPU {token} is named twice")
        picked.append(device)
    return tuple(picked)


def worker_gpu_env(devices: Sequence[int], local_rank: int, isolate: bool) -> dict[str, str]:
    """The environment that puts worker `local_rank` on its GPU.

    Without isolation every worker sees all selected devices and uses `cuda:LOCAL_RANK`,
    as under torchrun; with it, each sees only its own GPU, as `cuda:0`.
    """
    if not devices:
        return {}
    if isolate and local_rank >= len(devices):
        raise UsageError(
            f"worker {local_rank} has no GPU of its own: {len(devices)} GPU(s) selected; "
            f"lower {NPROC_FLAG} or name more devices with {GPUS_FLAG}"
        )
    shown = [devices[local_rank]] if isolate else list(devices)
    return {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in shown),
    }


class Gpus:
    """NVML opened for the life of the agent; build it with `open_gpus`."""

    def __init__(
        self, nvml: Nvml | None, count: int, note: str = "", fault: GpuProblem | None = None
    ) -> None:
        self._nvml = nvml
        self.count = count
        self._note = note  # why there is no NVML, for "no GPUs (...)"
        self._fault = fault  # NVML is there but failed: the node is unhealthy
        self._xids: dict[int, list[int]] = {}

    def close(self) -> None:
        """Shut NVML down: pynvml counts its inits, so each `open_gpus` needs one close."""
        if self._nvml is not None:
            self._nvml.shutdown()
            self._nvml = None

    def select(self, environ: Mapping[str, str], requested: str | None) -> GpuSelection:
        """The workers' GPUs: visible through CUDA_VISIBLE_DEVICES, named by `--gpus`."""
        inherited = environ.get("CUDA_VISIBLE_DEVICES")
        nvml = self._nvml
        uuids = [_read(nvml.uuid, i) for i in range(self.count)] if nvml is not None else []
        visible = parse_visible_devices(inherited, uuids)
        health = self.check(visible)
        return GpuSelection(pick_devices(visible, requested, health.unhealthy), health, inherited)

    def check(self, devices: Sequence[int]) -> GpuHealth:
        """Check the devices now, blocking on NVML; critical Xids seen so far count too."""
        nvml = self._nvml
        if nvml is None:
            return GpuHealth((), (self._fault,) if self._fault else (), self._note)
        xid_failure = self._collect_xids(nvml)  # first: its findings count in this check
        problems = [p for i in devices for p in self._check_device(nvml, i)]
        return GpuHealth(tuple(devices), tuple(problems + xid_failure), self._note)

    def pci_bus_ids(self) -> tuple[str, ...]:
        """Every GPU's PCI address, by NVML index (--numa-binding)."""
        nvml = self._nvml
        if nvml is None:
            return ()
        return tuple(nvml.pci_bus_id(i) for i in range(self.count))

    def facts(self, devices: Sequence[int]) -> tuple[GpuFacts, ...]:
        """Per-GPU facts for `status`."""
        nvml = self._nvml
        if nvml is None:
            return ()
        out = []
        for i in devices:
            memory = _read(nvml.memory, i)
            out.append(
                GpuFacts(
                    index=i,
                    uuid=_read(nvml.uuid, i),
                    name=_read(nvml.name, i),
                    memory_used_bytes=memory[0] if memory else None,
                    memory_total_bytes=memory[1] if memory else None,
                    utilisation_percent=_read(nvml.utilisation, i),
                )
            )
        return tuple(out)

    async def watch_health(self, devices: Sequence[int], interval: float) -> GpuProblem:
        """The first problem of these devices, checked every `interval` seconds.

        NVML runs in a thread, so the loop never blocks. With nothing to watch this never
        returns, so the agent can always race it against its other waits.
        """
        while True:
            health = await asyncio.to_thread(self.check, devices)
            if health.problems:
                return health.problems[0]
            if not devices:
                await asyncio.get_running_loop().create_future()
            await asyncio.sleep(interval)

    async def wait_released(
        self, devices: Sequence[int], pids: Set[int], limit: float, say: Callable[[str], None]
    ) -> GpuProblem | None:
        """Wait until no process of `pids` holds memory on these devices, for `limit` seconds at most.

        `pids` are the stopped workers and what they started, looked for in NVML's
        process list. Past `limit` the memory counts as lost: the problem says where and
        whose.

        A killed process's memory is freed by the driver as it tears the context down,
        which may take a while (or forever, for a process stuck in the driver): workers
        started meanwhile would run out of memory. `say` gets one line when the wait
        starts (only if something is still held) and one when it ends. Where NVML cannot
        list processes (an unsupported GPU), there is nothing to wait for.
        """
        nvml = self._nvml
        if nvml is None or not devices or not pids:
            return None
        started, said = time.monotonic(), False
        while True:
            held = await asyncio.to_thread(self._held, nvml, devices, pids)
            waited = time.monotonic() - started
            if isinstance(held, GpuProblem):
                return held
            if not held:
                if said:
                    say(f"GPU memory of the previous workers freed after {waited:.1f}s")
                return None
            if waited >= limit:
                index = min(held)
                return _problem(
                    index, ProblemKind.MEMORY_HELD,
                    f"{_holders(held[index])} still held by the previous workers' processes "
                    f"{limit:g}s after they stopped",
                )
            if not said:
                where = "; ".join(f"GPU {i}: {_holders(held[i])}" for i in sorted(held))
                say(f"waiting up to {limit:g}s for the previous workers' GPU memory to be freed ({where})")
                said = True
            await asyncio.sleep(_RECLAIM_POLL)

    def _held(
        self, nvml: Nvml, devices: Sequence[int], pids: Set[int]
    ) -> dict[int, list[tuple[int, int | None]]] | GpuProblem:
        """What processes of `pids` hold on each device (blocking on NVML)."""
        held = {}
        for i in devices:
            try:
                found = [p for p in _supported(nvml.compute_processes, i) or () if p[0] in pids]
            except NvmlCallError as e:
                kind = ProblemKind.LOST if e.code == NVML_ERROR_GPU_IS_LOST else ProblemKind.NVML_ERROR
                return _problem(i, kind, f"listing its processes: {e.reason}")
            if found:
                held[i] = found
        return held

    def _collect_xids(self, nvml: Nvml) -> list[GpuProblem]:
        # Kept for the session: a GPU that raised a critical Xid needs a reset.
        try:
            while (event := nvml.next_xid()) is not None:
                if event[1] in CRITICAL_XIDS:
                    self._xids.setdefault(event[0], []).append(event[1])
        except NvmlCallError as e:
            # Reading events fails when a GPU is lost; this node cannot be trusted.
            return [GpuProblem(None, ProblemKind.NVML_ERROR, f"NVML Xid events: {e.reason}")]
        return []

    def _check_device(self, nvml: Nvml, i: int) -> list[GpuProblem]:
        problems = []
        try:
            ecc = _supported(nvml.volatile_uncorrected_ecc, i)
            retired = _supported(nvml.retired_pages_pending, i)
            pending, failed = _supported(nvml.remapped_rows, i) or (False, False)
        except NvmlCallError as e:
            if e.code == NVML_ERROR_GPU_IS_LOST:
                return [_problem(i, ProblemKind.LOST, f"fallen off the bus ({e.reason})")]
            return [_problem(i, ProblemKind.NVML_ERROR, e.reason)]
        if ecc:
            problems.append(
                _problem(i, ProblemKind.ECC_UNCORRECTED, f"{ecc} volatile uncorrectable ECC errors")
            )
        if retired:
            problems.append(
                _problem(i, ProblemKind.RETIRED_PAGES_PENDING, "retired pages pending a reset")
            )
        if failed:
            problems.append(_problem(i, ProblemKind.ROW_REMAP_FAILED, "row remapping failed"))
        elif pending:
            problems.append(
                _problem(i, ProblemKind.ROW_REMAP_PENDING, "row remapping pending a reset")
            )
        problems += [
            _problem(i, ProblemKind.XID, f"critical Xid {xid}") for xid in self._xids.get(i, ())
        ]
        return problems


def _holders(processes: Sequence[tuple[int, int | None]]) -> str:
    """`31.5 GiB (pids 4242, 4243)`: what these processes hold, and who they are."""
    sizes = [size for _, size in processes if size is not None]
    amount = f"{sum(sizes) / (1 << 30):.1f} GiB" if sizes else "memory"
    return f"{amount} ({'pid' if len(processes) == 1 else 'pids'} {', '.join(str(pid) for pid, _ in processes)})"


def _problem(index: int, kind: ProblemKind, what: str) -> GpuProblem:
    return GpuProblem(index, kind, f"GPU {index}: {what}")


def _read(call: Callable[[int], T], index: int) -> T | None:
    """The call's result, or None when NVML cannot tell (for facts, not health)."""
    try:
        return call(index)
    except NvmlCallError:
        return None


def _supported(call: Callable[[int], T], index: int) -> T | None:
    """The call's result, or None where this GPU does not support the query."""
    try:
        return call(index)
    except NvmlCallError as e:
        if e.code == NVML_ERROR_NOT_SUPPORTED:
            return None
        raise


def open_gpus(nvml: Nvml | None = None) -> Gpus:
    """Open NVML (the real library unless a fake is given); never raises.

    No library, no driver or no GPU give a `Gpus` with count 0 whose health says
    "no GPUs". NVML failing otherwise (e.g. a driver/library version mismatch) means
    GPUs are there but cannot be trusted: the health check reports it as a problem.
    """
    nvml = nvml if nvml is not None else Pynvml()
    try:
        nvml.init()
        count = nvml.device_count()
    except NvmlCallError as e:
        if e.code in _NO_NVML:
            return Gpus(None, 0, note=e.reason)
        # NVML stays initialised here: harmless, and shutting down could fail too.
        return Gpus(None, 0, fault=GpuProblem(None, ProblemKind.NVML_ERROR, f"NVML: {e.reason}"))
    for i in range(count):
        try:
            nvml.watch_xid(i)
        except NvmlCallError:
            pass  # unsupported, or a broken device: its health check reports the latter
    return Gpus(nvml, count, note="" if count else "NVML sees none")
