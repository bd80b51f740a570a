"""--numa-binding: torchrun's four modes over a fake sysfs tree and fake NVML, and a
worker that really runs bound (taskset)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import elasticrun
from elasticrun.agent import gpu, numa
from elasticrun.agent.numa import Topology, cpu_list, cpus_near, parse_cpu_list
from elasticrun.errors import UsageError
from elasticrun.launcher import launch
from tests.test_gpu import FakeGpu, FakeNvml

pytestmark = pytest.mark.timeout(60)

#: GPUs by NVML index -> their NUMA node: two share node 0, one each on nodes 1 and 2
BUS_IDS = ("00000000:1A:00.0", "00000000:1B:00.0", "00000000:5C:00.0", "00000001:9D:00.0")
GPU_NODE = {"0000:1a:00.0": 0, "0000:1b:00.0": 0, "0000:5c:00.0": 1, "0001:9d:00.0": 2}
#: node -> CPUs; nodes 0 and 1 on socket 0, node 2 on socket 1; two hyperthreads a core;
#: node 0 has two last-level caches of two cores each
NODE_CPUS = {0: "0-7", 1: "8-11", 2: "12-15"}


def fake_sysfs(root: Path, node_cpus: dict[int, str] = NODE_CPUS) -> Path:
    def write(path: str, text: str) -> None:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text + "\n")

    for address, node in GPU_NODE.items():
        write(f"sys/bus/pci/devices/{address}/numa_node", str(node))
    write("sys/devices/system/node/possible", cpu_list(node_cpus))
    for node, cpus in node_cpus.items():
        write(f"sys/devices/system/node/node{node}/cpulist", cpus)
        for cpu in parse_cpu_list(cpus):
            base = f"sys/devices/system/cpu/cpu{cpu}"
            write(f"{base}/topology/physical_package_id", "0" if node < 2 else "1")
            write(f"{base}/topology/thread_siblings_list", f"{cpu & ~1}-{cpu | 1}")
            write(f"{base}/cache/index0/type", "Instruction")
            write(f"{base}/cache/index0/level", "1")
            write(f"{base}/cache/index0/shared_cpu_list", str(cpu))
            write(f"{base}/cache/index3/type", "Unified")
            write(f"{base}/cache/index3/level", "3")
            write(f"{base}/cache/index3/shared_cpu_list", f"{cpu & ~3}-{cpu | 3}")
    return root


@pytest.mark.parametrize(("mode", "expected"), [
    ("node", ["0-7", "0-7", "8-11", "12-15"]),
    ("socket", ["0-11", "0-11", "0-11", "12-15"]),
    # node 0's four cores shared by its two GPUs; alone on its node a GPU gets all
    ("exclusive", ["0-3", "4-7", "8-11", "12-15"]),
    ("core-complex", ["0-3", "4-7", "8-11", "12-15"]),
])
def test_the_modes_of_torchrun(tmp_path: Path, mode: str, expected: list[str]) -> None:
    topo = Topology(fake_sysfs(tmp_path), frozenset(range(16)))
    assert [cpu_list(cpus_near(mode, g, BUS_IDS, topo)) for g in range(4)] == expected


def test_only_cpus_the_agent_may_use_and_enough_cores(tmp_path: Path) -> None:
    topo = Topology(fake_sysfs(tmp_path), frozenset(range(16)) - {7, 8})
    assert cpu_list(cpus_near("node", 1, BUS_IDS, topo)) == "0-6"
    assert cpu_list(cpus_near("node", 2, BUS_IDS, topo)) == "9-11"
    small = Topology(fake_sysfs(tmp_path / "small", {0: "0-1", 1: "8-11", 2: "12-15"}), frozenset(range(16)))
    with pytest.raises(UsageError, match="NUMA node 0 has 1 physical cores for 2 GPUs"):
        cpus_near("exclusive", 0, BUS_IDS, small)


def test_a_worker_runs_on_the_cpus_near_its_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two CPUs to tell a binding apart")
    near = allowed[-1]
    topo = Topology(fake_sysfs(tmp_path / "sys", {0: str(near), 1: "8-11", 2: "12-15"}), frozenset(allowed))
    fake = FakeNvml([FakeGpu(uuid="GPU-aa", bus_id=BUS_IDS[0])])
    monkeypatch.setattr(gpu, "open_gpus", lambda nvml=None: gpu.Gpus(fake, 1))
    monkeypatch.setattr(launch, "open_gpus", lambda nvml=None: gpu.Gpus(fake, 1))
    monkeypatch.setattr(numa, "host_topology", lambda: topo)
    script = tmp_path / "affinity.py"
    script.write_text("import os, sys\nopen(sys.argv[1], 'w').write(str(sorted(os.sched_getaffinity(0))))\n")
    out = tmp_path / "seen"
    elasticrun.launch(str(script), out, standalone=True, numa_binding="node", nproc_per_node=1)
    assert out.read_text() == str([near])
