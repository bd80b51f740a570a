"""What this host answers for a launch request: `discover` -> `HostFacts`.

Whether the training script or command exists, the GPUs (through NVML) and CPUs, the
address on the route to the store, the node id, a fresh id for a `--standalone` job,
and the store's settings with the files they name (`elasticrun.store.settings`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from elasticrun.agent.spec import default_node_id
from elasticrun.errors import UsageError
from elasticrun.launcher.flag_values import digits_only
from elasticrun.launcher.parsing import RUN_PATH_MODULE, LaunchRequest, parse_endpoint
from elasticrun.launcher.rdzv_conf import settings_from_flags
from elasticrun.rendezvous.records import JobSpec, script_at
from elasticrun.store.settings import StoreAccess, parse_access


@dataclass(frozen=True)
class HostFacts:
    """What this host answers for one launch request (see `discover`)."""

    node_id: str
    #: the request's run id, or a fresh one for a --standalone job
    run_id: str
    #: this node's address as the other nodes' workers reach it
    local_addr: str
    nproc: int
    #: the workers' GPUs, in local-rank order, and their names (for status)
    gpu_devices: tuple[int, ...]
    gpu_names: tuple[str, ...]
    #: c10d and etcd: the store's settings, read
    store: StoreAccess | None = None
    #: --numa-binding: local rank -> the CPUs it runs on
    cpu_affinity: Mapping[int, frozenset[int]] = field(default_factory=dict)
    #: sha256 of the training script ("" for a module, a program, or one too large)
    script_digest: str = ""


def discover(request: LaunchRequest, environ: Mapping[str, str]) -> HostFacts:
    """Ask this host what `request` leaves open; a missing script or GPU is a usage error."""
    check_command(request.job_spec)
    python = request.entrypoint[0]
    if not request.job_spec.no_python and shutil.which(python) is None:
        raise UsageError(f"PYTHON_EXEC: interpreter not found: {python}")
    if "TORCHELASTIC_HEALTH_CHECK_PORT" in environ:
        # as torchrun, whose health check server is a stub in PyTorch's own build
        logging.getLogger("elasticrun").warning(
            "TORCHELASTIC_HEALTH_CHECK_PORT=%s: no health check server started, as under torchrun "
            "(watch the agent with elasticrun status)", environ["TORCHELASTIC_HEALTH_CHECK_PORT"]
        )
    rdzv = request.rdzv
    nproc, devices, names = resolve_workers(request.job_spec.nproc_per_node, request.gpus, environ)
    local_addr = rdzv.local_addr or route_addr(parse_endpoint(rdzv.endpoint.split(",")[0], 1)[0])
    store = None
    if rdzv.backend in ("c10d", "etcd"):
        with settings_from_flags():
            store = parse_access(rdzv.backend, rdzv.endpoint, rdzv.conf, environ)
    return HostFacts(
        node_id=default_node_id(),
        run_id=rdzv.settings.run_id or uuid.uuid4().hex[:12],
        local_addr=local_addr,
        nproc=nproc,
        gpu_devices=devices,
        gpu_names=names,
        store=store,
        cpu_affinity=numa_affinity(request.numa_binding, devices, nproc) if request.numa_binding else {},
        script_digest=script_digest(request.job_spec),
    )


#: the largest script whose content is compared between nodes; a larger "script" is
#: data or a bundle, and reading it at every start would cost more than it tells
_DIGEST_LIMIT = 4 << 20


def script_digest(spec: JobSpec) -> str:
    """sha256 of the Python script the workers run, so that nodes can tell that theirs differ.

    A module is found only by the workers' interpreter and a --no-python program may
    be anything: neither is read."""
    at = script_at(spec.command)
    if spec.no_python or at is None:
        return ""
    try:
        with open(spec.command[at], "rb") as f:
            content = f.read(_DIGEST_LIMIT + 1)
    except OSError:
        return ""
    return hashlib.sha256(content).hexdigest() if len(content) <= _DIGEST_LIMIT else ""


def numa_affinity(mode: str, devices: tuple[int, ...], nproc: int) -> dict[int, frozenset[int]]:
    """--numa-binding: each local rank's CPUs, near the GPU it uses (`devices[rank]`)."""
    from elasticrun.agent.gpu import open_gpus
    from elasticrun.agent.numa import cpus_near, host_topology

    if len(devices) < nproc:
        raise UsageError(
            f"--numa-binding needs a GPU for each worker: {nproc} worker(s), {len(devices)} GPU(s) selected"
        )
    if shutil.which("taskset") is None:
        raise UsageError("--numa-binding needs taskset (util-linux) on this host")
    gpus = open_gpus()
    try:
        bus_ids = gpus.pci_bus_ids()
    finally:
        gpus.close()
    topology = host_topology()
    return {rank: cpus_near(mode, devices[rank], bus_ids, topology) for rank in range(nproc)}


def check_command(spec: JobSpec) -> None:
    """That what the workers run exists here: the script, or the --no-python command."""
    target = spec.command[0]
    if spec.command[:2] == ("-m", RUN_PATH_MODULE) and len(spec.command) > 2:
        if not Path(spec.command[2]).exists():
            raise UsageError(f"--run-path: training script not found: {spec.command[2]}")
        return
    if spec.no_python:
        if shutil.which(target) is None:
            raise UsageError(f"--no-python: command not found: {target}")
        return
    if target == "-m":
        return  # a module is found by the workers' interpreter, on their sys.path
    try:
        found = Path(target).is_file()
    except OSError:  # a name too long for the file system, say
        found = False
    if not found:
        raise UsageError(f"training script not found: {target}")


def route_addr(host: str) -> str:
    """The address of this host on the route towards `host` (no packet is sent)."""
    try:
        info = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as s:
            s.connect(info[4])
            return str(s.getsockname()[0])
    except (OSError, UnicodeError):
        return socket.getfqdn()


def resolve_workers(
    value: str, gpus_flag: str | None, environ: Mapping[str, str]
) -> tuple[int, tuple[int, ...], tuple[str, ...]]:
    """--nproc-per-node and --gpus -> (workers, their GPUs in local-rank order, the GPUs' names).

    --nproc-per-node is N, `cpu`, `gpu` (every usable GPU), `xpu` (every Intel GPU) or
    `auto` (GPUs, else XPUs, else CPUs, as torchrun)."""
    from elasticrun.agent.gpu import open_gpus
    from elasticrun.agent.xpu import intel_xpus

    gpus = open_gpus()
    try:
        selection = gpus.select(environ, gpus_flag)
        if digits_only(value):
            nproc = int(value)
        elif value == "cpu":
            nproc = os.cpu_count() or 1
        elif value == "xpu" or (value == "auto" and not selection.devices and intel_xpus(environ)):
            nproc = intel_xpus(environ)
            if not nproc:
                raise UsageError(
                    "--nproc-per-node=xpu needs an Intel GPU (XPU), but this node shows none; "
                    "use --nproc-per-node=auto, cpu or a number"
                )
        else:
            nproc = selection.nproc(value, os.cpu_count() or 1)
        devices = selection.devices
        names = tuple(f.name or "GPU" for f in gpus.facts(devices))
    finally:
        gpus.close()
    return nproc, devices, names
