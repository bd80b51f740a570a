"""Hangs show where they are stuck: real agents, real workers, real stacks.

- Under --progress-timeout, one rank stuck in a Python function while the others wait
  in a gloo all-reduce: the summary in the log, the failure report and `status` names
  that rank, its node, the function and the line; the other ranks wait in all_reduce.
- `elasticrun stacks` on a healthy two-node job returns every rank's stack; with a
  reader credential it shows the latest ones and says a fresh capture needs the admin
  token.
- A worker that does not load the boot (`python -I`) is reported as having no stack,
  and is not killed by the signal.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agent_helpers import wait_until
from tests.elastic_cluster import RDZV_CONF, Cluster, Proc, run_id

WORKERS = Path(__file__).resolve().parent / "workers"
STUCK = WORKERS / "stuck_rank_worker.py"
#: the line of load_batch where the stuck rank sleeps
STUCK_LINE = next(
    n for n, line in enumerate(STUCK.read_text().splitlines(), 1) if "the line the stacks must name" in line
)


def node_id(agent: Proc) -> str:
    """The agent's node id (its default: host_pid)."""
    return agent.wait_for(r" (\S+)\] worker logs and error files go under")[1]


def control(cluster: Cluster, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elasticrun", *argv], stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=timeout, env=cluster._env,
    )


def hang_line(agents: list[Proc], start: list[int]) -> tuple[Proc, re.Match[str]]:
    """The first agent to log where the ranks were when its watchdog found a hang (the
    node that asked the others: another node's watchdog may not fire before its workers
    are stopped)."""
    pattern = re.compile(r"where the ranks were when the hang was found \(([^)]*)\): (.*)$", re.M)
    found = wait_until(
        lambda: next(((a, m) for a, s in zip(agents, start, strict=True) if (m := pattern.search(a.text(), s))), None),
        120, "a hang's stacks in an agent's log",
    )
    return found


@pytest.mark.timeout(240)
def test_a_rank_stuck_in_a_function_is_named_with_its_node_function_and_line(
    cluster: Cluster, c10d_store: str, tmp_path: Path
) -> None:
    job = run_id()
    again = tmp_path / "stuck-again"
    common = dict(
        backend="c10d", endpoint=c10d_store, run_id=job, local_addr="127.0.0.1", nnodes="2", max_restarts=1,
        conf=RDZV_CONF + ",is_host=false", worker=STUCK, env={"ELASTICRUN_TEST_COLLECTIVE": "gloo"},
        extra=["--nproc-per-node=2", "--progress-timeout=5"],
        worker_args=["--stuck-rank", "3", "--again-file", str(again)],
    )
    agents = [cluster.agent(name, **common) for name in ("a", "b")]  # type: ignore[arg-type]
    ids = {a.name: node_id(a) for a in agents}
    agent, line = hang_line(agents, [0, 0])
    # the stuck rank's node: the agent whose worker said it is stuck
    stuck = next(a for a in agents if re.search(r"stuck at step=\d+ rank=3 ", a.text()))
    want = rf"rank 3 on node {re.escape(ids[stuck.name])}: stuck_rank_worker\.py:{STUCK_LINE} in load_batch"
    others = r"ranks 0, 1, 2 on nodes \S+, \S+: in all_reduce \(collective\.py:\d+\)"
    assert line[1] == "job-wide: 2 of 2 nodes answered", line[0]
    assert re.search(want, line[2]) and re.search(others, line[2]), line[0]
    kept = Path(re.search(r"all stacks in (\S+)$", line[0])[1]).read_text()  # type: ignore[index]
    assert "in load_batch" in kept and "in all_reduce" in kept and "torch/distributed" in kept, kept
    # one restart spent, the job runs again: status shows the summary
    for a in agents:
        a.wait_for(r"step=2 rank=\d+ world=4 group_rank=\d+ restart=1 ", timeout=120)
    status = control(cluster, "status", f"--rdzv-endpoint={c10d_store}", f"--rdzv-id={job}")
    assert status.returncode == 0, status.stderr
    shown = r"^stacks \d\d:\d\d:\d\d \(\S+: worker rank \d hung: no progress for \d+s; 2 of 2 nodes\): "
    assert re.search(shown + want, status.stdout, re.M), status.stdout
    data = json.loads(control(cluster, "status", "--json", f"--rdzv-endpoint={c10d_store}", f"--rdzv-id={job}").stdout)
    assert data["stacks"]["done"] and any(re.search(want, s) for s in data["stacks"]["summary"])
    # stuck again, no restart left: the failure report says where the ranks were
    marks = [a.mark() for a in agents]
    again.touch()
    agent, line = hang_line(agents, marks)
    assert re.search(want, line[2]), line[0]
    report = agent.wait_for(r"Where the ranks were \(their stacks when the hang was found; all of them in \S+\):\n"
                            r"(  .*\n)+", start=marks[agents.index(agent)])
    assert re.search(want, report[0]) and re.search(others, report[0]), report[0]
    for a in agents:
        assert a.wait_exit(60) != 0
    cluster.assert_no_orphans()
