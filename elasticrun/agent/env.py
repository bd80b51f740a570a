"""The environment of one worker: torchrun's variables, so scripts run unchanged.

Checked against torchrun 2.13 (`python -m torch.distributed.run --standalone`), variable
by variable. One deliberate difference: `TORCHELASTIC_USE_AGENT_STORE` is "False":
torchrun's workers share the agent's long-lived TCPStore, which keeps stale keys from one
round to the next. Ours create a fresh TCPStore at MASTER_ADDR:MASTER_PORT (rank 0 hosts
it) in every round.

`TORCHELASTIC_SIGNALS_TO_HANDLE` is the agent's `--signals-to-handle`, as torchrun's
workers inherit it from their agent (which sets it in its own environment): scripts
and libraries read it to learn which signals the launcher forwards.

And one on purpose beyond torchrun: the agent's secrets (`spec.withheld_env`: the store
token's variable, etcd's password_env) are not inherited. A worker that needs the store
finds its token in the file `ELASTICRUN_STORE_TOKEN_FILE` names.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from elasticrun.agent.boot import boot_env
from elasticrun.agent.gpu import worker_gpu_env
from elasticrun.agent.spec import WorkerSpec
from elasticrun.agent.worker_link import SOCKET_VAR
from elasticrun.errors import UsageError
from elasticrun.rendezvous.handler import Assignment
from elasticrun.state_layout import STATE_FILE_VAR
from elasticrun.store.wire import TOKEN_FILE_ENV


def worker_env(
    spec: WorkerSpec,
    assignment: Assignment | None,
    local_rank: int,
    base_env: Mapping[str, str],
    error_file: Path,
    agent_socket: str | None = None,
    token_file: Path | None = None,
) -> dict[str, str]:
    """The complete environment of local rank `local_rank` in this round.

    `base_env` is the agent's own environment (passed in so this stays pure);
    `spec.extra_env` goes on top of it and the torchrun variables on top of both. In
    in-process mode (`agent_socket` given) the variables that change from round to
    round are left out: the worker gets them over that socket, for each round, so a
    script that does not use `elasticrun.worker.elastic` fails at once instead of
    joining a group that no longer exists. `token_file` is the file that holds the
    store's token for the workers (the token itself stays out, see `spec.withheld_env`).
    """
    env = constant_env(spec, local_rank, base_env, token_file)
    env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    if agent_socket is not None:
        env[SOCKET_VAR] = agent_socket
    elif assignment is not None:
        env.update(round_env(assignment, local_rank))
    else:
        raise ValueError("a worker outside in-process mode needs its round's assignment")
    return env


def constant_env(
    spec: WorkerSpec, local_rank: int, base_env: Mapping[str, str], token_file: Path | None = None
) -> dict[str, str]:
    """What stays the same in every round for local rank `local_rank`.

    A worker's environment less its attempt's part (ROUND_VARIABLES and the attempt's
    files): what a standby (elasticrun.agent.standby) starts with, before it knows its
    round.
    """
    env = {key: value for key, value in base_env.items() if key not in spec.withheld_env}
    env.pop(TOKEN_FILE_ENV, None)  # only this agent's file, never one inherited
    env.pop("ELASTICRUN_LOCAL_RANK", None)  # only set under --isolate-gpus, never inherited
    env.pop(STATE_FILE_VAR, None)  # only this agent's file (agent.py adds it), never one inherited
    if token_file is not None:
        env[TOKEN_FILE_ENV] = str(token_file)
    env.update(spec.extra_env)
    env.update(worker_gpu_env(spec.gpu_devices, local_rank, spec.options.isolate_gpus))
    if "OMP_NUM_THREADS" not in env and spec.nproc_per_node > 1:
        # torchrun's default: N workers each using every core would oversubscribe them.
        env["OMP_NUM_THREADS"] = "1"
    if spec.options.isolate_gpus:
        env.update(_virtual_local_rank_env(spec, local_rank, base_env))
    env.update(boot_env(env))  # the worker boot (elasticrun.agent.boot) runs before the script
    env.update(
        {
            "LOCAL_RANK": "0" if spec.options.isolate_gpus else str(local_rank),
            "LOCAL_WORLD_SIZE": str(spec.nproc_per_node),
            "ROLE_NAME": spec.role,
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": spec.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(sig.name for sig in spec.options.signals_to_handle),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get(
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"
            ),
            "ELASTICRUN_NODE_ID": spec.node_id,
        }
    )
    for key in (*ROUND_VARIABLES, "TORCHELASTIC_ERROR_FILE"):
        env.pop(key, None)  # never a stale value inherited from the agent's environment
    return env


def _virtual_local_rank_env(spec: WorkerSpec, local_rank: int, base_env: Mapping[str, str]) -> dict[str, str]:
    """--isolate-gpus (torchrun's --virtual-local-rank).

    Each worker sees one GPU, as cuda:0, with LOCAL_RANK=0 so that
    `set_device(LOCAL_RANK)` finds it.

    Its real local rank stays in ELASTICRUN_LOCAL_RANK (the in-process link needs it).
    Without GPUs known to NVML, as torchrun: the local rank's entry of the agent's own
    CUDA_VISIBLE_DEVICES, or the local rank itself.
    """
    env = {"ELASTICRUN_LOCAL_RANK": str(local_rank)}
    if spec.gpu_devices:
        return env  # worker_gpu_env has named the worker's own GPU
    inherited = base_env.get("CUDA_VISIBLE_DEVICES")
    if inherited is None:
        return {**env, "CUDA_VISIBLE_DEVICES": str(local_rank)}
    visible = inherited.split(",")
    if local_rank >= len(visible):
        raise UsageError(
            f"--isolate-gpus: worker {local_rank} has no GPU of its own in CUDA_VISIBLE_DEVICES={inherited}"
        )
    return {**env, "CUDA_VISIBLE_DEVICES": visible[local_rank].strip()}


#: the variables whose values change from one round to the next
ROUND_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "ELASTICRUN_ROUND",
)


def round_env(assignment: Assignment, local_rank: int) -> dict[str, str]:
    """The round's variables for local rank `local_rank` (ROUND_VARIABLES, in order)."""
    global_rank = assignment.rank_offset + local_rank
    values = (
        global_rank,
        assignment.world_size,
        assignment.node_rank,
        assignment.node_count,
        # One role per job, so role ranks are the global ranks (as in torchrun).
        global_rank,
        assignment.world_size,
        assignment.master_addr,
        assignment.master_port,
        assignment.restart_count,
        assignment.round,
    )
    return {key: str(value) for key, value in zip(ROUND_VARIABLES, values, strict=True)}
