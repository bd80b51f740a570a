"""Every flag of a launch checked, purely: `parse_launch` -> `LaunchRequest`.

It reads the flags and the environment it is handed, nothing else, so it is tested and
fuzzed without a host; a bad flag is a `UsageError` naming it.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from elasticrun.agent.spec import DEFAULT_STATE_MEMORY, Std, WorkerOptions
from elasticrun.errors import UsageError
from elasticrun.launcher.config import AgentOptions, RendezvousConfig
from elasticrun.launcher.flag_values import (
    byte_size,
    digits_only,
    positive_seconds,
    within_max_seconds,
)
from elasticrun.launcher.metrics_http import metrics_address
from elasticrun.launcher.rdzv_conf import SHARED_RDZV_CONF, parse_rdzv_conf, rendezvous_settings
from elasticrun.rendezvous.records import RUN_PATH_MODULE, JobSpec
from elasticrun.store.wire import DEFAULT_C10D_PORT, DEFAULT_ETCD_PORT

#: the job id without --rdzv-id, torchrun's: every job on a store without one shares it
DEFAULT_RUN_ID = "none"

#: backend names as torchrun spells them -> ours
BACKENDS = {"c10d": "c10d", "etcd": "etcd", "etcd-v2": "etcd", "static": "static"}

#: The most nodes a job may have: every node holds a lease and a few keys in the store,
#: and the built-in store holds at most 100,000 leases; the rendezvous is measured up to
#: 10,000 nodes (BENCHMARKS.md). A larger MAX is a typo, refused before it becomes a
#: lease TTL (max / 400 s) or a shard count.
MAX_NODES = 100_000

#: The most workers one node may run: no host has more than a few hundred CPUs or GPUs,
#: and every worker costs the agent a process, its pipes and a supervising task; a larger
#: number is a typo, refused before the agent spawns without end.
MAX_NPROC_PER_NODE = 1024


def parse_nnodes(value: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` -> (min, max)."""
    parts = value.split(":")
    if len(parts) not in (1, 2) or not all(digits_only(p) for p in parts):
        raise UsageError(f"--nnodes must be N or MIN:MAX, got {value!r}")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1 or high < low:
        raise UsageError(f"--nnodes needs 1 <= MIN <= MAX, got {value!r}")
    if high > MAX_NODES:
        raise UsageError(f"--nnodes allows at most {MAX_NODES} nodes, got {value!r}")
    return low, high


def parse_std(value: str, flag: str) -> Std | dict[int, Std]:
    """torchrun's `3` (one Std for every local rank) or `0:3,1:0` (rank -> Std)."""
    def std(text: str) -> Std:
        if text.strip() not in ("0", "1", "2", "3"):
            raise UsageError(f"{flag} values are 0..3 (none, out, err, all), got {value!r}")
        return Std(int(text))

    if ":" not in value:
        return std(value)
    result = {}
    for item in value.split(","):
        rank, _, streams = item.partition(":")
        if not digits_only(rank.strip()):
            raise UsageError(f"{flag} must be N or RANK:N,RANK:N..., got {value!r}")
        result[int(rank)] = std(streams)
    return result


def check_run_id(run_id: str) -> str:
    """A job id the store can hold: it is part of every key of the job."""
    if not run_id or "/" in run_id:
        raise UsageError(f"--rdzv-id must be a non-empty name without '/', got {run_id!r}")
    try:
        run_id.encode()
    except UnicodeError:
        raise UsageError(
            f"--rdzv-id must be UTF-8 text, got {run_id!r} (a byte the terminal could not decode)"
        ) from None
    return run_id


def _host_name(host: str) -> bool:
    """Whether `host` is an IPv6 address or a name the resolver can encode (IDNA)."""
    if ":" in host:
        return _is_ipv6(host)
    try:
        host.encode("idna")
    except UnicodeError:  # an empty or over-long label, an undecodable byte
        return False
    return True


def parse_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """`host[:port]` (IPv6 in brackets) -> (host, port)."""
    host, port = endpoint, default_port
    if endpoint.startswith("["):
        host, _, rest = endpoint[1:].partition("]")
        if rest:
            port = _port(rest.removeprefix(":"), endpoint)
    elif endpoint.count(":") == 1:
        host, _, text = endpoint.partition(":")
        port = _port(text, endpoint)
    if not host or any(c in host for c in " /,") or not _host_name(host):
        raise UsageError(f"--rdzv-endpoint must be host:port, got {endpoint!r}")
    return host, port


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def _port(text: str, endpoint: str) -> int:
    if not digits_only(text) or not 0 < int(text) < 65536:
        raise UsageError(f"--rdzv-endpoint has a bad port: {endpoint!r} (1..65535)")
    return int(text)


def worker_argv(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The argv of one worker: an interpreter and `-u` in front, unless --no-python.

    As torchrun: the interpreter is $PYTHON_EXEC when set, else this one; --run-path
    runs the script through `runpy.run_path` in this interpreter and wins over
    --module and --no-python.
    """
    script, rest = args.training_script, list(args.training_script_args)
    if args.run_path:
        return (sys.executable, "-u", "-m", RUN_PATH_MODULE, script, *rest)
    python = environ.get("PYTHON_EXEC") or sys.executable
    if args.module:
        if args.no_python:
            raise UsageError("--module and --no-python cannot be combined")
        return (python, "-u", "-m", script, *rest)
    if args.no_python:
        return (script, *rest)
    return (python, "-u", script, *rest)


def comma_list(value: str) -> tuple[str, ...]:
    """torchrun's comma-separated list: `a,b`, with `,,` for a comma inside an item."""
    return tuple(item.replace("\0", ",") for item in value.replace(",,", "\0").split(","))


def parse_signals(value: str) -> tuple[signal.Signals, ...]:
    names = [n.strip().upper() for n in value.split(",") if n.strip()]
    try:
        signals = tuple(signal.Signals[n if n.startswith("SIG") else "SIG" + n] for n in names)
    except KeyError as e:
        raise UsageError(f"--signals-to-handle: unknown signal {e.args[0]}") from None
    for sig in signals:
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise UsageError(f"--signals-to-handle: {sig.name} cannot be caught; name others, e.g. SIGTERM,SIGUSR1")
    return signals


@dataclass(frozen=True)
class LaunchRequest:
    """A launch as its flags ask for it, every flag checked, before this host is looked at.

    Two answers are the host's to give (see `discover`): under --standalone the run id of
    `rdzv.settings` is empty, and for c10d and etcd without --local-addr so is
    `rdzv.local_addr`.
    """

    rdzv: RendezvousConfig
    job_spec: JobSpec
    #: the argv of one worker (`worker_argv`)
    entrypoint: tuple[str, ...]
    #: --gpus: the GPUs to use, among those visible and healthy (None: all of them)
    gpus: str | None
    #: --redirects and --tee: one Std for every local rank, or one per named rank
    redirects: Std | dict[int, Std]
    tee: Std | dict[int, Std]
    #: how the workers are stopped, logged and shown: into the WorkerSpec unchanged
    worker_options: WorkerOptions
    agent: AgentOptions
    #: --numa-binding's mode (elasticrun.agent.numa), or None
    numa_binding: str | None = None


#: the launcher flags of one node's own that the job's first node stores (JobLaunch.flags)
#: and `elasticrun join` repeats; what every node must share is in the JobSpec instead.
#: Only flags that can neither run code nor name a file on the joining host: whoever can
#: write the store chooses them (so no --log-dir, --event-log-handler, --logs-specs).
CARRIED_FLAGS = (
    "shutdown_timeout", "gpus", "isolate_gpus", "tee", "redirects", "signals_to_handle",
    "local_ranks_filter", "health_interval", "duplicate_stdout_filters", "duplicate_stderr_filters",
    "numa_binding", "state_memory",
)


def carried_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """This node's CARRIED_FLAGS as launcher flags, each one that is set."""
    flags = []
    for dest in CARRIED_FLAGS:
        value = getattr(args, dest)
        if dest == "isolate_gpus":
            value = value or args.virtual_local_rank
        name = "--" + dest.replace("_", "-")
        if value is True:
            flags.append(name)
        elif value not in (None, False, ""):
            flags.append(f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}")
    return tuple(flags)


def forgiveness(value: str) -> tuple[bool, float | None]:
    """--forgive-progress as (forgive on a heartbeat, forgive after this many seconds).

    It is heartbeat, a positive number of seconds, or off ("")."""
    if value in ("", "heartbeat"):
        return value == "heartbeat", None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise UsageError(f"--forgive-progress takes heartbeat or a positive number of seconds, got {value!r}")
    return False, within_max_seconds(seconds, "--forgive-progress", repr(value))


def parse_launch(args: argparse.Namespace, environ: Mapping[str, str]) -> LaunchRequest:
    """Every flag of a launch, checked: the one place flags become typed configuration.

    The checks run in the order of the steps below, so that of two mistakes on one
    command line the same one is always reported.
    """
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    backend = _backend(args, min_nodes, max_nodes)
    _check_job_shape(args, min_nodes, max_nodes)
    rdzv = _rendezvous(args, backend, min_nodes, max_nodes)
    argv = worker_argv(args, environ)
    nproc_request = _nproc_request(str(args.nproc_per_node))
    stop_grace = _stop_grace(args.shutdown_timeout, environ)
    for flag, value in (("--progress-timeout", args.progress_timeout),
                        ("--progress-start-timeout", args.progress_start_timeout)):
        if value is not None:  # its lower bound is the worker spec's
            within_max_seconds(value, flag, f"{value:g}")
    local_ranks = _local_ranks(args.local_ranks_filter)
    job_spec = _job_spec(args, argv, nproc_request, min_nodes, max_nodes, rdzv.conf)
    _check_health_flags(args)
    signals = parse_signals(args.signals_to_handle)
    return LaunchRequest(
        rdzv=rdzv,
        job_spec=job_spec,
        entrypoint=argv,
        gpus=args.gpus,
        redirects=parse_std(args.redirects, "--redirects"),
        tee=parse_std(args.tee, "--tee"),
        worker_options=WorkerOptions(
            stop_grace=stop_grace,
            signals_to_handle=signals,
            log_dir=Path(args.log_dir) if args.log_dir else None,
            local_ranks_filter=local_ranks,
            isolate_gpus=args.isolate_gpus or args.virtual_local_rank,
            log_line_prefix_template=environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
            console_json=args.log_format == "json",
            file_timer=environ.get("TORCHELASTIC_TIMER_FILE", "")
            if environ.get("TORCHELASTIC_ENABLE_FILE_TIMER") == "1"
            else None,
            state_memory=DEFAULT_STATE_MEMORY if args.state_memory is None
            else byte_size(args.state_memory, "--state-memory"),
            warm_imports=_warm_imports(args),
            duplicate_filters={
                stream: comma_list(value)
                for stream, value in (
                    ("stdout", args.duplicate_stdout_filters), ("stderr", args.duplicate_stderr_filters)
                )
                if value
            },
        ),
        agent=AgentOptions(
            health_interval=args.health_interval,
            health_check=args.health_check or None,
            health_check_timeout=args.health_check_timeout,
            carried_flags=carried_flags(args),
            event_log_handler=args.event_log_handler or "null",
            logs_specs=args.logs_specs or None,
            std_flags=(args.redirects, args.tee),
            metrics=metrics_address(args.metrics_port),
        ),
        numa_binding=args.numa_binding,
    )


def _warm_imports(args: argparse.Namespace) -> tuple[str, ...]:
    """--warm-imports as module names; () where workers start cold.

    Off for --no-python (no Python runs the boot) and in-process mode (its workers
    outlive rounds already)."""
    value = args.warm_imports.strip()
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    for name in names:
        if name != "off" and not all(part.isidentifier() for part in name.split(".")):
            raise UsageError(f"--warm-imports: {name!r} is not a module name (give e.g. torch,transformers, or off)")
    if value == "off" or not names:
        return ()
    if "off" in names:
        raise UsageError(f"--warm-imports={value}: off cannot be combined with modules")
    if (args.no_python and not args.run_path) or args.elastic_mode == "in-process":
        return ()
    return names


def _backend(args: argparse.Namespace, min_nodes: int, max_nodes: int) -> str:
    """--rdzv-backend as ours ("standalone" with --standalone), checked against the other flags.

    The flags it needs, or rules out."""
    backend = "standalone" if args.standalone else BACKENDS.get(args.rdzv_backend)
    if backend is None:
        raise UsageError(
            f"unknown --rdzv-backend {args.rdzv_backend!r} (choose c10d, etcd or static)"
        )
    if backend == "standalone" and max_nodes > 1:
        raise UsageError("--standalone runs one node; drop --nnodes or use --rdzv-backend=c10d")
    if backend in ("c10d", "etcd") and not args.rdzv_endpoint:
        raise UsageError(f"--rdzv-backend={backend} needs --rdzv-endpoint=host:port")
    if backend == "static" and min_nodes != max_nodes:
        raise UsageError(
            f"--nnodes={args.nnodes} is elastic, which the static rendezvous (the default --rdzv-backend) cannot "
            "run: give --rdzv-backend=c10d (the built-in store) or etcd, with --rdzv-endpoint=host:port; or "
            "--nnodes=N for a fixed number of nodes"
        )
    if backend == "static" and not 0 <= args.node_rank < max_nodes:
        raise UsageError(f"--node-rank must be within 0..{max_nodes - 1}, got {args.node_rank}")
    return backend


def _check_job_shape(args: argparse.Namespace, min_nodes: int, max_nodes: int) -> None:
    """--max-restarts, --forgive-progress and --node-unit (of which MIN and MAX are multiples)."""
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    forgiveness(args.forgive_progress)
    if args.node_unit < 1:
        raise UsageError(f"--node-unit must be >= 1, got {args.node_unit}")
    if min_nodes % args.node_unit or max_nodes % args.node_unit:
        raise UsageError(
            f"--nnodes={args.nnodes}: MIN and MAX must be multiples of --node-unit={args.node_unit}"
        )


def _rendezvous(args: argparse.Namespace, backend: str, min_nodes: int, max_nodes: int) -> RendezvousConfig:
    """Where and how this node meets the others: the endpoint, the job id, --rdzv-conf."""
    conf = parse_rdzv_conf(args.rdzv_conf, args.rdzv_backend)
    run_id = args.rdzv_id
    endpoint = args.rdzv_endpoint
    master_addr, master_port = args.master_addr, args.master_port
    if backend == "standalone":
        run_id, endpoint = "", "memory"  # a fresh run id is the host's to make up
    elif backend in ("etcd", "c10d"):
        # c10d: the first is where the store is served at the start, the others nodes that
        # may serve it later (docs/concepts.md, "When the store's host goes")
        port = DEFAULT_ETCD_PORT if backend == "etcd" else DEFAULT_C10D_PORT
        for part in endpoint.split(","):
            parse_endpoint(part.strip(), port)
    elif backend == "static" and endpoint:
        # as torchrun: a static --rdzv-endpoint names the master, over --master-addr/port
        master_addr, master_port = parse_endpoint(endpoint, 0)
        if master_port == 0:
            raise UsageError(
                f"--rdzv-backend=static takes --rdzv-endpoint=host:port (the master's), "
                f"got {endpoint!r}"
            )
    if backend != "standalone":
        check_run_id(run_id)
    settings = rendezvous_settings(
        conf, run_id=run_id, min_nodes=min_nodes, max_nodes=max_nodes, node_unit=args.node_unit,
        straggler=args.straggler,
    )
    return RendezvousConfig(
        backend=backend,
        endpoint=endpoint,
        settings=settings,
        conf=conf,
        # c10d and etcd without --local-addr: the address on the route to the store, which
        # `discover` finds (an empty --local-addr, an address of no use, counts as none)
        local_addr=args.local_addr or {"standalone": "localhost", "static": "127.0.0.1"}.get(backend, ""),
        node_rank=args.node_rank,
        master_addr=master_addr,
        master_port=master_port,
    )


def _nproc_request(value: str) -> str:
    """--nproc-per-node as given, checked: a number, cpu, gpu, xpu or auto."""
    if not (digits_only(value) and int(value) > 0) and value not in ("cpu", "gpu", "xpu", "auto"):
        raise UsageError(f"--nproc-per-node must be a positive number, cpu, gpu, xpu or auto; got {value!r}")
    if digits_only(value) and int(value) > MAX_NPROC_PER_NODE:
        raise UsageError(
            f"--nproc-per-node allows at most {MAX_NPROC_PER_NODE} workers per node, got {value!r}"
        )
    return value


def _stop_grace(shutdown: float | None, environ: Mapping[str, str]) -> float:
    """--shutdown-timeout, else $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s (as torchrun)."""
    if shutdown is None:
        shutdown = positive_seconds(
            environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30.0
        )
    elif not (shutdown >= 0 and math.isfinite(shutdown)):
        raise UsageError(f"--shutdown-timeout must be >= 0 seconds, got {shutdown:g}")
    return within_max_seconds(shutdown, "--shutdown-timeout", f"{shutdown:g}")


def _local_ranks(value: str | None) -> frozenset[int] | None:
    """--local-ranks-filter: the local ranks whose output is shown (None: all)."""
    if not value:
        return None
    try:
        ranks = frozenset(int(r) for r in value.split(","))
        if min(ranks) < 0:
            raise ValueError
    except ValueError:
        raise UsageError(f"--local-ranks-filter takes local ranks like 0,1,2; got {value!r}") from None
    return ranks


def _job_spec(
    args: argparse.Namespace, argv: tuple[str, ...], nproc_request: str, min_nodes: int, max_nodes: int,
    conf: Mapping[str, str],
) -> JobSpec:
    """What every node of the job must agree on, as this node's flags say it."""
    no_python = bool(args.no_python and not args.run_path)
    return JobSpec(
        # without --no-python, argv starts with this node's interpreter and -u
        command=argv if no_python else argv[2:],
        no_python=no_python,
        nproc_per_node=nproc_request,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        node_unit=args.node_unit,
        max_restarts=args.max_restarts,
        forgive_progress=args.forgive_progress,
        elastic_mode=args.elastic_mode,
        progress_timeout=args.progress_timeout,
        progress_start_timeout=args.progress_start_timeout,
        role=args.role,
        straggler=args.straggler,
        # rendezvous timings every node must share (secrets and local paths stay out)
        rdzv_conf={k: v for k, v in conf.items() if k in SHARED_RDZV_CONF},
    )


def _check_health_flags(args: argparse.Namespace) -> None:
    """--health-interval and --health-check-timeout: positive numbers of seconds."""
    if not (args.health_interval > 0 and math.isfinite(args.health_interval)):
        raise UsageError(f"--health-interval must be a positive number of seconds, got {args.health_interval}")
    within_max_seconds(args.health_interval, "--health-interval", f"{args.health_interval:g}")
    if not (args.health_check_timeout > 0 and math.isfinite(args.health_check_timeout)):
        raise UsageError(
            f"--health-check-timeout must be a positive number of seconds, got {args.health_check_timeout}"
        )
    within_max_seconds(args.health_check_timeout, "--health-check-timeout", f"{args.health_check_timeout:g}")
