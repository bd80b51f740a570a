"""GPU discovery, selection and health (elasticrun.agent.gpu).

These machines have no GPU, so NVML is replaced by a fake of the `Nvml` boundary (the
one fake this project allows); one test runs the real pynvml, which must degrade cleanly
here and report real facts where a GPU exists.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticrun.agent.gpu import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    GpuProblem,
    Nvml,
    NvmlCallError,
    ProblemKind,
    open_gpus,
    parse_visible_devices,
    pick_devices,
    worker_gpu_env,
)
from elasticrun.errors import UsageError

NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_UNKNOWN = 999


@dataclass
class FakeGpu:
    uuid: str
    ecc: list[int] = field(default_factory=lambda: [0])  # successive reads; the last repeats
    retired_pending: bool = False
    remap: tuple[bool, bool] = (False, False)
    handle_error: int | None = None  # every call on the device fails with this code
    unsupported: frozenset[str] = frozenset()
    ecc_gate: threading.Event | None = None  # when set, an ECC read waits for it
    ecc_entered: threading.Event = field(default_factory=threading.Event)
    bus_id: str = "00000000:3B:00.0"
    #: NVML's compute processes (pid, bytes) at successive reads; the last repeats
    processes: list[list[tuple[int, int | None]]] = field(default_factory=lambda: [[]])


class FakeNvml:
    """The `Nvml` boundary over a list of FakeGpu."""

    def __init__(self, gpus: list[FakeGpu], init_error: int | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.xids: deque[tuple[int, int]] = deque()
        self.xid_error: int | None = None
        self.watched: list[int] = []
        self.ecc_reads = 0
        self.shut_down = False

    def _gpu(self, index: int, query: str) -> FakeGpu:
        if not 0 <= index < len(self.gpus):
            raise NvmlCallError(NVML_ERROR_INVALID_ARGUMENT, "Invalid Argument")
        gpu = self.gpus[index]
        if gpu.handle_error is not None:
            raise NvmlCallError(gpu.handle_error, f"error {gpu.handle_error}")
        if query in gpu.unsupported:
            raise NvmlCallError(NVML_ERROR_NOT_SUPPORTED, "Not Supported")
        return gpu

    def init(self) -> None:
        if self.init_error is not None:
            raise NvmlCallError(self.init_error, f"init error {self.init_error}")

    def shutdown(self) -> None:
        self.shut_down = True

    def device_count(self) -> int:
        return len(self.gpus)

    def uuid(self, index: int) -> str:
        return self._gpu(index, "uuid").uuid

    def name(self, index: int) -> str:
        self._gpu(index, "name")
        return "NVIDIA H100 80GB HBM3"

    def pci_bus_id(self, index: int) -> str:
        return self._gpu(index, "pci").bus_id

    def memory(self, index: int) -> tuple[int, int]:
        self._gpu(index, "memory")
        return 3 << 30, 80 << 30

    def utilisation(self, index: int) -> int:
        self._gpu(index, "utilisation")
        return 97

    def volatile_uncorrected_ecc(self, index: int) -> int:
        gpu = self._gpu(index, "ecc")
        self.ecc_reads += 1
        gpu.ecc_entered.set()
        if gpu.ecc_gate is not None:
            gpu.ecc_gate.wait(10)
        return gpu.ecc.pop(0) if len(gpu.ecc) > 1 else gpu.ecc[0]

    def retired_pages_pending(self, index: int) -> bool:
        return self._gpu(index, "retired").retired_pending

    def remapped_rows(self, index: int) -> tuple[bool, bool]:
        return self._gpu(index, "remap").remap

    def watch_xid(self, index: int) -> None:
        self._gpu(index, "xid")
        self.watched.append(index)

    def next_xid(self) -> tuple[int, int] | None:
        if self.xid_error is not None:
            raise NvmlCallError(self.xid_error, f"error {self.xid_error}")
        return self.xids.popleft() if self.xids else None

    def compute_processes(self, index: int) -> tuple[tuple[int, int | None], ...]:
        gpu = self._gpu(index, "processes")
        return tuple(gpu.processes.pop(0) if len(gpu.processes) > 1 else gpu.processes[0])


def fake(n: int, init_error: int | None = None) -> FakeNvml:
    return FakeNvml([FakeGpu(uuid=f"GPU-{i:x}{i:x}aa-0000") for i in range(n)], init_error)


def test_fake_is_an_nvml() -> None:
    nvml: Nvml = fake(1)  # the type checker holds the fake to the boundary
    assert open_gpus(nvml).count == 1


# --- count and degrading cleanly -------------------------------------------------------


def test_count_and_healthy_gpus() -> None:
    nvml = fake(4)
    gpus = open_gpus(nvml)
    health = gpus.check(range(4))
    assert gpus.count == 4
    assert health.ok and health.reason == "4 GPU(s) healthy"
    assert nvml.watched == [0, 1, 2, 3]
    gpus.close()
    assert nvml.shut_down


@pytest.mark.parametrize(
    ("nvml", "note"),
    [
        (fake(2, init_error=NVML_ERROR_LIBRARY_NOT_FOUND), "init error 12"),
        (fake(2, init_error=NVML_ERROR_DRIVER_NOT_LOADED), "init error 9"),
        (fake(0), "NVML sees none"),
    ],
    ids=["no-library", "no-driver", "no-gpus"],
)
def test_no_nvml_or_no_gpus_degrades_to_cpu(nvml: FakeNvml, note: str) -> None:
    gpus = open_gpus(nvml)
    selection = gpus.select({}, None)
    assert gpus.count == 0
    assert gpus.check([]).ok
    assert gpus.check([]).reason == f"no GPUs ({note})"
    assert selection.devices == ()
    assert selection.nproc("auto", cpu_count=6) == 6
    with pytest.raises(UsageError, match=r"--nproc-per-node=gpu needs a GPU.*no GPUs") as e:
        selection.nproc("gpu", cpu_count=6)
    assert e.value.exit_code == 2


def test_missing_python_library_degrades(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # import fails
    health = open_gpus().check([])
    assert health.ok
    assert health.reason.startswith("no GPUs (nvidia-ml-py is not installed")


def test_broken_nvml_is_a_problem_not_a_cpu_node() -> None:
    gpus = open_gpus(fake(8, init_error=NVML_ERROR_LIB_RM_VERSION_MISMATCH))
    health = gpus.check([])
    assert gpus.count == 0
    assert not health.ok
    assert health.problems == (
        GpuProblem(None, ProblemKind.NVML_ERROR, "NVML: init error 18"),
    )


def test_real_pynvml_on_this_machine() -> None:
    gpus = open_gpus()
    try:
        selection = gpus.select({}, None)
        if gpus.count == 0:
            assert selection.health.ok
            assert selection.health.reason.startswith("no GPUs")
            assert gpus.facts(range(1)) == ()
            with pytest.raises(UsageError, match="--nproc-per-node=gpu"):
                selection.nproc("gpu", cpu_count=2)
        else:
            facts = gpus.facts(range(gpus.count))
            assert selection.health.ok, selection.health.reason
            assert selection.devices == tuple(range(gpus.count))
            assert all(f.uuid and f.uuid.startswith("GPU-") for f in facts)
            assert all(f.memory_total_bytes and f.memory_total_bytes > 0 for f in facts)
            assert asyncio.run(gpus.wait_released(range(gpus.count), {0}, 1.0, print)) is None  # pid 0 holds none
    finally:
        gpus.close()


# --- health conditions -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu", "kind", "reason"),
    [
        (FakeGpu("GPU-1", handle_error=NVML_ERROR_GPU_IS_LOST), ProblemKind.LOST,
         "GPU 1: fallen off the bus (error 15)"),
        (FakeGpu("GPU-1", handle_error=NVML_ERROR_UNKNOWN), ProblemKind.NVML_ERROR,
         "GPU 1: error 999"),
        (FakeGpu("GPU-1", ecc=[3]), ProblemKind.ECC_UNCORRECTED,
         "GPU 1: 3 volatile uncorrectable ECC errors"),
        (FakeGpu("GPU-1", retired_pending=True), ProblemKind.RETIRED_PAGES_PENDING,
         "GPU 1: retired pages pending a reset"),
        (FakeGpu("GPU-1", remap=(True, False)), ProblemKind.ROW_REMAP_PENDING,
         "GPU 1: row remapping pending a reset"),
        (FakeGpu("GPU-1", remap=(True, True)), ProblemKind.ROW_REMAP_FAILED,
         "GPU 1: row remapping failed"),
    ],
    ids=["lost", "handle-error", "ecc", "retired-pending", "remap-pending", "remap-failed"],
)
def test_each_health_condition(gpu: FakeGpu, kind: ProblemKind, reason: str) -> None:
    gpus = open_gpus(FakeNvml([FakeGpu("GPU-0"), gpu, FakeGpu("GPU-2")]))
    health = gpus.check([0, 1, 2])
    assert health.problems == (GpuProblem(1, kind, reason),)
    assert health.unhealthy == {1}
    assert health.reason == reason
    assert gpus.check([0, 2]).ok


def test_unsupported_queries_are_not_problems() -> None:
    every_query = frozenset({"ecc", "retired", "remap", "xid"})
    nvml = FakeNvml([FakeGpu("GPU-0", unsupported=every_query)])
    gpus = open_gpus(nvml)
    assert gpus.check([0]).ok
    assert nvml.watched == []


def test_critical_xid_marks_the_gpu_for_the_session() -> None:
    nvml = fake(2)
    gpus = open_gpus(nvml)
    nvml.xids.extend([(0, 45), (1, 13), (1, 79)])  # 45, 13: stopped or faulty application
    first = gpus.check([0, 1])
    assert first.problems == (GpuProblem(1, ProblemKind.XID, "GPU 1: critical Xid 79"),)
    assert not nvml.xids
    assert gpus.check([1]).problems == first.problems
    assert gpus.check([0]).ok


def test_failing_xid_events_are_a_problem() -> None:
    nvml = fake(2)
    gpus = open_gpus(nvml)
    nvml.xid_error = NVML_ERROR_GPU_IS_LOST
    nvml.gpus[1].handle_error = NVML_ERROR_GPU_IS_LOST
    assert [(p.index, p.kind) for p in gpus.check([0, 1]).problems] == [
        (1, ProblemKind.LOST),
        (None, ProblemKind.NVML_ERROR),
    ]


def test_health_and_facts_as_json() -> None:
    lost = FakeGpu("GPU-bb", handle_error=NVML_ERROR_GPU_IS_LOST)
    gpus = open_gpus(FakeNvml([FakeGpu("GPU-aa", ecc=[1]), lost]))
    facts = json.loads(json.dumps([f.to_dict() for f in gpus.facts([0, 1])]))
    health = json.loads(json.dumps(gpus.check([0, 1]).to_dict()))
    ecc = "GPU 0: 1 volatile uncorrectable ECC errors"
    gone = "GPU 1: fallen off the bus (error 15)"
    assert facts == [
        {"index": 0, "uuid": "GPU-aa", "name": "NVIDIA H100 80GB HBM3",
         "memory_used_bytes": 3 << 30, "memory_total_bytes": 80 << 30,
         "utilisation_percent": 97},
        {"index": 1, "uuid": None, "name": None, "memory_used_bytes": None,
         "memory_total_bytes": None, "utilisation_percent": None},
    ]
    assert health == {
        "ok": False,
        "reason": f"{ecc}; {gone}",
        "checked": [0, 1],
        "problems": [
            {"index": 0, "kind": "ecc-uncorrected", "reason": ecc},
            {"index": 1, "kind": "lost", "reason": gone},
        ],
    }


# --- watching during training ----------------------------------------------------------


async def test_watch_health_returns_the_problem_that_appears_later() -> None:
    nvml = FakeNvml([FakeGpu("GPU-0"), FakeGpu("GPU-1", ecc=[0, 0, 2])])
    gpus = open_gpus(nvml)
    problem = await asyncio.wait_for(gpus.watch_health([0, 1], interval=0), timeout=10)
    assert problem == GpuProblem(
        1, ProblemKind.ECC_UNCORRECTED, "GPU 1: 2 volatile uncorrectable ECC errors"
    )
    assert nvml.ecc_reads == 6  # three rounds over two GPUs: healthy twice, then not


async def test_watch_health_keeps_the_loop_running_while_nvml_blocks() -> None:
    gate = threading.Event()
    gpu = FakeGpu("GPU-0", ecc=[5], ecc_gate=gate)
    watch = asyncio.create_task(open_gpus(FakeNvml([gpu])).watch_health([0], interval=0))
    # Reaching this await while the NVML call is stuck proves the loop is not blocked.
    assert await asyncio.to_thread(gpu.ecc_entered.wait, 10)
    assert not watch.done()
    gate.set()
    problem = await asyncio.wait_for(watch, timeout=10)
    assert problem.kind is ProblemKind.ECC_UNCORRECTED


async def test_watch_health_with_nothing_to_watch_waits_without_checking() -> None:
    nvml = fake(0)
    watch = asyncio.create_task(open_gpus(nvml).watch_health([], interval=0))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not watch.done()
    watch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await watch
    assert nvml.ecc_reads == 0


# --- memory of stopped workers, reclaimed before a restart -------------------------------

GIB = 1 << 30


async def test_a_restart_waits_until_the_stopped_workers_memory_is_free() -> None:
    held = [(4242, 30 * GIB), (4243, 2 * GIB + GIB // 2), (999, GIB)]  # 999: another user's process
    gpu = FakeGpu("GPU-0", processes=[held, held, held[1:], [(999, GIB)]])
    said: list[str] = []
    problem = await open_gpus(FakeNvml([gpu])).wait_released([0], {4242, 4243, 5000}, 60.0, said.append)
    assert problem is None
    assert said[0] == (
        "waiting up to 60s for the previous workers' GPU memory to be freed (GPU 0: 32.5 GiB (pids 4242, 4243))"
    )
    assert re.fullmatch(r"GPU memory of the previous workers freed after \d+\.\ds", said[1]) and len(said) == 2


async def test_memory_never_freed_makes_the_gpu_sick_after_the_bound() -> None:
    gpus = open_gpus(FakeNvml([FakeGpu("GPU-0"), FakeGpu("GPU-1", processes=[[(4242, None)]])]))
    said: list[str] = []
    problem = await gpus.wait_released([0, 1], {4242}, 0.3, said.append)
    assert problem == GpuProblem(
        1, ProblemKind.MEMORY_HELD, "GPU 1: memory (pid 4242) still held by the previous workers' processes "
        "0.3s after they stopped"
    )
    assert said == ["waiting up to 0.3s for the previous workers' GPU memory to be freed (GPU 1: memory (pid 4242))"]


@pytest.mark.parametrize(
    "gpu",
    [
        FakeGpu("GPU-0"),  # nothing there
        FakeGpu("GPU-0", processes=[[(999, GIB)]]),  # only someone else's
        FakeGpu("GPU-0", processes=[[(4242, GIB)]], unsupported=frozenset({"processes"})),  # NVML cannot tell
    ],
)
async def test_no_wait_when_nothing_of_the_workers_is_held(gpu: FakeGpu) -> None:
    said: list[str] = []
    assert await open_gpus(FakeNvml([gpu])).wait_released([0], {4242}, 60.0, said.append) is None
    assert said == []


async def test_a_gpu_lost_while_waiting_is_a_problem() -> None:
    gpu = FakeGpu("GPU-0", processes=[[(4242, GIB)]])
    gpus = open_gpus(FakeNvml([gpu]))
    gpu.handle_error = NVML_ERROR_GPU_IS_LOST
    problem = await gpus.wait_released([0], {4242}, 60.0, print)
    assert problem is not None and problem.kind is ProblemKind.LOST


# --- selection and the workers' environment ---------------------------------------------


@pytest.mark.parametrize(
    ("value", "visible"),
    [
        (None, (0, 1, 2, 3)),
        ("2,0", (2, 0)),
        (" 3 , 1 ", (3, 1)),
        ("", ()),
        ("-1", ()),
        ("0,7,1", (0,)),  # CUDA stops at the first invalid entry
        ("1,1,2", (1,)),
        ("GPU-22,GPU-00aa", (2, 0)),  # UUID prefixes
        ("GPU-", ()),  # ambiguous prefix
        ("MIG-1/0/0", ()),
    ],
)
def test_parse_visible_devices(value: str | None, visible: tuple[int, ...]) -> None:
    uuids = [f"GPU-{i:x}{i:x}aa-0000" for i in range(4)]
    assert parse_visible_devices(value, uuids) == visible


@given(st.text(alphabet="0123456789,-GPU ²١", max_size=20), st.integers(0, 8))
def test_parse_visible_devices_names_each_existing_gpu_at_most_once(value: str, n: int) -> None:
    visible = parse_visible_devices(value, [f"GPU-{i}" for i in range(n)])
    assert len(set(visible)) == len(visible)
    assert all(0 <= i < n for i in visible)


@given(st.text(alphabet="0123456789, x²", max_size=12), st.integers(0, 6))
def test_pick_devices_gives_distinct_visible_devices_or_a_usage_error(
    requested: str, n: int
) -> None:
    visible = tuple(range(10, 10 + n))
    try:
        picked = pick_devices(visible, requested, unhealthy=set())
    except UsageError as e:
        assert str(e).startswith(f"--gpus={requested}")
    else:
        assert picked and len(set(picked)) == len(picked) and set(picked) <= set(visible)


def test_pick_devices() -> None:
    assert pick_devices((3, 5, 6), None, unhealthy={5}) == (3, 6)
    assert pick_devices((3, 5, 6), "2,0", unhealthy=set()) == (6, 3)
    assert pick_devices((3, 5, 6), "1", unhealthy={5}) == (5,)  # named: the check refuses


@pytest.mark.parametrize(
    ("visible", "requested", "message"),
    [
        ((3, 5), "0,2", r"--gpus=0,2: '2' is not a visible GPU; this node shows 2 \(0 to 1\)"),
        ((3, 5), "0,x", r"--gpus=0,x: 'x' is not a visible GPU"),
        ((3, 5), "", r"--gpus=: '' is not a visible GPU"),
        ((3, 5), "1,1", r"--gpus=1,1: GPU 1 is named twice"),
        ((), "0", r"--gpus=0: this node shows no GPU"),
    ],
)
def test_pick_devices_rejects_bad_names(
    visible: tuple[int, ...], requested: str, message: str
) -> None:
    with pytest.raises(UsageError, match=message):
        pick_devices(visible, requested, unhealthy=set())


def test_select_honours_cuda_visible_devices_and_gpus_flag() -> None:
    nvml = fake(8)
    nvml.gpus[4].handle_error = NVML_ERROR_GPU_IS_LOST
    gpus = open_gpus(nvml)
    assert gpus.select({}, None).devices == (0, 1, 2, 3, 5, 6, 7)
    inherited = {"CUDA_VISIBLE_DEVICES": "6,4,2,GPU-33"}
    selection = gpus.select(inherited, None)
    assert selection.devices == (6, 2, 3)
    assert selection.health.unhealthy == {4}
    assert selection.nproc("gpu", cpu_count=2) == 3
    assert gpus.select(inherited, "3,0").devices == (3, 6)
    named_sick = gpus.select(inherited, "1")
    assert named_sick.devices == (4,)
    assert not gpus.check(named_sick.devices).ok  # the node refuses to join


def test_gpu_flag_names_cuda_visible_devices_when_it_hides_every_gpu() -> None:
    selection = open_gpus(fake(2)).select({"CUDA_VISIBLE_DEVICES": "-1"}, None)
    with pytest.raises(UsageError, match=r"no GPUs, CUDA_VISIBLE_DEVICES='-1'"):
        selection.nproc("gpu", cpu_count=2)


def test_worker_gpu_env() -> None:
    shared = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "6,2,3"}
    assert worker_gpu_env((6, 2, 3), local_rank=0, isolate=False) == shared
    assert worker_gpu_env((6, 2, 3), local_rank=2, isolate=False) == shared
    assert worker_gpu_env((6, 2, 3), local_rank=1, isolate=True) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "2",
    }
    assert worker_gpu_env((), local_rank=0, isolate=True) == {}
    with pytest.raises(UsageError, match=r"worker 3 has no GPU of its own: 3 GPU\(s\)"):
        worker_gpu_env((6, 2, 3), local_rank=3, isolate=True)
