"""--numa-binding: the CPUs near each worker's GPU, as torchrun's `torch.numa.binding`.

The GPU's NUMA node comes from sysfs through its PCI address (read with NVML, so no
torch and no CUDA context in the agent); the CPUs from the node's `cpulist`, only those
this agent may run on. The modes are torchrun's:

- `node`: every allowed CPU of the GPU's NUMA node;
- `socket`: every allowed CPU of the NUMA nodes on the GPU's socket;
- `exclusive`: the node's physical cores shared out among the node's GPUs (the lower
  GPUs get one more core when they do not divide evenly), with their hyperthreads;
- `core-complex`: one group of cores sharing the last-level cache per GPU.

`Topology` reads a sysfs tree under `root`, so that tests give it a fake one. The
workers are then started under `taskset --cpu-list` (util-linux, as `setpriv`), which
sets the affinity before the worker's first instruction, as torchrun's `numactl
--physcpubind` does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from elasticrun.errors import UsageError

MODES = ("node", "socket", "exclusive", "core-complex")


def parse_cpu_list(text: str) -> set[int]:
    """`0-3,8,10-11` (sysfs's list format) -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def cpu_list(cpus: Iterable[int]) -> str:
    """The reverse of `parse_cpu_list`: sorted, runs as ranges."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def sysfs_pci_address(nvml_bus_id: str) -> str:
    """NVML's `00000000:3B:00.0` as sysfs names the device: `0000:3b:00.0`."""
    domain, _, rest = nvml_bus_id.strip().lower().partition(":")
    return f"{int(domain, 16):04x}:{rest}"


@dataclass(frozen=True)
class Topology:
    """This host's CPUs and NUMA nodes, as sysfs under `root` has them."""

    root: Path = Path("/")
    #: the CPUs this process may run on (os.sched_getaffinity(0))
    allowed: frozenset[int] = frozenset()

    def _read(self, path: str) -> str:
        try:
            return (self.root / path).read_text().strip()
        except OSError as e:
            raise UsageError(f"--numa-binding: cannot read /{path}: {e.strerror or e}") from None

    def node_of_gpu(self, bus_id: str) -> int:
        # a host with one NUMA node often says -1: that node is 0
        return max(int(self._read(f"sys/bus/pci/devices/{sysfs_pci_address(bus_id)}/numa_node")), 0)

    def node_cpus(self, node: int) -> set[int]:
        return parse_cpu_list(self._read(f"sys/devices/system/node/node{node}/cpulist")) & self.allowed

    def nodes(self) -> set[int]:
        return parse_cpu_list(self._read("sys/devices/system/node/possible"))

    def socket_of(self, cpu: int) -> int:
        return int(self._read(f"sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id"))

    def core_of(self, cpu: int) -> int:
        """A physical core, named by its lowest hyperthread."""
        return min(parse_cpu_list(self._read(f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")))

    def last_cache_of(self, cpu: int) -> int:
        """The last-level (unified or data) cache, named by its lowest CPU."""
        best, shared = -1, {cpu}
        caches = self.root / f"sys/devices/system/cpu/cpu{cpu}/cache"
        for index in sorted(caches.glob("index[0-9]*")):
            if self._read(str(index.relative_to(self.root) / "type")) not in ("Unified", "Data"):
                continue
            level = int(self._read(str(index.relative_to(self.root) / "level")))
            if level > best:
                best = level
                shared = parse_cpu_list(self._read(str(index.relative_to(self.root) / "shared_cpu_list")))
        return min(shared)


def host_topology() -> Topology:
    """This host's topology (tests put a fake sysfs tree in its place)."""
    return Topology(Path("/"), frozenset(os.sched_getaffinity(0)))


def _groups(cpus: set[int], key: Callable[[int], int]) -> list[set[int]]:
    grouped: dict[int, set[int]] = {}
    for cpu in cpus:
        grouped.setdefault(key(cpu), set()).add(cpu)
    return [grouped[k] for k in sorted(grouped)]


def cpus_near(mode: str, gpu: int, bus_ids: Sequence[str], topo: Topology) -> frozenset[int]:
    """The CPUs a worker on NVML device `gpu` is bound to.

    `bus_ids` holds every GPU's PCI address by NVML index (for the modes that share a
    node among its GPUs)."""
    node = topo.node_of_gpu(bus_ids[gpu])
    if mode == "node":
        cpus = topo.node_cpus(node)
    elif mode == "socket":
        socket = topo.socket_of(min(topo.node_cpus(node)))
        cpus = set().union(*(topo.node_cpus(n) for n in topo.nodes() if topo.node_cpus(n)
                             and topo.socket_of(min(topo.node_cpus(n))) == socket))
    else:
        peers = sorted(g for g in range(len(bus_ids)) if topo.node_of_gpu(bus_ids[g]) == node)
        mine = peers.index(gpu)
        if mode == "exclusive":
            cores = _groups(topo.node_cpus(node), topo.core_of)
            share, extra = divmod(len(cores), len(peers))
            if share < 1:
                raise UsageError(
                    f"--numa-binding=exclusive: NUMA node {node} has {len(cores)} physical cores for "
                    f"{len(peers)} GPUs"
                )
            start = mine * share + min(mine, extra)
            cpus = set().union(*cores[start:start + share + (mine < extra)])
        else:  # core-complex: the caches with the most CPUs first, then the lowest
            caches = sorted(_groups(topo.node_cpus(node), topo.last_cache_of), key=lambda c: (-len(c), min(c)))
            cpus = caches[mine % len(caches)]
    if not cpus:
        raise UsageError(f"--numa-binding={mode}: no CPU this agent may use is near GPU {gpu}")
    return frozenset(cpus)
