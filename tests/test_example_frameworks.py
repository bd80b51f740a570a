"""The Lightning and Hugging Face examples keep training under elastic changes.

Each example runs as it would on a cluster: two agents (`python -m elasticrun`, nodes
127.0.0.1 and .2, one gloo worker each) on a standalone store, with one checkpoint
folder shared by the nodes. The test SIGKILLs the node of rank 0 (the one writing the
checkpoints) once a checkpoint exists, and leaves in the folder what a writer killed
while saving leaves; the survivor must restart its worker at world size 1 from the last
whole checkpoint. A third node then joins with `elasticrun join`; both
restart at world size 2 from the newest checkpoint and finish the run: exit 0, the
step count printed and checkpointed is the run's total, and every step after the last
restart is printed once, in order.

Every wait is for a line in an agent's output (the examples' rank 0 prints where it
starts and each step) or a process exit; everything is killed by PID at the end.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from examples.elastic_demo import descendants
from tests.support.elastic_cluster import Cluster, Proc, pid_alive, run_id
from tests.support.helpers import wait_until

pytestmark = pytest.mark.timeout(600)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
#: steps between checkpoints, and the run's total
EVERY, STEPS = 4, 32
#: a node lost is seen 2 s after its last heartbeat; a formation waits up to 5 s for the
#: second node (at max 2 it forms at once), so the run starts at world size 2
CONF = "heartbeat_timeout=2,last_call_timeout=5,join_timeout=60,is_host=false"
#: the bound of each wait on a worker's line or an exit: each spans a worker start, which
#: imports torch and the framework (5-10 s of CPU, two at once on two cores), or
#: training steps (a bound, not an expected time: on an idle 2-core box each test takes
#: under a minute)
WAIT = 180.0


def lightning_torn(folder: Path, step: int) -> None:
    """What the example's writer leaves when killed while saving: a half staging file."""
    (folder / "last.ckpt.partial-999999").write_bytes(b"PK\x03\x04 cut short")


def huggingface_torn(folder: Path, step: int) -> None:
    """What the Trainer leaves when killed while saving: a checkpoint folder without
    trainer_state.json (it writes that file last)."""
    torn = folder / f"checkpoint-{step}"
    torn.mkdir(exist_ok=True)
    (torn / "model.safetensors").write_bytes(b"cut short")


def lightning_step(folder: Path) -> int:
    import torch

    return int(torch.load(folder / "last.ckpt", map_location="cpu", weights_only=False)["global_step"])


def huggingface_step(folder: Path) -> int:
    state = folder / f"checkpoint-{STEPS}" / "trainer_state.json"
    return int(json.loads(state.read_text())["global_step"])


@dataclass(frozen=True)
class Example:
    script: Path
    folder_flag: str  # the flag that names its checkpoint folder
    step_flag: str  # the flag that sets the steps between checkpoints
    saved_step: Callable[[Path], int]  # the step of the last checkpoint in the folder
    torn: Callable[[Path, int], None]  # leave in the folder what a writer killed saving `step` leaves

    def command(self, folder: Path) -> list[str]:
        return [
            str(self.script), "--max-steps", str(STEPS), self.step_flag, str(EVERY),
            self.folder_flag, str(folder), "--step-time", "0.05",
        ]


EXAMPLE_CASES = {
    "lightning": Example(
        EXAMPLES / "lightning" / "train.py", "--checkpoint-dir", "--checkpoint-every", lightning_step, lightning_torn
    ),
    "huggingface": Example(
        EXAMPLES / "huggingface" / "train.py", "--output-dir", "--save-steps", huggingface_step, huggingface_torn
    ),
}


def node(cluster: Cluster, name: str, addr: int, endpoint: str, job: str, command: list[str]) -> Proc:
    """An agent of the job on 127.0.0.`addr`."""
    return cluster.launch(name, "--nnodes=1:2", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}", f"--rdzv-conf={CONF}",
        f"--local-addr=127.0.0.{addr}", "--max-restarts=0", "--shutdown-timeout=5",
        f"--log-dir={cluster.tmp / 'logs'}", *command,
    )


def join(cluster: Cluster, name: str, addr: int, endpoint: str, job: str, command: list[str]) -> Proc:
    """`elasticrun join` on 127.0.0.`addr`, running `command` (the job's own: join runs
    only the command its operator gives, and it must match the stored one)."""
    return cluster.launch(name, "join", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={job}", "--rdzv-conf=is_host=false", f"--local-addr=127.0.0.{addr}", "--timeout=60",
        "--", *command,
    )


def worker_pids(agent: Proc, script: Path) -> list[int]:
    """The processes below `agent` that run `script` (its workers)."""
    found = []
    for pid in descendants(agent.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(script).encode() in argv:
            found.append(pid)
    return found


def step_line(step: int | str, world: int) -> str:
    return rf"Step #{step}\s.*\(world size {world}\)"


# the slow pass: the README's command runs both examples through a node's replacement
# (tests/fault/test_shared_cpu_stragglers.py)
@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXAMPLE_CASES))
def test_example_resumes_after_a_lost_and_a_joined_node(
    name: str, cluster: Cluster, c10d_store: str, tmp_path: Path
) -> None:
    example = EXAMPLE_CASES[name]
    folder, job = tmp_path / "checkpoints", run_id()
    command = example.command(folder)
    a = node(cluster, "a", 1, c10d_store, job, command)
    b = node(cluster, "b", 2, c10d_store, job, command)
    ranks = {p: int(p.wait_for(r"workers init -> healthy: round \d+: node rank (\d)/2").group(1)) for p in (a, b)}
    first, survivor = sorted((a, b), key=ranks.__getitem__)
    first.wait_for(r"start at step 0: world size 2", timeout=WAIT)

    # Rank 0 checkpoints step EVERY before it prints the next step: kill its node then.
    first.wait_for(step_line(EVERY + 1, 2), timeout=WAIT)
    dead = worker_pids(first, example.script)
    assert dead, f"no worker of {first.name} runs {example.script}"
    # as if it died writing a checkpoint (of a step the run never reaches, so no real save
    # completes it): the survivor must resume from the last whole one
    example.torn(folder, STEPS + EVERY)
    os.kill(first.pid, signal.SIGKILL)
    first.wait_exit()
    wait_until(lambda: not any(pid_alive(p) for p in dead), what=f"the end of {first.name}'s worker")
    last_before = max(int(s) for s in re.findall(r"Step #(\d+)\s", first.text()))

    resumed = int(survivor.wait_for(r"start at step (\d+): world size 1", timeout=WAIT).group(1))
    assert EVERY <= resumed <= last_before and resumed % EVERY == 0, (resumed, last_before)
    survivor.wait_for(step_line(resumed + 1, 1), timeout=WAIT)

    # Hold the survivor's worker while the third node joins, so the run cannot end at
    # world size 1 first; let it go once the leader has decided the scale-up (its agent
    # then stops it for the restart at world size 2).
    held = worker_pids(survivor, example.script)
    assert held, f"no worker of {survivor.name} runs {example.script}"
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    mark = survivor.mark()
    c = join(cluster, "c", 3, c10d_store, job, command)
    try:
        survivor.wait_for(r"round \d+: scale up to 2 nodes", start=mark)
    finally:
        for pid in held:
            os.kill(pid, signal.SIGCONT)
    c.wait_for(r"workers init -> healthy: round \d+: node rank 1/2")
    last_start = survivor.wait_for(r"start at step (\d+): world size 2", start=mark, timeout=WAIT)
    again = int(last_start.group(1))
    assert resumed <= again and again % EVERY == 0, (resumed, again)

    for p in (survivor, c):
        assert p.wait_exit(WAIT) == 0, f"{p.name}:\n{p.text()[-4000:]}"
    after = [int(s) for s in re.findall(r"Step #(\d+)\s.*\(world size 2\)", survivor.text()[last_start.end():])]
    assert after == list(range(again + 1, STEPS + 1)), after
    assert re.search(rf"done at step {STEPS}: world size 2", survivor.text())
    assert example.saved_step(folder) == STEPS
    cluster.assert_no_orphans()
