"""The agent loop on the static rendezvous, with real worker processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from elasticrun.agent.agent import Action, Agent, AgentResult, Outcome, next_action
from elasticrun.agent.spec import Std, WorkerOptions, WorkerSpec, WorkerState
from elasticrun.errors import EXIT_INFRASTRUCTURE, RendezvousClosedError, WorkerStartError
from tests.support.agent_helpers import (
    kill_and_reap,
    make_spec,
    read_lines_until,
    start_agent_process,
    static_for,
    wait_pid_gone,
    write_script,
)
from tests.support.helpers import free_port


@pytest.mark.parametrize(
    ("outcome", "restart_count", "max_restarts", "action"),
    [
        (Outcome.SUCCEEDED, 0, 0, Action.FINISH),
        (Outcome.FAILED, 0, 1, Action.RESTART),
        (Outcome.FAILED, 2, 3, Action.RESTART),
        (Outcome.FAILED, 3, 3, Action.FAIL),
        (Outcome.FAILED, 0, 0, Action.FAIL),
        # A round ended by others never spends the budget, even when it is spent.
        (Outcome.ROUND_ENDED, 3, 3, Action.NEXT_ROUND),
        (Outcome.SIGNALLED, 0, 3, Action.LEAVE),
        (Outcome.WATCH, 0, 3, Action.LEAVE),
    ],
)
def test_policy(
    outcome: Outcome, restart_count: int, max_restarts: int, action: Action
) -> None:
    assert next_action(outcome, restart_count, max_restarts) is action


async def _run(spec: WorkerSpec) -> tuple[Agent, AgentResult]:
    agent = Agent(spec, static_for(spec))
    return agent, await agent.run()


async def test_restarts_increment_the_restart_count_until_success(tmp_path: Path) -> None:
    seen = tmp_path / "seen"
    script = write_script(
        tmp_path,
        "flaky.py",
        f"""
        import os, sys
        count = os.environ["TORCHELASTIC_RESTART_COUNT"]
        with open({str(seen)!r}, "a") as f:
            f.write(count + "\\n")
        sys.exit(0 if count == "2" else 5)
        """,
    )
    spec = make_spec(script, max_restarts=3, log_dir=tmp_path / "logs")
    agent, result = await _run(spec)
    assert result.state is WorkerState.SUCCEEDED
    assert result.exit_code == 0
    assert seen.read_text().split() == ["0", "1", "2"]
    attempts = sorted(p.name for p in agent.run_dir.glob("attempt_*"))
    assert attempts == ["attempt_0", "attempt_1", "attempt_2"]
    events = [json.loads(line) for line in (agent.run_dir / "events.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds.count("healthy") == 3 and kinds[-1] == "succeeded"
    assert sum("restarting (" in e["detail"] for e in events) == 2


async def test_exhausted_budget_exits_1_with_the_root_cause_from_stderr(
    tmp_path: Path,
) -> None:
    script = write_script(
        tmp_path,
        "bad.py",
        """
        import os, time
        if os.environ["LOCAL_RANK"] == "1":
            print("about to fail", flush=True)
            raise ValueError("boom at restart " + os.environ["TORCHELASTIC_RESTART_COUNT"])
        time.sleep(300)
        """,
    )
    spec = make_spec(script, nproc_per_node=2, max_restarts=1, log_dir=tmp_path / "logs")
    _, result = await _run(spec)
    assert result.state is WorkerState.FAILED
    assert result.exit_code == 1
    assert "--max-restarts=1" in result.message
    report = result.report
    assert report is not None
    root = report.root_cause
    assert (root.global_rank, root.local_rank, root.returncode) == (1, 1, 1)
    assert root.traceback_source == "stderr"
    assert root.traceback.startswith("Traceback (most recent call last):")
    assert root.traceback.endswith("ValueError: boom at restart 1")
    assert report.others == ()  # rank 0 was stopped by the agent: not a failure
    assert "rank      : 1 (local rank 1)" in report.text
    assert "exit      : exit code 1" in report.text


async def test_a_worker_killed_by_a_signal_is_named(tmp_path: Path) -> None:
    script = write_script(
        tmp_path, "oom.py", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"
    )
    _, result = await _run(make_spec(script, log_dir=tmp_path / "logs"))
    assert result.exit_code == 1
    assert result.report is not None
    text = result.report.text
    assert "exit      : SIGKILL (-9), often the out-of-memory killer" in text


async def test_traceback_comes_from_the_record_error_file(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "recorded.py",
        """
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def main():
            raise RuntimeError("recorded failure")

        main()
        """,
    )
    agent, result = await _run(make_spec(script, log_dir=tmp_path / "logs"))
    assert result.report is not None
    root = result.report.root_cause
    assert root.traceback_source == str(agent.run_dir / "attempt_0/0/error.json")
    assert 'raise RuntimeError("recorded failure")' in root.traceback
    assert root.traceback.endswith("RuntimeError: recorded failure")


async def test_log_files_per_attempt_prefixes_and_ranks_filter(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # In attempt 0, rank 0 fails only once rank 1 has written (a FIFO handshake), so
    # both ranks have output in both attempts.
    fifo = tmp_path / "rank1-wrote"
    os.mkfifo(fifo)
    script = write_script(
        tmp_path,
        "talk.py",
        f"""
        import os, sys
        n = os.environ["TORCHELASTIC_RESTART_COUNT"]
        rank = os.environ["RANK"]
        print(f"out {{rank}} attempt {{n}}", flush=True)
        print(f"err {{rank}} attempt {{n}}", file=sys.stderr, flush=True)
        if n == "0" and rank == "0":
            open({str(fifo)!r}).read()  # returns once rank 1 has opened and closed it
            sys.exit(3)
        if n == "0":
            open({str(fifo)!r}, "w").close()
        """,
    )
    spec = make_spec(
        script,
        nproc_per_node=2,
        max_restarts=1,
        tee={0: Std.ALL, 1: Std.ALL},
        local_ranks_filter=frozenset({1}),
        log_dir=tmp_path / "logs",
    )
    agent, result = await _run(spec)
    assert result.exit_code == 0
    out, err = capfd.readouterr()
    assert "[1]<stdout>: out 1 attempt 0" in out
    assert "[1]<stdout>: out 1 attempt 1" in out
    assert "[1]<stderr>: err 1 attempt 1" in err
    assert "[0]<" not in out + err  # filtered off the console, but not out of the files
    for attempt in (0, 1):
        for rank in (0, 1):
            folder = agent.run_dir / f"attempt_{attempt}" / str(rank)
            assert (folder / "stdout.log").read_text() == f"out {rank} attempt {attempt}\n"
            assert (folder / "stderr.log").read_text() == f"err {rank} attempt {attempt}\n"


async def test_a_watch_stops_the_workers_and_leaves(tmp_path: Path) -> None:
    script = write_script(tmp_path, "long.py", "import time\ntime.sleep(300)\n")
    spec = make_spec(script, log_dir=tmp_path / "logs")
    handler = static_for(spec)

    async def gpu_watch() -> str:
        return "GPU 0 is unhealthy"

    result = await Agent(spec, handler, watches=[gpu_watch]).run()
    # a sick GPU is the infrastructure's failure, not the training's
    assert (result.state, result.exit_code) == (WorkerState.STOPPED, EXIT_INFRASTRUCTURE)
    assert result.message == "GPU 0 is unhealthy"
    with pytest.raises(RendezvousClosedError, match="stopped"):
        await handler.next_round()


async def test_a_missing_executable_is_a_start_error(tmp_path: Path) -> None:
    spec = WorkerSpec(
        run_id="test",
        node_id="node0",
        entrypoint=(str(tmp_path / "missing"),),
        nproc_per_node=1,
        options=WorkerOptions(log_dir=tmp_path / "logs"),
    )
    with pytest.raises(WorkerStartError, match="missing"):
        await Agent(spec, static_for(spec)).run()


_SAVER = """
import os, signal, sys, time
rank = os.environ["RANK"]
def on_signal(signum, frame):
    with open(os.path.join({folder!r}, "saved-" + rank), "w") as f:
        f.write(signal.Signals(signum).name)
    print("checkpoint saved", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
print(f"ready pid {{os.getpid()}}", flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_to_the_agent_reaches_workers_and_exits_128_plus_n(
    tmp_path: Path, sig: signal.Signals
) -> None:
    script = write_script(tmp_path, "saver.py", _SAVER.format(folder=str(tmp_path)))
    agent = await start_agent_process(script, tmp_path / "logs", nproc=2)
    try:
        assert agent.stdout is not None
        await read_lines_until(agent.stdout, 2, "<stdout>: ready")
        agent.send_signal(sig)
        saved = await read_lines_until(agent.stdout, 2, "checkpoint saved")
        # 128+N, retryable for a scheduler (torchrun exits 1: docs/cli.md#exit-codes)
        assert await asyncio.wait_for(agent.wait(), 60) == 128 + sig
    finally:
        await kill_and_reap(agent)
    assert sorted(saved) == ["[0]<stdout>: checkpoint saved", "[1]<stdout>: checkpoint saved"]
    for rank in (0, 1):
        assert (tmp_path / f"saved-{rank}").read_text() == sig.name


_DEAF = """
import os, signal, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # like a worker blocked in C code
print(f"ready pid {os.getpid()}", flush=True)
time.sleep(600)
"""


async def test_a_second_ctrl_c_kills_the_workers_at_once(tmp_path: Path) -> None:
    """The first says how long the workers have; the second cuts the grace short (it
    was ignored, and Ctrl-C took --shutdown-timeout: here 600 s, past the test's bound)."""
    script = write_script(tmp_path, "deaf.py", _DEAF)
    agent = await start_agent_process(script, tmp_path / "logs", stop_grace=600)
    try:
        assert agent.stdout is not None and agent.stderr is not None
        await read_lines_until(agent.stdout, 1, "<stdout>: ready")
        agent.send_signal(signal.SIGINT)
        await read_lines_until(agent.stderr, 1, "agent received SIGINT: stopping workers (they have 600s to exit")
        agent.send_signal(signal.SIGINT)
        await read_lines_until(agent.stderr, 1, "agent received SIGINT again: killing the workers now")
        assert await asyncio.wait_for(agent.wait(), 60) == 128 + signal.SIGINT
    finally:
        await kill_and_reap(agent)


_COUNTER = """
import os, signal, sys, time
got = []
def on_term(signum, frame):
    got.append(signum)
signal.signal(signal.SIGTERM, on_term)
print(f"ready pid {os.getpid()}", flush=True)
while not got:
    time.sleep(0.01)
time.sleep(0.5)  # a second SIGTERM, had one been sent, has arrived by now
print(f"SIGTERMs received: {len(got)}", flush=True)
"""


async def test_each_worker_gets_the_stop_signal_once(tmp_path: Path) -> None:
    """Its session and its cgroup (where there is one) hold the same processes: a second
    SIGTERM ran a worker's handler again, in the middle of its first run (a checkpoint)."""
    script = write_script(tmp_path, "counter.py", _COUNTER)
    agent = await start_agent_process(script, tmp_path / "logs", nproc=2)
    try:
        assert agent.stdout is not None
        await read_lines_until(agent.stdout, 2, "<stdout>: ready")
        agent.send_signal(signal.SIGTERM)
        said = await read_lines_until(agent.stdout, 2, "SIGTERMs received")
        assert await asyncio.wait_for(agent.wait(), 60) == 128 + signal.SIGTERM
    finally:
        await kill_and_reap(agent)
    assert sorted(line.split(": ", 1)[1] for line in said) == ["SIGTERMs received: 1"] * 2


async def test_workers_die_with_a_sigkilled_agent(tmp_path: Path) -> None:
    script = write_script(tmp_path, "saver.py", _SAVER.format(folder=str(tmp_path)))
    agent = await start_agent_process(script, tmp_path / "logs", nproc=2)
    try:
        assert agent.stdout is not None
        ready = await read_lines_until(agent.stdout, 2, "<stdout>: ready")
        agent.kill()
        assert await asyncio.wait_for(agent.wait(), 60) == -signal.SIGKILL
    finally:
        await kill_and_reap(agent)
    for line in ready:
        await wait_pid_gone(int(line.rsplit(" ", 1)[1]))
    assert not list(tmp_path.glob("saved-*"))  # SIGKILLed by the kernel, not stopped


_ALL_REDUCE = """
import torch
import torch.distributed as dist
assert dist.is_torchelastic_launched()
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1])
dist.all_reduce(t)
print(f"sum {t.item()} of world {dist.get_world_size()}", flush=True)
dist.destroy_process_group()
"""


async def test_two_static_nodes_on_loopback_all_reduce_with_gloo(tmp_path: Path) -> None:
    script = write_script(tmp_path, "allreduce.py", _ALL_REDUCE)
    port = free_port()
    agents = [
        await start_agent_process(
            script, tmp_path / "logs", node_rank=r, nnodes=2, master_port=port
        )
        for r in (0, 1)
    ]
    try:
        outputs = await asyncio.wait_for(
            asyncio.gather(*(a.communicate() for a in agents)), 90
        )
    finally:
        for a in agents:
            await kill_and_reap(a)
    for rank, (agent, (out, err)) in enumerate(zip(agents, outputs, strict=True)):
        assert agent.returncode == 0, err.decode()
        assert f"[{rank}]<stdout>: sum 3 of world 2" in out.decode()
