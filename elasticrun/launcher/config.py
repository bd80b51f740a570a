"""From parsed flags to one frozen `LaunchConfig`, in three steps kept apart.

- `parse_launch` is pure: it checks every flag (and the PET_/TORCH_ELASTIC_ variables it
  is handed) and fails with a `UsageError` naming the flag, so nothing later has to
  second-guess it. It reads nothing else, so it is tested and fuzzed without a host.
- `discover` asks this host what only it can answer: whether the training script or
  command exists, its GPUs (through NVML) and CPUs, the address on the route to the
  store, the node id, a fresh id for a `--standalone` job, and the store's settings with
  the files they name (`elasticrun.store.access`).
- `assemble` puts a request and its host's facts together, purely.

`build_config` runs the three; the launcher and `elasticrun join` call it.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import math
import os
import shutil
import signal
import socket
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from elasticrun.agent.spec import Std, WorkerSpec, default_node_id
from elasticrun.errors import StoreSettingError, UsageError
from elasticrun.launcher.metrics_http import MetricsAddress, metrics_address
from elasticrun.launcher.spelling import closest
from elasticrun.rendezvous.decide import RendezvousSettings
from elasticrun.rendezvous.state import JobSpec
from elasticrun.store.access import SECRET_ENV, StoreAccess, parse_access
from elasticrun.store.api import MAX_LEASE_TTL
from elasticrun.store.wire import DEFAULT_C10D_PORT, DEFAULT_ETCD_PORT, DEFAULT_TIMEOUT, TOKEN_ENV

#: the job id without --rdzv-id, torchrun's: every job on a store without one shares it
DEFAULT_RUN_ID = "none"

#: backend names as torchrun spells them -> ours
BACKENDS = {"c10d": "c10d", "etcd": "etcd", "etcd-v2": "etcd", "static": "static"}

#: The longest a timing may be, in seconds: etcd's longest lease (`MaxLeaseTTL`, about
#: 285 years), for every timing alike. Two of them become leases (heartbeat_timeout,
#: closed_ttl), where no store takes longer; the others become deadlines, which a
#: number past this no longer is (1e300 s from now is no time at all in floating point).
MAX_SECONDS = MAX_LEASE_TTL

#: The most nodes a job may have: every node holds a lease and a few keys in the store,
#: and the built-in store holds at most 100,000 leases; the rendezvous is measured up to
#: 10,000 nodes (BENCHMARKS.md). A larger MAX is a typo, refused before it becomes a
#: lease TTL (max / 400 s) or a shard count.
MAX_NODES = 100_000

#: The most workers one node may run: no host has more than a few hundred CPUs or GPUs,
#: and every worker costs the agent a process, its pipes and a supervising task; a larger
#: number is a typo, refused before the agent spawns without end.
MAX_NPROC_PER_NODE = 1024

#: --rdzv-conf keys that hold seconds: checked when parsed (job control reads some too)
TIMING_RDZV_CONF = (
    "join_timeout", "last_call_timeout", "heartbeat_timeout", "heartbeat_interval", "closed_ttl", "store_timeout",
    "store_host_grace", "straggler_interval",
)

#: --rdzv-conf keys that are part of the job spec: every node must use the same
SHARED_RDZV_CONF = (
    "last_call_timeout", "heartbeat_timeout", "heartbeat_interval", "closed_ttl",
    "quarantine_after", "quarantine_cooldown", "quarantine_cooldown_max",
    "straggler_relative", "straggler_after", "straggler_interval",
)

#: --rdzv-conf keys, with what they mean (shown in the error for an unknown key)
RDZV_CONF_KEYS = {
    "join_timeout": "seconds a node waits for a round before giving up (default 600)",
    "last_call_timeout": "seconds to wait for more nodes once min are there (default 1)",
    "heartbeat_timeout": "lease TTL: seconds until a silent node is dropped (default 5, or max nodes / 400 if longer)",
    "heartbeat_interval": "seconds between lease renewals (default: a third of heartbeat_timeout)",
    "closed_ttl": "seconds a finished job stays closed to late agents (default 60)",
    "quarantine_after": (
        "failures of one node (worker failures, drops out of a round) before it is kept out for a while "
        "(default 3; 0: never)"
    ),
    "quarantine_cooldown": "seconds of a node's first quarantine; each further one lasts twice as long (default 60)",
    "quarantine_cooldown_max": "the longest quarantine, in seconds; a node quiet this long is forgiven (default 3600)",
    "straggler_relative": (
        "a node is slow when its compute time per step is this many times the other nodes' median (default 1.25)"
    ),
    "straggler_after": "evaluations in a row that find a node slow before it is named a straggler (default 3)",
    "straggler_interval": "seconds between straggler evaluations, and between a node's step reports (default 5)",
    "is_host": "c10d: this agent hosts the store (true/false; default: when the endpoint is local)",
    "token_file": f"c10d: file with the store's token (default: ${TOKEN_ENV})",
    "require_token": "c10d: refuse to run without a store token (true/false; default false)",
    "tls_ca": "c10d: CA certificate (PEM) to reach the store over TLS",
    "tls_cert": "c10d: certificate (PEM) of the store this agent hosts",
    "tls_key": "c10d: private key (PEM) of the store this agent hosts",
    "client_ca": (
        "c10d: CA certificate (PEM) the store this agent hosts requires client certificates to chain to "
        "(mutual TLS; needs tls_cert, tls_key)"
    ),
    "store_timeout": f"seconds a store call may take, retries included (default {DEFAULT_TIMEOUT:g})",
    "store_host_grace": "c10d: seconds to wait for a new store when the agent hosting it is gone (default 30)",
    "ca_cert": "etcd: CA certificate (PEM)",
    "client_cert": "c10d and etcd: this client's certificate (PEM), for a store that requires one",
    "client_key": "c10d and etcd: private key (PEM) of client_cert",
    "user": "etcd: user name",
    "password_file": "etcd: file holding the password",
    "password_env": "etcd: environment variable holding the password",
}

#: torchrun's names for keys of ours: its rendezvous timings and its etcd backends' TLS files
RDZV_CONF_ALIASES = {
    "timeout": "join_timeout",  # torchrun's etcd rendezvous: the whole join
    "read_timeout": "store_timeout",  # torchrun's c10d and etcd backends: one store call
    "keep_alive_interval": "heartbeat_interval",
    "cacert": "ca_cert",
    "cert": "client_cert",
    "key": "client_key",
    "ssl_cert": "client_cert",
    "ssl_cert_key": "client_key",
}
#: Which spelling torchrun itself reads, by --rdzv-backend, where a key of ours has an
#: alias (the others: our own). A command line may give both (PyTorch's own launcher
#: tests write `join_timeout=5,...,timeout=5`): with one value, fine; with two, the one
#: torchrun would use wins, and a warning says so.
_TORCHRUN_READS: dict[str, dict[str, str]] = {
    "join_timeout": {"etcd": "timeout"},  # torchrun's etcd (v1) rendezvous; its dynamic ones read ours
    "store_timeout": {"": "read_timeout"},
    "heartbeat_interval": {"": "keep_alive_interval"},
    "ca_cert": {"etcd": "cacert"},
    "client_cert": {"etcd": "cert", "etcd-v2": "ssl_cert"},
    "client_key": {"etcd": "key", "etcd-v2": "ssl_cert_key"},
}


def torchrun_spelling(key: str, backend: str) -> str:
    """The spelling of our `key` that torchrun reads with --rdzv-backend=`backend`."""
    reads = _TORCHRUN_READS.get(key, {})
    return reads.get(backend, reads.get("", key))


#: torchrun's key for how many missed keep-alives drop a node: with `keep_alive_interval`
#: it makes our `heartbeat_timeout` (interval x attempts, 5 s x 3 by torchrun's defaults)
KEEP_ALIVE_ATTEMPTS = "keep_alive_max_attempt"
#: torchrun's keys with no counterpart here, each for a reason (docs/cli.md says which):
#: they are accepted, so its command lines run unchanged, and warn
RDZV_CONF_TORCHRUN_ONLY = frozenset({
    "close_timeout", "store_type", "use_libuv", "protocol", "etcd_prefix", "rank",
})


@dataclass(frozen=True)
class RendezvousConfig:
    """Where and how this node meets the others."""

    backend: str  # "standalone", "static", "c10d" or "etcd"
    endpoint: str
    settings: RendezvousSettings
    conf: Mapping[str, str] = field(default_factory=dict)
    #: c10d and etcd: the store's settings of `conf`, read (see `discover`)
    store: StoreAccess | None = None
    #: this node's address, as the other nodes' workers reach it
    local_addr: str = "127.0.0.1"
    # static backend only
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    def conf_float(self, key: str, default: float) -> float:
        return _positive(self.conf.get(key), f"--rdzv-conf {key}", default)


@dataclass(frozen=True)
class LaunchConfig:
    """Everything one `elasticrun` launch does."""

    rdzv: RendezvousConfig
    worker: WorkerSpec
    #: what every node of the job must agree on (stored in the job's spec record)
    job_spec: JobSpec
    #: the --nproc-per-node value as given ("gpu", "auto", "cpu" or a number)
    nproc_request: str
    #: names of this node's GPUs, for status
    gpu_names: tuple[str, ...] = ()
    #: seconds between GPU health checks (and --health-check runs) while training
    health_interval: float = 10.0
    #: --health-check: the operator's command, run by /bin/sh -c (None: none)
    health_check: str | None = None
    #: --health-check-timeout: seconds one run may take
    health_check_timeout: float = 30.0
    #: this node's own settings as flags, for `elasticrun join` (`carried_flags`)
    carried_flags: tuple[str, ...] = ()
    #: --event-log-handler: torch's event log handler ("null": none, torch not imported)
    event_log_handler: str = "null"
    #: --logs-specs: the name of a torchrun.logs_specs entry point (None: our own layout)
    logs_specs: str | None = None
    #: --redirects and --tee as given, for a --logs-specs class
    std_flags: tuple[str, str] = ("0", "0")
    #: --metrics-port: where this agent serves its Prometheus metrics (None: off)
    metrics: MetricsAddress | None = None


# --- parsing: pure -------------------------------------------------------------------


def parse_nnodes(value: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` -> (min, max)."""
    parts = value.split(":")
    if len(parts) not in (1, 2) or not all(_digits(p) for p in parts):
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
        if not _digits(rank.strip()):
            raise UsageError(f"{flag} must be N or RANK:N,RANK:N..., got {value!r}")
        result[int(rank)] = std(streams)
    return result


class FromEnvironment(str):
    """A flag's value that came from its PET_<NAME> variable: a default the command
    line may override, where a value given twice on the command line is a mistake."""


def parse_rdzv_conf(values: list[str], backend: str = "c10d") -> dict[str, str]:
    """Repeated `--rdzv-conf k=v,k2=v2` flags, merged (`backend`: --rdzv-backend as given).

    A key may be given once: twice is a usage error (which of two values is meant is
    for the user to say), save that the command line overrides a key of
    $PET_RDZV_CONF (a `FromEnvironment` value), its default. A value wrapped in one pair
    of quotes (`'join_timeout=5'`, as job manifests that pass arguments without a shell
    often write it) is taken without them. torchrun's key names are taken as ours
    (`RDZV_CONF_ALIASES`, `KEEP_ALIVE_ATTEMPTS`), and count as the key they stand for;
    a key given under both its names takes torchrun's choice (`torchrun_spelling`), with
    a warning when the two values differ.
    """
    conf: dict[str, str] = {}
    #: the keys given so far: whether their value came from the environment, and the name it came by
    seen: dict[str, tuple[bool, str]] = {}
    attempts: str | None = None
    keep_alive = False  # torchrun's keep_alive_interval was given
    for value in values:
        from_env = isinstance(value, FromEnvironment)
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        for item in filter(None, (p.strip() for p in value.split(","))):
            key, sep, val = item.partition("=")
            if not sep or not key:
                raise UsageError(f"--rdzv-conf takes key=value pairs, got {item!r}")
            named = RDZV_CONF_ALIASES.get(key, key)
            if named in seen and not (seen[named][0] and not from_env):
                earlier = seen[named][1]
                if earlier == key or seen[named][0] != from_env:
                    raise UsageError(
                        f"--rdzv-conf names {named} twice (the second time as {item!r}): give each key once"
                    )
                if _alias_again(named, earlier, key, conf.get(named), val, backend):
                    continue  # the first spelling is the one torchrun reads: it stays
            seen[named] = (from_env, key)
            if key in RDZV_CONF_TORCHRUN_ONLY:
                logging.getLogger("elasticrun").warning(
                    "--rdzv-conf %s is accepted for torchrun compatibility and has no effect here "
                    "(see docs/cli.md)", key
                )
                continue
            if key == KEEP_ALIVE_ATTEMPTS:
                if not (_digits(val) and int(val) > 0):
                    raise UsageError(f"--rdzv-conf {key} must be a whole number >= 1, got {val!r}")
                attempts = val
                continue
            keep_alive = keep_alive or key == "keep_alive_interval"
            key = RDZV_CONF_ALIASES.get(key, key)
            if key not in RDZV_CONF_KEYS:
                meant = closest(key, [*RDZV_CONF_KEYS, *RDZV_CONF_ALIASES])
                if meant is not None:
                    raise UsageError(f"--rdzv-conf: unknown key {key!r}; did you mean {meant}?")
                raise UsageError(f"--rdzv-conf: unknown key {key!r} (known: {', '.join(RDZV_CONF_KEYS)})")
            if key in TIMING_RDZV_CONF:
                _positive(val, f"--rdzv-conf {key}", 0.0)
            conf[key] = val
    if attempts is not None or keep_alive:
        # torchrun's keep-alive: a node is dropped after `attempts` missed intervals
        interval = float(conf.setdefault("heartbeat_interval", "5"))
        conf.setdefault("heartbeat_timeout", f"{interval * int(attempts or 3):g}")
    return conf


def _alias_again(named: str, earlier: str, key: str, had: str | None, val: str, backend: str) -> bool:
    """`named` came as `earlier` (value `had`) and now as its other name `key` (`val`):
    whether the earlier value stays. Equal values are one; of two, torchrun's wins."""
    keeps = torchrun_spelling(named, backend) != key
    if had is not None and had != val:
        chosen, chosen_value = (earlier, had) if keeps else (key, val)
        logging.getLogger("elasticrun").warning(
            "--rdzv-conf gives %s twice, as %s=%s and %s=%s: taking %s=%s, as torchrun would "
            "(--rdzv-backend=%s)", named, earlier, had, key, val, chosen, chosen_value, backend,
        )
    return keeps


def _positive(value: str | None, flag: str, default: float) -> float:
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not (number > 0 and math.isfinite(number)):
        raise UsageError(f"{flag} must be a positive number of seconds, got {value!r}")
    return within_max_seconds(number, flag, repr(value))


def within_max_seconds(seconds: float, flag: str, shown: str) -> float:
    """A timing already known to be a finite number, refused past MAX_SECONDS."""
    if seconds > MAX_SECONDS:
        raise UsageError(
            f"{flag} must be at most {MAX_SECONDS:.0f} seconds (etcd's longest lease, about 285 years), got {shown}"
        )
    return seconds


def _digits(text: str) -> bool:
    """Whether int() reads `text` as a plain decimal: ASCII digits only (str.isdigit()
    also takes '²', which int() refuses)."""
    return text.isascii() and text.isdigit()


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


def _ratio(value: str | None, flag: str, default: float) -> float:
    """A factor above 1 (how many times slower)."""
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not (number > 1 and math.isfinite(number)):
        raise UsageError(f"{flag} must be a number above 1 (how many times slower), got {value!r}")
    return number


def _count(value: str | None, flag: str, default: int) -> int:
    """A whole number >= 1."""
    if value is None:
        return default
    if not (value.strip().isascii() and value.strip().isdigit() and int(value) >= 1):
        raise UsageError(f"{flag} must be a whole number >= 1, got {value!r}")
    return int(value)


def _whole(value: str | None, flag: str, default: int) -> int:
    if value is None:
        return default
    if not (value.strip().isascii() and value.strip().isdigit()):
        raise UsageError(f"{flag} must be a whole number >= 0 (0 turns it off), got {value!r}")
    return int(value)


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


def rdzv_flag(setting: str) -> str:
    """The launcher flag a store setting comes from (a variable is named as it is)."""
    if setting == "endpoint":
        return "--rdzv-endpoint"
    return setting if setting.startswith("$") else f"--rdzv-conf {setting}"


@contextlib.contextmanager
def settings_from_flags(flag_of: Callable[[str], str] = rdzv_flag) -> Iterator[None]:
    """A store setting that cannot work, as the usage error that names its flag."""
    try:
        yield
    except StoreSettingError as e:
        raise UsageError(f"{', '.join(map(flag_of, e.settings))}: {e.problem}") from None


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def _port(text: str, endpoint: str) -> int:
    if not _digits(text) or not 0 < int(text) < 65536:
        raise UsageError(f"--rdzv-endpoint has a bad port: {endpoint!r} (1..65535)")
    return int(text)


#: the module a `--run-path` worker runs (elasticrun/worker/run_path.py)
RUN_PATH_MODULE = "elasticrun.worker.run_path"


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
    stop_grace: float
    signals_to_handle: tuple[signal.Signals, ...]
    #: --redirects and --tee: one Std for every local rank, or one per named rank
    redirects: Std | dict[int, Std]
    tee: Std | dict[int, Std]
    log_dir: Path | None
    local_ranks_filter: frozenset[int] | None
    isolate_gpus: bool
    health_interval: float
    health_check: str | None = None
    health_check_timeout: float = 30.0
    carried_flags: tuple[str, ...] = ()
    event_log_handler: str = "null"
    logs_specs: str | None = None
    std_flags: tuple[str, str] = ("0", "0")
    #: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, as torchrun reads it
    log_line_prefix_template: str | None = None
    metrics: MetricsAddress | None = None
    #: TORCHELASTIC_ENABLE_FILE_TIMER=1: TORCHELASTIC_TIMER_FILE or "" (WorkerSpec.file_timer)
    file_timer: str | None = None
    #: --duplicate-stdout-filters and --duplicate-stderr-filters, by stream
    duplicate_filters: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: --numa-binding's mode (elasticrun.agent.numa), or None
    numa_binding: str | None = None


#: the launcher flags of one node's own that the job's first node stores (JobLaunch.flags)
#: and `elasticrun join` repeats; what every node must share is in the JobSpec instead.
#: Only flags that can neither run code nor name a file on the joining host: whoever can
#: write the store chooses them (so no --log-dir, --event-log-handler, --logs-specs).
CARRIED_FLAGS = (
    "shutdown_timeout", "gpus", "isolate_gpus", "tee", "redirects", "signals_to_handle",
    "local_ranks_filter", "health_interval", "duplicate_stdout_filters", "duplicate_stderr_filters",
    "numa_binding",
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


def _forgiveness(value: str) -> tuple[bool, float | None]:
    """--forgive-progress: heartbeat, a positive number of seconds, or off ("")."""
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
    """Every flag of a launch, checked: the one place flags become typed configuration."""
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
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
        raise UsageError("--rdzv-backend=static runs a fixed number of nodes: give --nnodes=N")
    if backend == "static" and not 0 <= args.node_rank < max_nodes:
        raise UsageError(f"--node-rank must be within 0..{max_nodes - 1}, got {args.node_rank}")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    forgive_heartbeat, forgive_after = _forgiveness(args.forgive_progress)
    if args.node_unit < 1:
        raise UsageError(f"--node-unit must be >= 1, got {args.node_unit}")
    if min_nodes % args.node_unit or max_nodes % args.node_unit:
        raise UsageError(
            f"--nnodes={args.nnodes}: MIN and MAX must be multiples of --node-unit={args.node_unit}"
        )
    conf = parse_rdzv_conf(args.rdzv_conf, args.rdzv_backend)
    run_id = args.rdzv_id
    endpoint = args.rdzv_endpoint
    master_addr, master_port = args.master_addr, args.master_port
    if backend == "standalone":
        run_id, endpoint = "", "memory"  # a fresh run id is the host's to make up
    elif backend == "etcd":
        for part in endpoint.split(","):
            parse_endpoint(part.strip(), DEFAULT_ETCD_PORT)
    elif backend == "static" and endpoint:
        # as torchrun: a static --rdzv-endpoint names the master, over --master-addr/port
        master_addr, master_port = parse_endpoint(endpoint, 0)
        if master_port == 0:
            raise UsageError(
                f"--rdzv-backend=static takes --rdzv-endpoint=host:port (the master's), "
                f"got {endpoint!r}"
            )
    elif backend == "c10d":
        if "," in endpoint:
            raise UsageError(
                f"--rdzv-backend=c10d takes one --rdzv-endpoint=host:port, got {endpoint!r} "
                "(a list of endpoints is for etcd)"
            )
        parse_endpoint(endpoint, DEFAULT_C10D_PORT)
    if backend != "standalone":
        check_run_id(run_id)

    # c10d and etcd without --local-addr: the address on the route to the store, which
    # `discover` finds (an empty --local-addr, an address of no use, counts as none)
    local_addr = args.local_addr or {"standalone": "localhost", "static": "127.0.0.1"}.get(backend, "")
    probe = RendezvousConfig(backend, endpoint, RendezvousSettings(run_id, 1, 1), conf)
    settings = RendezvousSettings(
        run_id=run_id,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        last_call=probe.conf_float("last_call_timeout", 1.0),
        join_timeout=probe.conf_float("join_timeout", 600.0),
        store_host_grace=probe.conf_float("store_host_grace", 30.0),
        heartbeat_ttl=probe.conf_float("heartbeat_timeout", RendezvousSettings.default_heartbeat_ttl(max_nodes)),
        closed_ttl=probe.conf_float("closed_ttl", 60.0),
        heartbeat_interval=probe.conf_float("heartbeat_interval", 0.0),
        quarantine_after=_whole(conf.get("quarantine_after"), "--rdzv-conf quarantine_after", 3),
        quarantine_cooldown=probe.conf_float("quarantine_cooldown", 60.0),
        quarantine_cooldown_max=probe.conf_float("quarantine_cooldown_max", 3600.0),
        node_unit=args.node_unit,
        straggler=args.straggler,
        straggler_relative=_ratio(conf.get("straggler_relative"), "--rdzv-conf straggler_relative", 1.25),
        straggler_after=_count(conf.get("straggler_after"), "--rdzv-conf straggler_after", 3),
        straggler_interval=probe.conf_float("straggler_interval", 5.0),
    )
    if settings.keep_alive_interval >= settings.heartbeat_ttl:
        raise UsageError(
            f"--rdzv-conf heartbeat_interval ({settings.keep_alive_interval:g}s) must be shorter than "
            f"heartbeat_timeout ({settings.heartbeat_ttl:g}s)"
        )
    rdzv = RendezvousConfig(
        backend=backend,
        endpoint=endpoint,
        settings=settings,
        conf=conf,
        local_addr=local_addr,
        node_rank=args.node_rank,
        master_addr=master_addr,
        master_port=master_port,
    )

    argv = worker_argv(args, environ)
    nproc_request = str(args.nproc_per_node)
    if not (_digits(nproc_request) and int(nproc_request) > 0) and nproc_request not in ("cpu", "gpu", "xpu", "auto"):
        raise UsageError(f"--nproc-per-node must be a positive number, cpu, gpu, xpu or auto; got {nproc_request!r}")
    if _digits(nproc_request) and int(nproc_request) > MAX_NPROC_PER_NODE:
        raise UsageError(
            f"--nproc-per-node allows at most {MAX_NPROC_PER_NODE} workers per node, got {nproc_request!r}"
        )
    shutdown = args.shutdown_timeout
    if shutdown is None:
        shutdown = _positive(environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30.0)
    elif not (shutdown >= 0 and math.isfinite(shutdown)):
        raise UsageError(f"--shutdown-timeout must be >= 0 seconds, got {shutdown:g}")
    within_max_seconds(shutdown, "--shutdown-timeout", f"{shutdown:g}")
    for flag, value in (("--progress-timeout", args.progress_timeout),
                        ("--progress-start-timeout", args.progress_start_timeout)):
        if value is not None:  # its lower bound is the worker spec's
            within_max_seconds(value, flag, f"{value:g}")
    filter_ranks = None
    if args.local_ranks_filter:
        try:
            filter_ranks = frozenset(int(r) for r in args.local_ranks_filter.split(","))
            if min(filter_ranks) < 0:
                raise ValueError
        except ValueError:
            raise UsageError(
                f"--local-ranks-filter takes local ranks like 0,1,2; got {args.local_ranks_filter!r}"
            ) from None
    no_python = bool(args.no_python and not args.run_path)
    job_spec = JobSpec(
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
    if not (args.health_interval > 0 and math.isfinite(args.health_interval)):
        raise UsageError(f"--health-interval must be a positive number of seconds, got {args.health_interval}")
    within_max_seconds(args.health_interval, "--health-interval", f"{args.health_interval:g}")
    if not (args.health_check_timeout > 0 and math.isfinite(args.health_check_timeout)):
        raise UsageError(
            f"--health-check-timeout must be a positive number of seconds, got {args.health_check_timeout}"
        )
    within_max_seconds(args.health_check_timeout, "--health-check-timeout", f"{args.health_check_timeout:g}")
    return LaunchRequest(
        rdzv=rdzv,
        job_spec=job_spec,
        entrypoint=argv,
        gpus=args.gpus,
        stop_grace=shutdown,
        signals_to_handle=parse_signals(args.signals_to_handle),
        redirects=parse_std(args.redirects, "--redirects"),
        tee=parse_std(args.tee, "--tee"),
        log_dir=Path(args.log_dir) if args.log_dir else None,
        local_ranks_filter=filter_ranks,
        isolate_gpus=args.isolate_gpus or args.virtual_local_rank,
        health_interval=args.health_interval,
        health_check=args.health_check or None,
        health_check_timeout=args.health_check_timeout,
        carried_flags=carried_flags(args),
        event_log_handler=args.event_log_handler or "null",
        logs_specs=args.logs_specs or None,
        std_flags=(args.redirects, args.tee),
        metrics=metrics_address(args.metrics_port),
        log_line_prefix_template=environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        file_timer=environ.get("TORCHELASTIC_TIMER_FILE", "") if environ.get("TORCHELASTIC_ENABLE_FILE_TIMER") == "1"
        else None,
        numa_binding=args.numa_binding,
        duplicate_filters={
            stream: comma_list(value)
            for stream, value in (("stdout", args.duplicate_stdout_filters), ("stderr", args.duplicate_stderr_filters))
            if value
        },
    )


# --- discovery: this host ------------------------------------------------------------


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
    )


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
    """--nproc-per-node (N, `cpu`, `gpu`: every usable GPU, `xpu`: every Intel GPU,
    `auto`: GPUs, else XPUs, else CPUs, as torchrun) and --gpus -> (workers, their GPUs
    in local-rank order, the GPUs' names)."""
    from elasticrun.agent.gpu import open_gpus
    from elasticrun.agent.xpu import intel_xpus

    gpus = open_gpus()
    try:
        selection = gpus.select(environ, gpus_flag)
        if _digits(value):
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


# --- assembly: pure ------------------------------------------------------------------


def assemble(request: LaunchRequest, host: HostFacts) -> LaunchConfig:
    """The launch configuration: a checked request completed with its host's facts."""
    rdzv = request.rdzv
    rdzv = replace(
        rdzv, local_addr=host.local_addr, store=host.store, settings=replace(rdzv.settings, run_id=host.run_id)
    )
    spec = request.job_spec
    store = host.store
    worker = WorkerSpec(
        run_id=host.run_id,
        entrypoint=request.entrypoint,
        nproc_per_node=host.nproc,
        node_id=host.node_id,
        role=spec.role,
        max_restarts=spec.max_restarts,
        stop_grace=request.stop_grace,
        signals_to_handle=request.signals_to_handle,
        redirects=_per_rank(request.redirects, host.nproc),
        tee=_per_rank(request.tee, host.nproc),
        log_dir=request.log_dir,
        local_ranks_filter=request.local_ranks_filter,
        log_line_prefix_template=request.log_line_prefix_template,
        file_timer=request.file_timer,
        duplicate_filters=request.duplicate_filters,
        cpu_affinity=host.cpu_affinity,
        gpu_devices=host.gpu_devices,
        isolate_gpus=request.isolate_gpus,
        progress_timeout=spec.progress_timeout,
        progress_start_timeout=spec.progress_start_timeout,
        forgive_heartbeat=spec.forgive_progress == "heartbeat",
        forgive_after=None if spec.forgive_progress in ("", "heartbeat") else float(spec.forgive_progress),
        in_process=spec.elastic_mode == "in-process",
        step_timing=spec.straggler != "off",
        # the store's secrets stay in the agent; its workers get the token in a file
        withheld_env=store.secret_env if store is not None else SECRET_ENV,
        store_token=store.token if store is not None else None,
    )
    return LaunchConfig(
        rdzv=rdzv,
        worker=worker,
        job_spec=spec,
        nproc_request=spec.nproc_per_node,
        gpu_names=host.gpu_names,
        health_interval=request.health_interval,
        health_check=request.health_check,
        health_check_timeout=request.health_check_timeout,
        carried_flags=request.carried_flags,
        event_log_handler=request.event_log_handler,
        logs_specs=request.logs_specs,
        std_flags=request.std_flags,
        metrics=request.metrics,
    )


def _per_rank(std: Std | dict[int, Std], nproc: int) -> dict[int, Std]:
    return {rank: std for rank in range(nproc)} if isinstance(std, Std) else std


def build_config(args: argparse.Namespace, environ: Mapping[str, str]) -> LaunchConfig:
    """The whole launch: its flags checked, then this host asked, then the two put together."""
    request = parse_launch(args, environ)
    return assemble(request, discover(request, environ))
