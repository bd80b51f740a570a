"""The worker environment: torchrun's variables, value by value."""

from __future__ import annotations

from pathlib import Path

from elasticrun.agent.env import worker_env
from elasticrun.rendezvous.handler import Assignment
from tests.support.agent_helpers import make_spec

ASSIGNMENT = Assignment(
    round=4,
    node_rank=1,
    node_count=3,
    rank_offset=2,
    world_size=6,
    master_addr="10.0.0.1",
    master_port=29501,
    restart_count=2,
)
ERROR_FILE = Path("/logs/attempt_3/1/error.json")

#: what torchrun 2.13 sets for every worker (measured with a probe script under
#: `python -m torch.distributed.run --standalone`)
TORCHRUN_VARIABLES = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS",
}


def test_values_match_torchrun_for_the_second_worker_of_the_second_node() -> None:
    spec = make_spec(Path("train.py"), run_id="job42", nproc_per_node=2, max_restarts=3)
    env = worker_env(spec, ASSIGNMENT, 1, {}, ERROR_FILE)
    assert TORCHRUN_VARIABLES <= env.keys()
    assert {k: env[k] for k in TORCHRUN_VARIABLES} == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "6",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "3",
        "ROLE_RANK": "3",
        "ROLE_WORLD_SIZE": "6",
        "ROLE_NAME": "default",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29501",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_RUN_ID": "job42",
        "TORCHELASTIC_ERROR_FILE": str(ERROR_FILE),
        # Workers create their own store in each round: no shared agent store.
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        # torchrun's workers inherit its --signals-to-handle (its default here)
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMP_NUM_THREADS": "1",
    }
    assert env["ELASTICRUN_NODE_ID"] == "node0"
    assert env["ELASTICRUN_ROUND"] == "4"


def test_omp_threads_default_only_for_several_workers_and_never_overrides() -> None:
    one = make_spec(Path("train.py"), nproc_per_node=1)
    two = make_spec(Path("train.py"), nproc_per_node=2)
    assert "OMP_NUM_THREADS" not in worker_env(one, ASSIGNMENT, 0, {}, ERROR_FILE)
    assert worker_env(two, ASSIGNMENT, 0, {"OMP_NUM_THREADS": "4"}, ERROR_FILE)[
        "OMP_NUM_THREADS"
    ] == "4"


def test_base_and_extra_env_pass_through_but_torchrun_variables_win() -> None:
    spec = make_spec(
        Path("train.py"), extra_env={"CUDA_VISIBLE_DEVICES": "3", "RANK": "99"}
    )
    base = {"PATH": "/bin", "RANK": "7", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    env = worker_env(spec, ASSIGNMENT, 0, base, ERROR_FILE)
    assert env["PATH"] == "/bin"
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    assert env["RANK"] == "2"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert base["RANK"] == "7"  # the agent's own environment is left alone


def test_the_agents_secrets_are_withheld_and_the_token_comes_as_a_file() -> None:
    spec = make_spec(Path("train.py"), withheld_env=frozenset({"ELASTICRUN_STORE_TOKEN", "DB_PASSWORD"}))
    base = {
        "PATH": "/bin",
        "ELASTICRUN_STORE_TOKEN": "t0ken",
        "DB_PASSWORD": "pw",
        "ELASTICRUN_STORE_TOKEN_FILE": "/elsewhere/stale",  # a parent agent's file: not ours
    }
    token_file = Path("/logs/job_node0/store_token")
    env = worker_env(spec, ASSIGNMENT, 0, base, ERROR_FILE, token_file=token_file)
    assert "ELASTICRUN_STORE_TOKEN" not in env and "DB_PASSWORD" not in env
    assert env["ELASTICRUN_STORE_TOKEN_FILE"] == str(token_file)
    assert env["PATH"] == "/bin"
    assert "ELASTICRUN_STORE_TOKEN_FILE" not in worker_env(spec, ASSIGNMENT, 0, base, ERROR_FILE)


def test_isolated_workers_see_local_rank_0_as_under_virtual_local_rank(tmp_path: Path) -> None:
    """--isolate-gpus: one GPU each, as cuda:0, so set_device(LOCAL_RANK) finds it."""
    from elasticrun.agent.spec import WorkerOptions, WorkerSpec

    spec = WorkerSpec(
        run_id="r", entrypoint=("x",), nproc_per_node=3, gpu_devices=(6, 2, 3), options=WorkerOptions(isolate_gpus=True)
    )
    env = worker_env(spec, ASSIGNMENT, 2, {"ELASTICRUN_LOCAL_RANK": "9"}, tmp_path / "e.json")
    assert (env["LOCAL_RANK"], env["CUDA_VISIBLE_DEVICES"], env["ELASTICRUN_LOCAL_RANK"]) == ("0", "3", "2")
    plain = worker_env(WorkerSpec(run_id="r", entrypoint=("x",), nproc_per_node=3), ASSIGNMENT, 2,
                       {"ELASTICRUN_LOCAL_RANK": "9"}, tmp_path / "e.json")
    assert plain["LOCAL_RANK"] == "2" and "ELASTICRUN_LOCAL_RANK" not in plain


def test_a_state_file_is_never_inherited_from_the_agents_environment() -> None:
    """An agent started by a worker (a nested launch) must not hand its workers the outer
    worker's state file: only its own (agent.py adds it)."""
    spec = make_spec(Path("train.py"))
    env = worker_env(spec, ASSIGNMENT, 0, {"ELASTICRUN_STATE_FILE": "/dev/shm/outer"}, ERROR_FILE)
    assert "ELASTICRUN_STATE_FILE" not in env
