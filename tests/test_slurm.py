"""examples/slurm/fault_tolerant.sbatch under a real Slurm: sbatch, srun, sacct.

The cluster (`tests/support/slurm_cluster.py`) is one node with Debian's daemons. The tests
submit the example script itself, only its sizes changed on sbatch's command line (one
node with three tasks instead of five nodes with one each, no GPUs, one worker per
agent) and examples/train_elastic.py on gloo as the training:

- fault tolerance: srun's agents form a job of 2 training nodes and a spare; one
  training agent (not the one hosting the store) is SIGKILLed, as if its node died; the
  spare takes its place, training resumes from the checkpoint and ends, and sacct
  records the job COMPLETED (exit 0) although one agent was killed;
- elasticity: a job at `NNODES=1:2` trains alone; a second sbatch of the same script
  with `--join=<first job>` runs `elasticrun join` and the first job grows to 2 nodes;
  `elasticrun stop` (from outside, with the job's token file) ends the training, and
  both jobs end COMPLETED.

Skipped, with the reason, where Slurm's daemons are not installed or not root.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.helpers import ELASTICRUN, free_port, wait_until
from tests.support.slurm_cluster import SlurmCluster, why_unavailable

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "slurm" / "fault_tolerant.sbatch"
TRAIN = ROOT / "examples" / "train_elastic.py"
#: the example's sizes, made to fit one small host
SMALL = ["--nodes=1", "--cpus-per-task=1", "--gpus-per-node=0", "--time=5"]
#: bounds each wait on the job: a start includes importing torch on a loaded host
WAIT = 90.0

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    reason = why_unavailable()
    if reason is not None:
        pytest.skip(reason)
    cluster = SlurmCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


class Output:
    """The output file of a batch job (its agents' and workers' lines), read as it grows."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def text(self) -> str:
        return self.path.read_text(errors="replace") if self.path.exists() else ""

    def wait_for(self, pattern: str, timeout: float = WAIT, flags: int = 0) -> re.Match[str]:
        regex = re.compile(pattern, flags)
        try:
            match = wait_until(lambda: regex.search(self.text()), timeout, repr(pattern), interval=0.2)
        except AssertionError as e:
            raise AssertionError(f"{e}; the job's output:\n{self.text()[-4000:]}") from None
        assert match is not None
        return match


def submit(slurm: SlurmCluster, tmp_path: Path, *args: str, tasks: int, env: dict[str, str]) -> tuple[int, Output]:
    """sbatch the example with small sizes, training `TRAIN`; the job id and its output."""
    job = slurm.sbatch(
        *SMALL, f"--ntasks-per-node={tasks}", f"--output={tmp_path}/%x-%j.out", f"--chdir={tmp_path}",
        # LOGLEVEL=INFO: the agents' detailed lines (who formed round 1, who waits as the spare)
        str(SCRIPT), *args, env={"NPROC_PER_NODE": "1", "LOGLEVEL": "INFO", **env},
    )
    return job, Output(tmp_path / f"elastic-ft-{job}.out")


def training(steps: int) -> list[str]:
    return [str(TRAIN), f"--steps={steps}", "--step-time=0.1", "--checkpoint-every=5"]


@pytest.mark.slow  # the second allocation's test below runs the batch script too
@pytest.mark.timeout(300)
def test_the_spare_replaces_a_killed_node_and_the_job_completes_in_sacct(slurm: SlurmCluster, tmp_path: Path) -> None:
    ckpt, endpoint = tmp_path / "ckpt", f"localhost:{free_port()}"
    job, out = submit(slurm, tmp_path, *training(40), tasks=3,
                      env={"CKPT_DIR": str(ckpt), "RDZV_ENDPOINT": endpoint})
    # The agents' own lines: who hosts the store, who trains, who waits as the spare.
    host = out.wait_for(r"INFO (\S+)\] hosting the rendezvous store").group(1)
    participants = out.wait_for(r"round 1: formed with 2 nodes: (\S+), (\S+)$", flags=re.M).groups()
    spare = out.wait_for(r"node (\S+) waiting: spare: .*takes the place of a participant").group(1)
    assert spare not in participants, (participants, spare)

    out.wait_for(r"Step #6\s")  # training, and a checkpoint saved (step 5)
    victim = next(n for n in participants if n != host)  # not the store's host: the store dies with it
    os.kill(int(victim.rsplit("_", 1)[1]), signal.SIGKILL)  # node ids are <host>_<agent pid>
    out.wait_for(rf"round \d+: lost {victim} .*joined: {spare}")
    state, code = slurm.wait_ended(job, WAIT)
    text = out.text()
    assert (state, code) == ("COMPLETED", "0:0"), text[-4000:]
    resumed = [int(s) for s in re.findall(r"start at step (\d+): world size 2", text)]
    assert len(resumed) >= 2 and resumed[0] == 0 and resumed[-1] >= 5, resumed  # restarted from a checkpoint
    assert "Step #40 " in text
    codes = re.search(r"the agents' exit codes: (.*)", text)
    assert codes and sorted(codes.group(1).split()) == ["0", "0", "137"], text[-2000:]  # 128 + SIGKILL


@pytest.mark.timeout(300)
def test_a_second_allocation_joins_an_elastic_job_and_both_complete(slurm: SlurmCluster, tmp_path: Path) -> None:
    ckpt, endpoint = tmp_path / "ckpt", f"localhost:{free_port()}"
    env = {"CKPT_DIR": str(ckpt), "RDZV_ENDPOINT": endpoint, "NNODES": "1:2"}
    # Long enough to outlast the join, however slow the host; `elasticrun stop` ends it.
    first, first_out = submit(slurm, tmp_path, *training(5000), tasks=1, env=env)
    first_out.wait_for(r"start at step 0: world size 1")

    second, second_out = submit(slurm, tmp_path, f"--join={first}", *training(5000), tasks=1, env=env)
    first_out.wait_for(r"start at step \d+: world size 2")
    first_out.wait_for(r"Step #\d+ .*\(world size 2\)")
    stop = subprocess.run(
        [*ELASTICRUN, "stop", f"--rdzv-endpoint={endpoint}", f"--rdzv-id=slurm-{first}",
         f"--rdzv-conf=token_file={ckpt / 'store.token'}"],
        capture_output=True, text=True, timeout=WAIT,
    )
    assert stop.returncode == 0, stop.stdout + stop.stderr
    for job, out in ((first, first_out), (second, second_out)):
        state, code = slurm.wait_ended(job, WAIT)
        assert (state, code) == ("COMPLETED", "0:0"), f"job {job}:\n{out.text()[-4000:]}"
