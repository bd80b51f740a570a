"""A launch put together: `assemble` (pure) and `build_config`, which runs the three steps."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import replace

from elasticrun.agent.spec import Std, WorkerSpec
from elasticrun.launcher.config import LaunchConfig
from elasticrun.launcher.discover import HostFacts, discover
from elasticrun.launcher.parsing import LaunchRequest, forgiveness, parse_launch
from elasticrun.store.settings import SECRET_ENV


def assemble(request: LaunchRequest, host: HostFacts) -> LaunchConfig:
    """The launch configuration: a checked request completed with its host's facts."""
    rdzv = request.rdzv
    rdzv = replace(
        rdzv, local_addr=host.local_addr, store=host.store, settings=replace(rdzv.settings, run_id=host.run_id)
    )
    spec = request.job_spec
    store = host.store
    forgive_heartbeat, forgive_after = forgiveness(spec.forgive_progress)
    worker = WorkerSpec(
        run_id=host.run_id,
        entrypoint=request.entrypoint,
        nproc_per_node=host.nproc,
        node_id=host.node_id,
        role=spec.role,
        max_restarts=spec.max_restarts,
        options=request.worker_options,
        redirects=_per_rank(request.redirects, host.nproc),
        tee=_per_rank(request.tee, host.nproc),
        cpu_affinity=host.cpu_affinity,
        gpu_devices=host.gpu_devices,
        progress_timeout=spec.progress_timeout,
        progress_start_timeout=spec.progress_start_timeout,
        forgive_heartbeat=forgive_heartbeat,
        forgive_after=forgive_after,
        in_process=spec.elastic_mode == "in-process",
        step_timing=spec.straggler != "off",
        # the store's secrets stay in the agent; its workers get the token in a file
        withheld_env=store.secret_env if store is not None else SECRET_ENV,
        store_token=store.token if store is not None else None,
    )
    return LaunchConfig(
        rdzv=rdzv,
        worker=worker,
        job_spec=replace(spec, script_digest=host.script_digest),
        nproc_request=spec.nproc_per_node,
        gpu_names=host.gpu_names,
        agent=request.agent,
    )


def _per_rank(std: Std | dict[int, Std], nproc: int) -> dict[int, Std]:
    return {rank: std for rank in range(nproc)} if isinstance(std, Std) else std


def build_config(args: argparse.Namespace, environ: Mapping[str, str]) -> LaunchConfig:
    """The whole launch: its flags checked, then this host asked, then the two put together."""
    request = parse_launch(args, environ)
    return assemble(request, discover(request, environ))
