"""Wire one launch together: the store, the rendezvous handler and the agent.

For `--rdzv-backend=c10d` the agent on the endpoint's host serves the built-in store
in-process (as torchrun's agent hosts its TCPStore) and uses its engine directly; the
other agents connect to it. When the job ends, the hosting agent leaves the job, then
keeps serving until the other nodes have left too, so that none of them loses the store
while finishing (a lone agent exits at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Set
from dataclasses import replace
from typing import TYPE_CHECKING

from elasticrun.agent.agent import Agent, AgentResult, Reclaim, Watch
from elasticrun.agent.gpu import RECLAIM_LIMIT, Gpus, open_gpus
from elasticrun.agent.health_check import CheckResult, HealthCheck
from elasticrun.agent.undumpable import forbid_dumps
from elasticrun.descriptors import quiet_exhaustion
from elasticrun.errors import GpuUnhealthyError, HealthCheckError
from elasticrun.first_of import first_of
from elasticrun.launcher import log_format
from elasticrun.launcher.config import LaunchConfig, RendezvousConfig
from elasticrun.launcher.gc_settings import settle_gc
from elasticrun.launcher.metrics_http import serving
from elasticrun.launcher.parsing import DEFAULT_RUN_ID
from elasticrun.launcher.rdzv_conf import rdzv_flag, settings_from_flags
from elasticrun.launcher.succession import Succession
from elasticrun.loglines import HEADLINE
from elasticrun.rendezvous.codec import decode
from elasticrun.rendezvous.elastic import ElasticRendezvous
from elasticrun.rendezvous.handler import RendezvousHandler
from elasticrun.rendezvous.keys import Keys
from elasticrun.rendezvous.records import NodeInfo
from elasticrun.rendezvous.rounds import RoundHead
from elasticrun.rendezvous.static import StaticRendezvous
from elasticrun.rendezvous.succession import MIN_NODES_TO_FAIL_OVER, read_successors
from elasticrun.store.client.first_contact import first_contact
from elasticrun.store.interface import EventType, Store
from elasticrun.store.server.memory import MemoryStore
from elasticrun.store.settings import exposure_warning, open_client, serve_here

if TYPE_CHECKING:  # loaded only when metrics are asked for
    from elasticrun.agent.metrics import AgentMetrics
    from elasticrun.store.server.metrics import StoreMetrics
    from elasticrun.store.server.store_server import StoreServer

log = logging.getLogger("elasticrun")

#: how long the store-hosting agent waits for the other nodes to leave after the job
_HOST_LINGER = 300.0


def run_launch(config: LaunchConfig) -> int:
    """Run this node's part of the job; return the process exit code.

    The agent's process (the CLI's: `elasticrun.launch` leaves its caller's process as
    it is) is closed to the other processes of its user (`forbid_dumps`), so that its
    workers cannot read the store's token out of /proc, and drops the secrets' variables
    once read (into `config`), so that nothing it starts later inherits them."""
    forbid_dumps()
    for name in config.worker.withheld_env:
        os.environ.pop(name, None)
    settle_gc()
    log_format.tag(config.worker.node_id)
    return asyncio.run(_run_node_quietly(config)).exit_code


async def _run_node_quietly(config: LaunchConfig) -> AgentResult:
    """`run_node`, its loop saying once a minute that it is out of descriptors (a flood of connections)."""
    quiet_exhaustion(asyncio.get_running_loop())
    return await run_node(config)


async def run_node(config: LaunchConfig) -> AgentResult:
    """This node's part of the job, to its end (the CLI's and `elasticrun.launch`'s).

    With `config.agent.metrics`, it serves the agent's Prometheus metrics (and the hosted
    store's) there."""
    agent, worker = config.agent, config.worker
    metrics_at = agent.metrics
    async with contextlib.AsyncExitStack() as stack:
        watches, reclaim = [], None
        if worker.gpu_devices:
            gpus = open_gpus()
            stack.callback(gpus.close)
            watches = gpu_watches(gpus, worker.gpu_devices, agent.health_interval)
            reclaim = gpu_reclaim(gpus, worker.gpu_devices, RECLAIM_LIMIT)
        metrics = store_metrics = None
        if metrics_at is not None:  # the library is loaded only when asked for
            from elasticrun.agent.metrics import AgentMetrics
            from elasticrun.store.server.metrics import StoreMetrics

            metrics = AgentMetrics(worker.run_id, worker.node_id, health_check=bool(agent.health_check))
            store_metrics = StoreMetrics(metrics.registry)
        if agent.health_check is not None:
            env = {k: v for k, v in os.environ.items() if k not in worker.withheld_env}
            check = HealthCheck(agent.health_check, agent.health_check_timeout, env)
            watches += await health_check_watches(check, agent.health_interval, metrics)
        events = None
        if agent.event_log_handler != "null":
            from elasticrun.launcher.event_log import torch_event_sink

            events = torch_event_sink(
                agent.event_log_handler, run_id=worker.run_id, role=worker.role, backend=config.rdzv.backend,
                entrypoint=os.path.basename(worker.entrypoint[0]),  # as torchrun's: the program it runs
            )
        layout = None
        if agent.logs_specs is not None:
            from elasticrun.launcher.torchrun_logs_specs import torch_log_layout

            layout = torch_log_layout(
                agent.logs_specs, log_dir=str(worker.options.log_dir) if worker.options.log_dir else None,
                redirects=agent.std_flags[0], tee=agent.std_flags[1],
                local_ranks_filter=worker.options.local_ranks_filter,
            )
        handler, succession = await _open_handler(config, stack, store_metrics)
        if metrics is not None:
            metrics.quarantine_from(handler.quarantined_nodes)
            metrics.stragglers_from(handler.control.straggler_scores)
            stack.enter_context(serving(metrics_at, metrics.registry))
        agent_run = Agent(
            config.worker, handler, watches=watches, reclaim=reclaim, metrics=metrics, events=events,
            log_layout=layout,
        ).run()
        # the succession never ends by itself: it stands by, serves, names successors
        result = await (agent_run if succession is None else first_of(agent_run, succession.run()))
        # Out of the job first (our lease and keys go, a leader of ours stops): the
        # host waits for the others only, never for itself.
        await handler.aclose()
        server = succession.server if succession is not None else None
        if server is not None:
            keys = Keys(config.rdzv.settings.run_id)
            heir = await _heir(server.engine, keys)
            if heir:
                log.info("handing the store over to %s: it serves the job from now on", heir, extra=HEADLINE)
                await server.stop()
            else:
                await _linger_while_nodes_remain(server.engine, keys)
    return result


def gpu_watches(gpus: Gpus, devices: tuple[int, ...], interval: float) -> list[Watch]:
    """Check this node's GPUs before it joins; watch them while it is in the job.

    A node with a sick GPU does not join at all; one whose GPU fails later leaves the
    job gracefully (the others go on), with the reason in its events and status.
    """
    health = gpus.check(devices)
    if not health.ok:
        raise GpuUnhealthyError(f"this node does not join: {health.reason}")
    log.info("GPUs %s: %s", ",".join(map(str, devices)), health.reason)

    async def watch() -> str:
        problem = await gpus.watch_health(devices, interval)
        return f"GPU problem, leaving the job: {problem.reason}"

    return [watch]


def gpu_reclaim(gpus: Gpus, devices: tuple[int, ...], limit: float) -> Reclaim:
    """Before workers start again.

    Wait (at most `limit` s) until the stopped workers' memory on these GPUs is free;
    past that, the GPU counts as sick and the node leaves."""
    async def reclaim(pids: Set[int]) -> str:
        problem = await gpus.wait_released(devices, pids, limit, lambda line: log.info("%s", line, extra=HEADLINE))
        return "" if problem is None else f"GPU problem, leaving the job: {problem.reason}"

    return reclaim


async def health_check_watches(check: HealthCheck, interval: float, metrics: AgentMetrics | None) -> list[Watch]:
    """Run the operator's check before this node joins; again every `interval` while it is in the job.

    A node whose check fails does not join at all; one whose check fails later leaves
    the job gracefully, asking to be kept out (the others go on), with the check's last
    line as the reason in its log, events and status, and in the job's quarantine.
    """
    def seen(result: CheckResult) -> None:
        if metrics is not None:
            metrics.health_checked(result)

    result = await check.run()
    seen(result)
    if not result.ok:
        raise HealthCheckError(f"this node does not join: {result.reason}")
    log.info("health check passed in %.1fs: %s", result.seconds, result.reason or "no output")

    async def watch() -> str:
        return (await check.watch(interval, seen)).reason

    return [watch]


async def _open_handler(
    config: LaunchConfig, stack: contextlib.AsyncExitStack, store_metrics: StoreMetrics | None = None
) -> tuple[RendezvousHandler, Succession | None]:
    """The rendezvous handler for the configured backend, and (built-in store) who serves it."""
    rdzv = config.rdzv
    if rdzv.backend == "static":
        return (
            StaticRendezvous(
                rdzv.settings.run_id,
                node_rank=rdzv.node_rank,
                nnodes=rdzv.settings.max_nodes,
                nproc_per_node=config.worker.nproc_per_node,
                master_addr=rdzv.master_addr,
                master_port=rdzv.master_port,
            ),
            None,
        )
    store, server = await _open_store(rdzv, stack, store_metrics)
    me = NodeInfo(
        node_id=config.worker.node_id,
        host=socket.gethostname(),
        addr=rdzv.local_addr,
        nproc=config.worker.nproc_per_node,
        pid=os.getpid(),
        started_at=time.time(),
        gpus=config.gpu_names,
    )
    settings = rdzv.settings
    if rdzv.backend == "standalone":
        settings = replace(settings, last_call=0.0)
    handler = ElasticRendezvous(
        store, settings, me, spec=config.job_spec, launch_flags=config.agent.carried_flags,
        hosting=rdzv.endpoint if server is not None else "",
    )
    stack.push_async_callback(handler.aclose)
    succession = None
    if rdzv.store is not None and rdzv.store.backend == "c10d":
        succession = Succession(
            rdzv.store, handler, store, node_id=me.node_id, addr=me.addr, server=server, metrics=store_metrics,
        )
        stack.push_async_callback(succession.stop)
    return handler, succession


async def _open_store(
    rdzv: RendezvousConfig, stack: contextlib.AsyncExitStack, metrics: StoreMetrics | None = None
) -> tuple[Store, StoreServer | None]:
    """Connect to the store the backend names (c10d: host it when the endpoint is ours)."""
    if rdzv.store is None:  # standalone: the job lives in this process
        store: Store = MemoryStore()
        stack.push_async_callback(store.close)
        return store, None
    probe = Keys(rdzv.settings.run_id).prefix
    with settings_from_flags():
        server = await serve_here(rdzv.store, probe, metrics)
    if server is not None:
        # Said at once, where it is run: the README's main set-up puts the store on a
        # node like any other, which a preemptible pool may take away.
        if rdzv.settings.max_nodes < MIN_NODES_TO_FAIL_OVER:
            log.info(
                "hosting the rendezvous store on %s: a job of at most %d node(s) cannot fail over (without this "
                "node no majority is left): gone, every other node exits 200 after store_host_grace=%gs unless a new "
                "store answers there. On preemptible machines run the store on a stable host (elasticrun store serve) "
                "or use etcd (--rdzv-backend=etcd)",
                server.endpoint, rdzv.settings.max_nodes, rdzv.settings.store_host_grace, extra=HEADLINE,
            )
        else:
            log.info(
                "hosting the rendezvous store on %s; once a round of %d or more nodes runs, its first members "
                "are this store's successors and take it over if this node goes",
                server.endpoint, MIN_NODES_TO_FAIL_OVER, extra=HEADLINE,
            )
        warning = exposure_warning(
            server.endpoint, rdzv.store.token, rdzv_flag("token_file"), client_ca=rdzv.store.client_ca,
            tls=rdzv.store.server_tls is not None, tls_flags=f"{rdzv_flag('tls_cert')} and {rdzv_flag('tls_key')}",
        )
        if warning is not None:
            log.warning("%s", warning)
        stack.push_async_callback(server.stop)  # stopped whatever happens next (again: a no-op)
        return server.engine, server
    store = open_client(rdzv.store)
    stack.push_async_callback(store.close)
    # As long as ever for an answer (the store may be starting), but never in silence.
    await first_contact(
        store, rdzv.store.endpoints, rdzv.store.timeout, probe, patient=True,
        say=lambda line: log.info("%s", line, extra=HEADLINE),  # a wait the user should see
    )
    if rdzv.settings.run_id == DEFAULT_RUN_ID:
        log.warning(
            "the job id is '%s', the default: every job on this store without --rdzv-id shares it, and an "
            "ended job keeps it for closed_ttl=%gs; give each job its own --rdzv-id",
            DEFAULT_RUN_ID, rdzv.settings.closed_ttl,
        )
    return store, None


async def _heir(store: Store, keys: Keys) -> str:
    """The successor that takes the store over from this agent as it leaves a running job ("": none)."""
    head, successors = await store.get(keys.round), await read_successors(store, keys)
    if head is None or decode(RoundHead, head.value).closed or successors is None:
        return ""
    return successors.nodes[0].node_id


async def _linger_while_nodes_remain(store: Store, keys: Keys) -> None:
    """Serve until no node of the job is registered (or _HOST_LINGER passes)."""
    snapshot = await store.get_prefix(keys.nodes)
    remaining = {kv.key for kv in snapshot.kvs}
    if not remaining:
        return
    log.info("keeping the store up until %d other node(s) have left", len(remaining), extra=HEADLINE)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(_HOST_LINGER):
            async for event in store.watch(keys.nodes, start_revision=snapshot.revision + 1, prefix=True):
                if event.type is EventType.DELETE:
                    remaining.discard(event.key)
                else:
                    remaining.add(event.key)
                if not remaining:
                    return
