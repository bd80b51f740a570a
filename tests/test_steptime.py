"""Step timing: the workers' recorder (elasticrun.worker.steptime) and the agent's reading
of its files (elasticrun.agent.step_reports).

The recorder's arithmetic runs on a clock the test turns; the boot's install runs in
real worker processes (two gloo ranks, one slower), which is what a plain script gets.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from elasticrun.agent.boot import boot_env
from elasticrun.agent.step_reports import STEPS_AFTER_WARMING, STEPS_FILE_ENV, StepTimes
from elasticrun.rendezvous.handler import Assignment
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.worker import steptime
from elasticrun.worker.steptime import Recorder
from tests.support.helpers import free_port

WORKER = Path(__file__).resolve().parent / "workers" / "straggler_worker.py"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_steps_compute_time_is_its_wall_time_less_its_waits() -> None:
    clock = Clock()
    r = Recorder("unused", clock)
    r.mark("optimizer")  # the first mark starts the first step
    for _ in range(3):
        clock.now += 0.2  # computing
        assert r.enter("all_reduce")
        clock.now += 0.5  # waiting for a slower peer
        r.leave()
        r.mark("optimizer")
    summary = r.summary(wall_now=5000.0)
    assert summary["steps"] == 3 and summary["source"] == "optimizer"
    assert summary["compute"] == pytest.approx(0.2) and summary["wall"] == pytest.approx(0.7)
    assert summary["waiting"] == "" and summary["waiting_since"] == 0.0


def test_nested_waits_count_once_and_the_summary_says_where_it_waits_now() -> None:
    clock = Clock()
    r = Recorder("unused", clock)
    r.mark("heartbeat")
    clock.now += 0.1
    r.enter("all_gather_object")
    r.enter("all_gather")  # all_gather_object calls all_gather
    clock.now += 1.0
    r.leave()
    clock.now += 2.0
    assert r.summary(wall_now=5000.0) == {
        "pid": os.getpid(), "source": "heartbeat", "steps": 0, "compute": 0.0, "wall": 0.0,
        "waiting": "all_gather_object", "waiting_since": pytest.approx(4997.0),
    }
    r.leave()
    r.mark("heartbeat")
    assert r.summary(wall_now=5000.0)["compute"] == pytest.approx(0.1)


def test_the_best_source_of_steps_wins() -> None:
    clock = Clock()
    r = Recorder("unused", clock)
    for _ in range(3):
        clock.now += 1.0
        r.mark("optimizer")
    assert (r.steps, r.summary(0.0)["source"]) == (2, "optimizer")
    r.mark("commit")  # the script commits in-process state: its commits are the steps now
    clock.now += 0.5
    r.mark("optimizer")  # ignored from now on
    r.mark("heartbeat")  # ignored too
    clock.now += 0.5
    r.mark("commit")
    assert r.steps == 1 and r.summary(0.0)["source"] == "commit" and list(r.wall) == [pytest.approx(1.0)]


def test_a_new_round_counts_its_steps_afresh_from_the_next_mark() -> None:
    """In-process mode: the join and the state's sync between two rounds are no step."""
    clock = Clock()
    r = Recorder("unused", clock)
    for _ in range(3):
        r.mark("commit")
        clock.now += 1.0
    assert r.steps == 2
    r.restart()
    clock.now += 30.0  # the new group forms, the state is synced
    r.mark("commit")
    clock.now += 0.5
    r.mark("commit")
    assert r.steps == 1 and list(r.wall) == [pytest.approx(0.5)] and r.summary(0.0)["source"] == "commit"


def test_a_wait_on_another_thread_does_not_hold_up_the_step() -> None:
    r = Recorder("unused")
    entered: list[bool] = []
    thread = threading.Thread(target=lambda: entered.append(r.enter("all_reduce")))
    thread.start()
    thread.join()
    assert entered == [False] and r.summary(0.0)["waiting"] == ""


def test_without_an_install_marks_and_waits_do_nothing() -> None:
    assert steptime._recorder is None  # the test process was not started by an agent
    steptime.mark("heartbeat")
    with steptime.waiting("custom"):
        pass


def worker_env(tmp: Path, rank: int, port: int, node: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICRUN_", "PYTHONPATH"))}
    env.update(boot_env(env))
    env.update({
        STEPS_FILE_ENV: str(tmp / f"rank_{rank}.json"), "RANK": str(rank), "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "ELASTICRUN_NODE_ID": node,
        "ELASTICRUN_PROGRESS_FILE": str(tmp / f"progress_{rank}"), "GLOO_SOCKET_IFNAME": "lo",
    })
    return env


def run_two_ranks(tmp: Path, script: Path, *args: str, slow: int = 1) -> StepTimes:
    """Run `script` as ranks 0 and 1 under the boot, rank `slow`'s node marked slow (--slow-dir), to their end."""
    (tmp / "slow").mkdir()
    (tmp / "slow" / f"node-{slow}").touch()
    port = free_port()
    argv = [sys.executable, str(script), *args, "--slow-dir", str(tmp / "slow")]
    procs = [
        subprocess.Popen(argv, env=worker_env(tmp, r, port, f"node-{r}"), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for r in (0, 1)
    ]
    outputs = [p.communicate(timeout=100)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert all("step timing is off" not in out for out in outputs), outputs
    return StepTimes(tmp, (0, 1), keep=True)


@pytest.mark.timeout(120)
def test_a_plain_gloo_script_is_timed_by_the_boot_and_the_slow_rank_stands_out(tmp_path: Path) -> None:
    """No change to the script: the boot wraps all_reduce and hooks optimizer.step().
    Rank 1 computes three times as long; both wait for each other, so their wall steps
    are alike, and only the compute time tells them apart."""
    files = run_two_ranks(tmp_path, WORKER, "--steps", "12", "--step-time", "0.05")
    fast, slow_rank = files.read()[0], files.read()[1]  # written last as each script ended
    assert (fast.source, fast.steps) == ("optimizer", 11)  # 12 optimizer steps: 11 between them
    assert slow_rank.compute > 2 * fast.compute  # 0.15 s against 0.05 s a step, with margin
    assert fast.wall > 2 * fast.compute  # the fast rank spends most of its step waiting
    assert (tmp_path / "progress_0").exists()  # the steps were progress for the hang watchdog
    # what the agent makes of it: the node is as slow as its slowest worker
    report = files.report("n", Assignment(round=3, node_rank=0, node_count=1, rank_offset=8, world_size=10,
                                          master_addr="x", master_port=1, restart_count=0))
    assert report is not None and (report.round, report.rank, report.steps) == (3, 9, 11)
    assert report.compute == slow_rank.compute and report.waiting == ""


def test_a_worker_without_torch_gets_no_torch_and_its_heartbeats_are_its_steps(tmp_path: Path) -> None:
    """...and a child it forks (a data loader's worker) is no worker: it records nothing."""
    script = (
        "import os, sys, time\n"
        "import elasticrun.worker as w\n"
        "for _ in range(4):\n"
        "    time.sleep(0.05)\n"
        "    w.heartbeat()\n"
        "time.sleep(1.0)\n"  # the writer's next look
        "print('torch' in sys.modules, flush=True)\n"
        "if os.fork() == 0:\n"
        "    for _ in range(10):\n"
        "        w.heartbeat()\n"
        "    sys.exit(0)\n"  # its exit would write its count, were it a worker
        "os.wait()\n"
        "os._exit(0)\n"  # the parent writes nothing more
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICRUN_", "PYTHONPATH"))}
    env.update(boot_env(env))
    env[STEPS_FILE_ENV] = str(tmp_path / "rank_0.json")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
    written = json.loads((tmp_path / "rank_0.json").read_text())
    assert (written["source"], written["steps"]) == ("heartbeat", 3)


def test_the_agent_takes_the_slowest_worker_and_reads_nothing_that_is_not_a_summary(tmp_path: Path) -> None:
    def write(rank: int, **fields: object) -> None:
        body = {"pid": 1, "source": "optimizer", "steps": 40, "compute": 0.2, "wall": 0.6, "waiting": "",
                "waiting_since": 0.0, "at": 0.0, **fields}
        (tmp_path / f"rank_{rank}.json").write_text(json.dumps(body))

    (tmp_path / "rank_0.json").write_text("left over from the previous attempt")
    files = StepTimes(tmp_path, range(3))  # an attempt's first look removes what was there
    assert not (tmp_path / "rank_0.json").exists()
    assert files.env(2) == {STEPS_FILE_ENV: str(tmp_path / "rank_2.json")}
    at = Assignment(round=2, node_rank=1, node_count=2, rank_offset=3, world_size=6, master_addr="x",
                    master_port=1, restart_count=0)
    write(0)
    write(1, compute=0.5, steps=38)
    assert files.report("n", at) is None  # rank 2 has no file yet: no report
    (tmp_path / "rank_2.json").write_text('{"pid": "not a number"}')
    assert files.report("n", at) is None
    write(2, compute=0.1)
    report = files.report("n", at)
    assert report is not None
    assert (report.compute, report.wall, report.rank, report.steps) == (0.5, 0.6, 4, 38)
    # a long wait of every worker in one collective is news; a short one, or in different ones, is not
    now = time.time()
    for rank in range(3):
        write(rank, waiting="all_reduce", waiting_since=now - 1.0)
    assert files.report("n", at).waiting == ""  # type: ignore[union-attr] # every worker has a file
    for rank in range(3):
        write(rank, waiting="all_reduce", waiting_since=now - 60.0 - rank)
    late = files.report("n", at)
    assert late is not None and (late.waiting, late.waiting_since) == ("all_reduce", now - 60.0)
    assert files.waiting_in(1, now=now) == "waiting in all_reduce for 61s"
    write(2, waiting="barrier", waiting_since=now - 60.0)
    assert files.report("n", at).waiting == ""  # type: ignore[union-attr] # every worker has a file


def test_a_report_made_while_the_standbys_import_says_warming_until_the_medians_are_the_workers_own(
    tmp_path: Path,
) -> None:
    def write(steps: int) -> None:
        body = {"pid": 1, "source": "optimizer", "steps": steps, "compute": 0.2, "wall": 0.6, "waiting": "",
                "waiting_since": 0.0, "at": 0.0}
        (tmp_path / "rank_0.json").write_text(json.dumps(body))

    files = StepTimes(tmp_path, range(1))
    at = Assignment(round=1, node_rank=0, node_count=1, rank_offset=0, world_size=1, master_addr="x",
                    master_port=1, restart_count=0)
    write(10)
    assert files.report("n", at).warming is False  # type: ignore[union-attr] # the file is there
    write(11)
    assert files.report("n", at, importing=True).warming is True  # type: ignore[union-attr]
    # the worker's medians are over its last steps: more than half must come after the imports
    warm = []
    for steps in range(12, 12 + STEPS_AFTER_WARMING + 1):
        write(steps)
        warm.append(files.report("n", at).warming)  # type: ignore[union-attr]
    assert warm == [True] * (STEPS_AFTER_WARMING - 1) + [False, False]


def test_the_framework_callbacks_are_the_frameworks_own_and_call_heartbeat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning and the Hugging Face Trainer take only callbacks of their own classes."""
    import pytorch_lightning as pl
    import transformers

    from elasticrun.worker import callbacks

    lightning, huggingface = callbacks.lightning(), callbacks.huggingface()
    assert isinstance(lightning, pl.Callback) and isinstance(huggingface, transformers.TrainerCallback)
    for name, call in (("lightning", lambda: lightning.on_train_batch_end(None, None, {}, None, 0)),
                       ("huggingface", lambda: huggingface.on_step_end(None, None, None))):
        progress = tmp_path / f"progress_{name}"
        monkeypatch.setenv("ELASTICRUN_PROGRESS_FILE", str(progress))
        call()
        assert progress.exists(), name  # heartbeat() touched it


def test_the_boot_the_agent_and_the_recorder_name_the_same_variable() -> None:
    """The boot stays standard-library only, so it spells the name itself (read from its
    source: importing it would run it)."""
    boot = Path(steptime.__file__).parent / "boot" / "sitecustomize.py"
    spelled = re.search(r'^STEPS_FILE_ENV = "([^"]+)"$', boot.read_text(), re.M)
    assert spelled is not None and spelled[1] == STEPS_FILE_ENV == steptime.STEPS_FILE_ENV


DDP_WORKER = Path(__file__).parent / "workers" / "ddp_worker.py"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_a_ddp_or_fsdp2_script_waits_where_torch_waits_and_the_slow_rank_stands_out(
    tmp_path: Path, wrapper: str
) -> None:
    """DDP waits for its gradient all-reduce inside backward(), in C++; FSDP2 in its own
    collectives. Rank 1 computes three times as much a step (real compute): rank 0 waits
    for it there, and only the compute time tells them apart."""
    files = run_two_ranks(tmp_path, DDP_WORKER, "--steps", "25", *(["--fsdp"] if wrapper == "fsdp2" else []))
    fast, slow = files.read()[0], files.read()[1]
    assert fast.steps == slow.steps == 24
    # three times the work, as much as the leader needs to name the node (straggler_relative);
    # not three times the compute on two loaded cores, where the fast rank gets less of one
    # (1.46x once in CI). Without the DDP hook both measured the same (the wait counted as compute).
    named_at = RendezvousSettings(run_id="steps", min_nodes=2, max_nodes=2).straggler_relative
    assert slow.compute > named_at * fast.compute, (fast, slow)
    # the fast rank waits a fifth of its step at least (1.57x its compute in that CI run); without
    # the hook its wait inside backward() counted as compute, and only the flag's all-reduce was seen
    assert fast.wall > 1.25 * fast.compute, fast


@pytest.mark.timeout(120)
def test_a_ddp_model_with_buffers_waits_for_rank_0_in_its_forward_and_rank_0_stands_out(tmp_path: Path) -> None:
    """DDP broadcasts a model's buffers (BatchNorm's running statistics) from rank 0 at the
    start of every forward, in C++. Rank 0 computes three times as much a step, before its
    forward: rank 1 waits for it there, not in the gradient all-reduce, and without that
    broadcast timed both measured alike."""
    files = run_two_ranks(tmp_path, DDP_WORKER, "--steps", "25", "--batchnorm", slow=0)
    slow, fast = files.read()[0], files.read()[1]
    assert fast.steps == slow.steps == 24
    named_at = RendezvousSettings(run_id="steps", min_nodes=2, max_nodes=2).straggler_relative
    assert slow.compute > named_at * fast.compute, (fast, slow)


def test_a_workers_traceback_leaves_out_the_step_timings_wrapper(tmp_path: Path) -> None:
    """A failed collective's traceback shows the script's lines and torch's, not ours."""
    script = tmp_path / "fails.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "dist.all_reduce(torch.ones(1), op=123)\n"
    )
    env = {**worker_env(tmp_path, 0, free_port(), "node-0"), "WORLD_SIZE": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 1 and "fails.py\", line 3, in <module>" in done.stderr, done.stderr
    assert "distributed_c10d.py" in done.stderr and "elasticrun" not in done.stderr, done.stderr
