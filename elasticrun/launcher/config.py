"""The frozen configuration of one launch: `LaunchConfig`, its `RendezvousConfig` and `AgentOptions`.

It is made in three steps kept apart:

- `parse_launch` (`launcher/parsing.py`) is pure: it checks every flag (and the
  PET_/TORCH_ELASTIC_ variables it is handed) and fails with a `UsageError` naming the
  flag, so nothing later has to second-guess it. It reads nothing else, so it is tested
  and fuzzed without a host.
- `discover` (`launcher/discover.py`) asks this host what only it can answer: whether
  the training script or command exists, its GPUs (through NVML) and CPUs, the address
  on the route to the store, the node id, a fresh id for a `--standalone` job, and the
  store's settings with the files they name (`elasticrun.store.settings`).
- `assemble` (`launcher/assemble.py`) puts a request and its host's facts together,
  purely.

`build_config` (`launcher/assemble.py`) runs the three; the launcher and
`elasticrun join` call it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from elasticrun.agent.spec import WorkerSpec
from elasticrun.launcher.metrics_http import MetricsAddress
from elasticrun.rendezvous.records import JobSpec
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.store.settings import StoreAccess


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


@dataclass(frozen=True)
class AgentOptions:
    """What the agent itself runs beside the workers, as its flags ask for it.

    One object from the checked flags (`LaunchRequest.agent`) to the launch
    (`LaunchConfig.agent`): the host adds nothing to these, so they pass unchanged."""

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
    #: the agent's own services, as the flags ask for them
    agent: AgentOptions = field(default_factory=AgentOptions)
