"""GPU health in a real multi-agent run: NVML is faked (no GPU here), nothing else is.

Two agents share an in-memory store in this process and run real worker processes.
One node's GPU reports an uncorrectable ECC error while training: that node leaves
gracefully, quarantined, and the other goes on alone. A node whose GPU is already sick never joins.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from elasticrun.agent.agent import Agent
from elasticrun.agent.gpu import open_gpus
from elasticrun.agent.spec import WorkerSpec
from elasticrun.errors import EXIT_INFRASTRUCTURE, GpuUnhealthyError
from elasticrun.launcher.launch import gpu_watches
from elasticrun.rendezvous.decide import RendezvousSettings
from elasticrun.rendezvous.elastic import ElasticRendezvous
from elasticrun.rendezvous.state import Event, JobSpec, Keys, NodeInfo, QuarantineTable, decode
from elasticrun.store.memory import MemoryStore
from tests.agent_helpers import eventually
from tests.test_gpu import FakeGpu, FakeNvml

pytestmark = pytest.mark.timeout(60)

TICKER = Path(__file__).resolve().parent / "workers" / "tick_worker.py"


def node(store: MemoryStore, name: str, stop_file: Path, tmp: Path) -> tuple[WorkerSpec, ElasticRendezvous]:
    settings = RendezvousSettings(run_id="gpu", min_nodes=1, max_nodes=2, last_call=0.2, heartbeat_ttl=2.0)
    spec = WorkerSpec(
        run_id="gpu",
        entrypoint=(sys.executable, "-u", str(TICKER), "--stop-file", str(stop_file), "--every", "0.05"),
        nproc_per_node=1,
        node_id=name,
        stop_grace=5.0,
        log_dir=tmp / "logs",
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
