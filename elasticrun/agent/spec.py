"""What one node's agent runs (`WorkerSpec`) and where its worker group stands.

The launcher builds a `WorkerSpec` from the parsed flags (torchrun strings such as
`--redirects 0:3,1:0` are parsed there); everything here is already typed.
"""

from __future__ import annotations

import enum
import os
import signal
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from elasticrun.errors import UsageError


class Std(enum.IntFlag):
    """Which of a worker's streams a setting applies to; the values are torchrun's."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


#: --state-memory's default: 16 GiB per worker, so states up to about 4 GiB (room is
#: made for four copies: elasticrun.state_layout); it takes memory only as commits fill it
DEFAULT_STATE_MEMORY = 16 << 30


class WorkerState(enum.Enum):
    """Where this node's worker group stands, as the agent logs and reports it."""

    INIT = "init"  # waiting for a round
    HEALTHY = "healthy"  # workers running
    STOPPED = "stopped"  # workers stopped by the agent (round ended, signal, leave)
    SUCCEEDED = "succeeded"  # every worker exited 0
    FAILED = "failed"  # a worker failed and the restart budget is spent

    def is_terminal(self) -> bool:
        """Whether the agent is done: no round follows this state."""
        return self in (WorkerState.SUCCEEDED, WorkerState.FAILED)


def default_node_id() -> str:
    """A node id unique on this host and across restarts of the agent: host_pid."""
    return f"{socket.gethostname()}_{os.getpid()}"


@dataclass(frozen=True)
class WorkerOptions:
    """How the agent runs and shows its workers, as the launcher's flags ask for it.

    One object from the checked flags (`LaunchRequest.worker_options`) to the worker
    spec (`WorkerSpec.options`): the host adds nothing to these, so they pass unchanged.
    """

    #: seconds between SIGTERM and SIGKILL when stopping workers (torchrun's
    #: --shutdown-timeout, default 30)
    stop_grace: float = 30.0
    #: signals that make the agent stop its workers (forwarding the same signal) and
    #: leave (torchrun's --signals-to-handle)
    signals_to_handle: tuple[signal.Signals, ...] = (
        signal.SIGTERM,
        signal.SIGINT,
        signal.SIGHUP,
        signal.SIGQUIT,
    )
    #: root of the per-attempt log folders; None: a fresh temporary folder
    log_dir: Path | None = None
    #: local ranks whose output reaches the console; None: every rank
    local_ranks_filter: frozenset[int] | None = None
    #: the console lines' prefix, torchrun's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE
    #: (`${rank}`, `${local_rank}`, `${role_name}`); None: `[<rank>]<stdout>: `
    log_line_prefix_template: str | None = None
    #: --log-format=json: the workers' console lines are JSON objects too, so that the
    #: console stays one JSON object a line (elasticrun.agent.output)
    console_json: bool = False
    #: "stdout"/"stderr" -> torchrun's --duplicate-*-filters (elasticrun.agent.output.Duplicates)
    duplicate_filters: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: give each worker only its own GPU (CUDA_VISIBLE_DEVICES per worker) and
    #: LOCAL_RANK=0 (torchrun's --virtual-local-rank)
    isolate_gpus: bool = False
    #: torchrun's file timer (TORCHELASTIC_ENABLE_FILE_TIMER=1): the FIFO's path, or ""
    #: for one in the agent's run folder; None: off (elasticrun.agent.filetimer)
    file_timer: str | None = None
    #: restart mode: the bytes of host memory each worker's committed state may take,
    #: both of its copies (--state-memory; elasticrun.agent.state_files); 0: none kept
    state_memory: int = DEFAULT_STATE_MEMORY
    #: --warm-imports: the modules a standby worker imports ahead of its round, in restart
    #: mode (elasticrun.agent.standby); (): no standbys, every worker starts cold
    warm_imports: tuple[str, ...] = ("torch",)

    def __post_init__(self) -> None:
        if self.stop_grace < 0:
            raise UsageError(f"the stop grace period must be >= 0, got {self.stop_grace}")


@dataclass(frozen=True)
class WorkerSpec:
    """Everything the agent needs to run this node's workers, round after round.

    `entrypoint` is the complete argv of one worker (the launcher puts the interpreter,
    `-u`, and the script or module in front of the user's arguments); every local rank
    runs the same argv and tells itself apart by its environment.
    """

    run_id: str
    entrypoint: tuple[str, ...]
    nproc_per_node: int
    node_id: str = field(default_factory=default_node_id)
    role: str = "default"
    max_restarts: int = 0
    #: how the workers are stopped, logged and shown (the flags' part, unchanged)
    options: WorkerOptions = field(default_factory=WorkerOptions)
    #: local rank -> streams that go to log files only, not to the console
    redirects: Mapping[int, Std] = field(default_factory=dict)
    #: local rank -> streams that go to the console and to log files
    tee: Mapping[int, Std] = field(default_factory=dict)
    #: --numa-binding: local rank -> the CPUs it runs on (elasticrun.agent.numa)
    cpu_affinity: Mapping[int, frozenset[int]] = field(default_factory=dict)
    #: added to every worker's environment (the torchrun variables still win)
    extra_env: Mapping[str, str] = field(default_factory=dict)
    #: what the workers run, as people name it in a failure report ("train:main" for a
    #: function of `elasticrun.launch`); "": the entrypoint's argv
    title: str = ""
    #: variables of the agent's environment that hold secrets (the store's token, etcd's
    #: password): left out of the workers', where training code could log or upload them
    withheld_env: frozenset[str] = frozenset()
    #: the built-in store's token, for the workers' store clients: the agent hands it on
    #: in a file only its user can read (`ELASTICRUN_STORE_TOKEN_FILE`), never by value
    store_token: str | None = field(default=None, repr=False)
    #: the workers' GPUs (NVML indices, in local-rank order); () without GPUs
    gpu_devices: tuple[int, ...] = ()
    #: opt-in hang watchdog: a worker that has not called `elasticrun.worker.heartbeat()`
    #: for this many seconds is hung (None: no watchdog)
    progress_timeout: float | None = None
    #: --progress-start-timeout: the same before a worker's first progress (None: as
    #: progress_timeout)
    progress_start_timeout: float | None = None
    #: --forgive-progress heartbeat: a worker failure after every worker called
    #: `heartbeat()` since the previous failure spends no restart
    forgive_heartbeat: bool = False
    #: --forgive-progress SECONDS: a worker failure after this many seconds of running
    #: since the previous failure spends no restart (None: off)
    forgive_after: float | None = None
    #: keep surviving workers running across rounds (--elastic-mode=in-process)
    in_process: bool = False
    #: give each worker a step timing file (elasticrun.agent.step_reports) and report the
    #: node's step compute time for the straggler check (--straggler other than off)
    step_timing: bool = False

    def __post_init__(self) -> None:
        if not self.entrypoint:
            raise UsageError("no worker command: give a training script or --module")
        if self.nproc_per_node < 1:
            raise UsageError(
                f"--nproc-per-node must be at least 1, got {self.nproc_per_node}"
            )
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.progress_timeout is not None and not 0 < self.progress_timeout < float("inf"):
            raise UsageError(f"--progress-timeout must be a positive number of seconds, got {self.progress_timeout:g}")
        start = self.progress_start_timeout
        if start is not None and not (0 < start < float("inf") and self.progress_timeout is not None):
            raise UsageError(
                f"--progress-start-timeout must be a positive number of seconds, with --progress-timeout; got {start:g}"
            )
        if self.forgive_after is not None and not 0 < self.forgive_after < float("inf"):
            raise UsageError(f"--forgive-progress must be a positive number of seconds, got {self.forgive_after:g}")
