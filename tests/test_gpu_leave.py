"""GPU health with real agents and workers: NVML is faked (no GPU here), nothing else is.

Two agents share an in-memory store in this process and run real worker processes.
One node's GPU reports an uncorrectable ECC error while training: that node leaves
gracefully, quarantined, and the other goes on alone. A node whose GPU is already sick never joins.
A failed worker's memory, still held after it is gone, is waited for before the next
worker starts; memory that is never freed makes the node leave.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from elasticrun.agent.agent import Agent, AgentResult
from elasticrun.agent.gpu import open_gpus
from elasticrun.agent.spec import WorkerOptions, WorkerSpec, WorkerState
from elasticrun.errors import EXIT_INFRASTRUCTURE, GpuUnhealthyError
from elasticrun.launcher.launch import gpu_reclaim, gpu_watches
from elasticrun.rendezvous.codec import decode
from elasticrun.rendezvous.elastic import ElasticRendezvous
from elasticrun.rendezvous.keys import Keys
from elasticrun.rendezvous.records import Event, JobSpec, NodeInfo, QuarantineTable
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.store.server.memory import MemoryStore
from tests.support.agent_helpers import make_spec, static_for, write_script
from tests.support.helpers import eventually
from tests.test_gpu import FakeGpu, FakeNvml

pytestmark = pytest.mark.timeout(60)

TICKER = Path(__file__).resolve().parent / "workers" / "tick_worker.py"


def node(
    store: MemoryStore, name: str, stop_file: Path, tmp: Path, max_nodes: int = 2
) -> tuple[WorkerSpec, ElasticRendezvous]:
    settings = RendezvousSettings(run_id="gpu", min_nodes=1, max_nodes=max_nodes, last_call=0.2, heartbeat_ttl=2.0)
    spec = WorkerSpec(
        run_id="gpu",
        entrypoint=(sys.executable, "-u", str(TICKER), "--stop-file", str(stop_file), "--every", "0.05"),
        nproc_per_node=1,
        node_id=name,
        options=WorkerOptions(stop_grace=5.0, log_dir=tmp / "logs"),
        gpu_devices=(0,),
    )
    me = NodeInfo(node_id=name, host="localhost", addr="127.0.0.1", nproc=1, pid=os.getpid(), started_at=0.0)
    return spec, ElasticRendezvous(store, settings, me, spec=JobSpec(command=("tick",)))


async def wait_for(predicate, what: str) -> None:
    await eventually(predicate, 30, interval=0.05)


def test_sick_gpu_keeps_the_node_out():
    gpus = open_gpus(FakeNvml([FakeGpu(uuid="GPU-aa", ecc=[2])]))
    with pytest.raises(GpuUnhealthyError, match="does not join: .*GPU 0.*uncorrect"):
        gpu_watches(gpus, (0,), 0.1)


async def test_gpu_failing_during_training_makes_the_node_leave(tmp_path):
    store = MemoryStore()
    stop = tmp_path / "stop"
    healthy_gpu, failing_gpu = FakeGpu(uuid="GPU-aa"), FakeGpu(uuid="GPU-bb")
    spec_a, rdzv_a = node(store, "node-a", stop, tmp_path)
    spec_b, rdzv_b = node(store, "node-b", stop, tmp_path)
    watches_a = gpu_watches(open_gpus(FakeNvml([healthy_gpu])), (0,), 0.05)
    watches_b = gpu_watches(open_gpus(FakeNvml([failing_gpu])), (0,), 0.05)
    agent_a = asyncio.ensure_future(Agent(spec_a, rdzv_a, watches=watches_a).run())
    agent_b = asyncio.ensure_future(Agent(spec_b, rdzv_b, watches=watches_b).run())
    try:
        await wait_for(lambda: rdzv_a._job.head is not None and rdzv_a._job.head.world_size == 2, "world size 2")
        round_at_two = rdzv_a._job.head.number
        failing_gpu.ecc = [3]  # an uncorrectable ECC error appears on node-b's GPU
        result_b = await asyncio.wait_for(agent_b, 30)
        assert result_b.exit_code == EXIT_INFRASTRUCTURE
        assert "GPU problem, leaving the job" in result_b.message and "uncorrect" in result_b.message
        # node-a goes on alone, in a new round
        await wait_for(
            lambda: rdzv_a._job.head.number > round_at_two and rdzv_a._job.head.world_size == 1, "world size 1"
        )
        await wait_for(lambda: rdzv_a._last_round == rdzv_a._job.head.number, "node-a running the new round")
        events = [decode(Event, kv.value) for kv in (await store.get_prefix(Keys("gpu").events)).kvs]
        assert any(e.node == "node-b" and "GPU problem" in e.detail for e in events)
        # it asked to be kept out: the round that let it go quarantined it, with the reason
        quarantine = await store.get(Keys("gpu").quarantine)
        assert quarantine is not None
        held = decode(QuarantineTable, quarantine.value).get("node-b")
        assert held is not None and held.active(time.time()) and "uncorrect" in held.reason
        stop.touch()
        result_a = await asyncio.wait_for(agent_a, 30)
        assert result_a.exit_code == 0
    finally:
        stop.touch()
        for task in (agent_a, agent_b):
            if not task.done():
                task.cancel()
        await asyncio.gather(agent_a, agent_b, return_exceptions=True)
        await store.close()



async def test_a_spare_whose_gpu_fails_leaves_before_it_steps_in(tmp_path):
    store = MemoryStore()
    stop = tmp_path / "stop"
    spare_gpu = FakeGpu(uuid="GPU-bb")
    spec_a, rdzv_a = node(store, "node-a", stop, tmp_path, max_nodes=1)
    spec_b, rdzv_b = node(store, "node-b", stop, tmp_path, max_nodes=1)
    agent_a = asyncio.ensure_future(Agent(spec_a, rdzv_a).run())
    try:
        await wait_for(lambda: rdzv_a._last_round >= 1, "node-a running")
        watches_b = gpu_watches(open_gpus(FakeNvml([spare_gpu])), (0,), 0.05)
        agent_b = asyncio.ensure_future(Agent(spec_b, rdzv_b, watches=watches_b).run())
        await wait_for(lambda: rdzv_b._lease is not None, "node-b registered, a spare")
        spare_gpu.ecc = [1]  # its GPU fails while it waits
        result_b = await asyncio.wait_for(agent_b, 30)
        assert result_b.exit_code == EXIT_INFRASTRUCTURE and "uncorrect" in result_b.message
        assert rdzv_a._last_round == 1  # the running round was never disturbed

        async def held() -> bool:
            kv = await store.get(Keys("gpu").quarantine)
            entry = decode(QuarantineTable, kv.value).get("node-b") if kv is not None else None
            return entry is not None and "uncorrect" in entry.reason

        async with asyncio.timeout(30):
            while not await held():
                await asyncio.sleep(0.05)
        stop.touch()
        assert (await asyncio.wait_for(agent_a, 30)).exit_code == 0
    finally:
        stop.touch()
        if not agent_a.done():
            agent_a.cancel()
        await asyncio.gather(agent_a, return_exceptions=True)
        await store.close()

# --- memory of stopped workers, reclaimed before a restart -----------------------------------

FAIL_ONCE = """
import os, sys, time
from pathlib import Path

folder, attempt = Path(__file__).parent, os.environ["TORCHELASTIC_RESTART_COUNT"]
(folder / f"pid.{attempt}.new").write_text(str(os.getpid()))
(folder / f"pid.{attempt}.new").rename(folder / f"pid.{attempt}")
if attempt == "0":
    while not (folder / "go").exists():
        time.sleep(0.02)
    sys.exit(1)  # fails once; its memory is held a while after it is gone
"""


async def restart_after_failure(tmp_path: Path, gpu: FakeGpu, held: Callable[[int], list], limit: float) -> AgentResult:
    """A one-worker node on a fake GPU whose first worker fails: NVML says it holds
    memory (`held(pid)`: the process lists it returns from then on)."""
    script = write_script(tmp_path, "fail_once.py", FAIL_ONCE)
    spec = make_spec(script, max_restarts=1, gpu_devices=(0,), log_dir=tmp_path / "logs")
    agent = Agent(spec, static_for(spec), reclaim=gpu_reclaim(open_gpus(FakeNvml([gpu])), (0,), limit))
    run = asyncio.ensure_future(agent.run())
    try:
        first = tmp_path / "pid.0"
        await eventually(first.exists, 30)
        gpu.processes = held(int(first.read_text()))
        (tmp_path / "go").touch()
        return await asyncio.wait_for(run, 60)
    finally:
        (tmp_path / "go").touch()
        if not run.done():
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)


async def test_the_next_workers_start_once_the_memory_of_the_failed_ones_is_free(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    gpu = FakeGpu(uuid="GPU-aa")
    result = await restart_after_failure(tmp_path, gpu, lambda pid: [[(pid, 8 << 30)]] * 3 + [[]], limit=60.0)
    assert result.exit_code == 0, result.message
    pid = int((tmp_path / "pid.0").read_text())
    lines = [r.getMessage() for r in caplog.records]
    waiting = lines.index(
        f"waiting up to 60s for the previous workers' GPU memory to be freed (GPU 0: 8.0 GiB (pid {pid}))"
    )
    freed = next(i for i, line in enumerate(lines) if line.startswith("GPU memory of the previous workers freed after"))
    restarted = max(i for i, line in enumerate(lines) if line.startswith("workers init -> healthy: round 1"))
    assert waiting < freed < restarted  # the next worker started once the memory was free
    assert gpu.processes == [[]]  # every look until then was taken


async def test_memory_never_freed_makes_the_node_leave_as_with_a_sick_gpu(tmp_path):
    gpu = FakeGpu(uuid="GPU-aa")
    result = await restart_after_failure(tmp_path, gpu, lambda pid: [[(pid, 8 << 30)]], limit=0.3)
    pid = int((tmp_path / "pid.0").read_text())
    assert (result.state, result.exit_code) == (WorkerState.STOPPED, EXIT_INFRASTRUCTURE)
    assert result.message == (
        f"GPU problem, leaving the job: GPU 0: 8.0 GiB (pid {pid}) still held by the previous workers' processes "
        "0.3s after they stopped"
    )
    assert not (tmp_path / "pid.1").exists()  # no worker started on the GPU
