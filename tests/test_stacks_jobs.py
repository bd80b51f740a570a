"""Hangs show where they are stuck: real agents, real workers, real stacks.

- Under --progress-timeout, one rank stuck in a Python function while the others wait
  in a gloo all-reduce: the summary in the log, the failure report and `status` names
  that rank, its node, the function and the line; the other ranks wait in all_reduce.
- `elasticrun stacks` on a healthy two-node job returns every rank's stack; with a
  reader credential it shows the latest ones and says a fresh capture needs the admin
  token.
- A worker that does not load the boot (`python -I`) is reported as having no stack,
  and is not killed by the signal.
- A round that ends because a peer froze: the survivor's log says where its worker
  waited (in the all-reduce) before it was stopped.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from elasticrun.store.credentials import reader_credential
from tests.support.elastic_cluster import RDZV_CONF, TAG_VAR, Cluster, Proc, run_id
from tests.support.helpers import ELASTICRUN, wait_until

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
        [*ELASTICRUN, *argv], stdin=subprocess.DEVNULL, capture_output=True, text=True,
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
        # the workers' start (torch's import, the group) under the start timeout, their loop under 5 s
        extra=["--nproc-per-node=2", "--progress-timeout=5", "--progress-start-timeout=120"],
        worker_args=["--stuck-rank", "3", "--again-file", str(again)],
    )
    agents = [cluster.agent(name, **common) for name in ("a", "b")]  # type: ignore[arg-type]
    ids = {a.name: node_id(a) for a in agents}
    agent, line = hang_line(agents, [0, 0])
    # the stuck rank's node: the agent whose worker said it is stuck
    stuck = next(a for a in agents if re.search(r"stuck at step=\d+ rank=3 ", a.text()))
    want = rf"rank 3 on node {re.escape(ids[stuck.name])}: stuck_rank_worker\.py:{STUCK_LINE} in load_batch"
    others = r"ranks 0, 1, 2 on nodes \S+, \S+: in all_reduce \(collective\.py:\d+\)"
    assert re.fullmatch(r"job-wide: 2 of 2 nodes answered, [\d.]+s", line[1]), line[0]
    assert re.search(want, line[2]) and re.search(others, line[2]), line[0]
    kept = Path(re.search(r"all stacks in (\S+)$", line[0])[1]).read_text()  # type: ignore[index]
    assert "in load_batch" in kept and "in all_reduce" in kept and "torch/distributed" in kept, kept
    # one restart spent, the job runs again: status shows the summary
    for a in agents:
        a.wait_for(r"step=2 rank=\d+ world=4 group_rank=\d+ restart=1 ", timeout=120)
    status = control(cluster, "status", f"--rdzv-endpoint={c10d_store}", f"--rdzv-id={job}")
    assert status.returncode == 0, status.stderr
    # the hang's reason, with where its worker waited when it waited in a collective
    hung = r"worker rank \d hung: no progress for \d+s( \(waiting in all_reduce for \d+s\))?"
    shown = rf"^stacks \d\d:\d\d:\d\d \(\S+: {hung}; 2 of 2 nodes\): "
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


@pytest.mark.timeout(180)
def test_stacks_returns_every_rank_of_a_healthy_job_and_a_reader_sees_the_latest(
    cluster: Cluster, tmp_path: Path
) -> None:
    token, reader = tmp_path / "token", tmp_path / "reader"
    token.write_text("stacks-admin-token")
    reader.write_text(reader_credential("stacks-admin-token"))
    store = Proc("store", [*ELASTICRUN, "store", "serve", "--host", "127.0.0.1",
                           "--port", "0", "--token-file", str(token)],
                 tmp_path / "store.log", {k: v for k, v in os.environ.items() if k != TAG_VAR})
    store.tagged = False
    try:
        endpoint = store.wait_for(r"serving on (\S+)")[1]
        job = run_id()
        conf = f"{RDZV_CONF},is_host=false,token_file={token}"
        agents = [
            cluster.agent(name, backend="c10d", endpoint=endpoint, run_id=job, local_addr="127.0.0.1",
                          nnodes="2", conf=conf, extra=["--nproc-per-node=2"])
            for name in ("a", "b")
        ]
        ids = sorted(node_id(a) for a in agents)
        for a in agents:
            a.wait_for(r"step=3 rank=\d+ world=4 ", count=2)
        flags = [f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}"]
        fresh = control(cluster, "stacks", *flags, f"--rdzv-conf=token_file={token}")
        assert fresh.returncode == 0, fresh.stderr
        assert re.match(rf"job '{job}', round \d+: 2 of 2 nodes answered in [\d.]+s\n", fresh.stdout), fresh.stdout
        shown = set()
        for m in re.finditer(r"^--- ranks? ([\d,-]+) \(\d+ on nodes? ([^)]*)\): (.*)$", fresh.stdout, re.M):
            shown |= set(expand(m[1]))
            assert "no stack" not in m[3] and "train_worker.py" in fresh.stdout[m.end():].split("---")[0]
        assert shown == {0, 1, 2, 3}, fresh.stdout
        data = json.loads(control(cluster, "stacks", *flags, f"--rdzv-conf=token_file={token}", "--json").stdout)
        assert data["fresh"] and [r["rank"] for r in data["ranks"]] == [0, 1, 2, 3]
        assert sorted(n["node_id"] for n in data["nodes"]) == ids
        for r in data["ranks"]:
            main = r["threads"][0]
            assert main["main"] and any(f["file"].endswith("train_worker.py") for f in main["frames"]), r
        one = control(cluster, "stacks", *flags, f"--rdzv-conf=token_file={token}", "--rank", "2")
        assert one.returncode == 0 and re.search(r"^rank 2 \(node \S+, local rank 0, pid \d+\):$", one.stdout, re.M)
        # a reader cannot ask: it gets the latest stacks, and is told why
        latest = control(cluster, "stacks", *flags, f"--rdzv-conf=token_file={reader}")
        assert latest.returncode == 0, latest.stderr
        assert "a fresh capture needs the admin token" in latest.stderr
        assert re.match(rf"job '{job}': the latest stacks of 2 nodes, captured ", latest.stdout), latest.stdout
        assert "train_worker.py" in latest.stdout
        status = control(cluster, "status", *flags, f"--rdzv-conf=token_file={reader}")
        assert re.search(r"^stacks \d\d:\d\d:\d\d \(on demand \(elasticrun stacks\); 2 of 2 nodes\): ",
                         status.stdout, re.M), status.stdout
        # the workers ran on: nothing was killed or restarted
        for a in agents:
            assert "restart=1" not in a.text() and "hung" not in a.text()
        cluster.stop_training()
        for a in agents:
            assert a.wait_exit(60) == 0, a.text()[-3000:]
        cluster.assert_no_orphans()
    finally:
        store.kill()


def expand(ranges: str) -> list[int]:
    """`0-2,4` -> [0, 1, 2, 4]."""
    out: list[int] = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        out += range(int(low), int(high or low) + 1)
    return out


@pytest.mark.timeout(120)
def test_a_worker_without_the_boot_is_reported_and_not_killed(
    cluster: Cluster, c10d_store: str, tmp_path: Path
) -> None:
    script = tmp_path / "plain.py"
    script.write_text(
        "import itertools, os, time\n"
        "for step in itertools.count():\n"
        "    print(f'step={step} pid={os.getpid()}', flush=True)\n"
        "    if os.path.exists(os.environ['STOP_FILE']):\n"
        "        break\n"
        "    time.sleep(0.1)\n"
    )
    job = run_id()
    agent = cluster.launch(
        "agent", "--nnodes=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={c10d_store}", f"--rdzv-id={job}", f"--rdzv-conf={RDZV_CONF},is_host=false",
        "--local-addr=127.0.0.1", f"--log-dir={tmp_path / 'logs'}", "--no-python", sys.executable, "-I",
        str(script), env={"STOP_FILE": str(cluster.stop_file)},
    )
    first = agent.wait_for(r"step=2 pid=(\d+)")
    out = control(cluster, "stacks", f"--rdzv-endpoint={c10d_store}", f"--rdzv-id={job}")
    assert out.returncode == 0, out.stderr
    said = (r"^  rank 0 on node \S+: no stack: its Python has not started yet, or it never loads "
            r"elasticrun's boot \(Python started with -I, -E or -S, or not Python\)")
    assert re.search(said, out.stdout, re.M), out.stdout
    mark = agent.mark()
    agent.wait_for(rf"step=\d+ pid={first[1]}", start=mark)  # the same process runs on
    cluster.stop_training()
    assert agent.wait_exit(60) == 0, agent.text()[-3000:]
    cluster.assert_no_orphans()


@pytest.mark.timeout(120)
def test_a_frozen_peer_s_round_end_shows_where_this_node_s_workers_waited(cluster: Cluster, c10d_store: str) -> None:
    """A peer frozen mid-training (SIGSTOP: its agent and its worker) is dropped when its
    lease expires; the survivor captures its worker before stopping it: waiting in the
    all-reduce for the frozen peer."""
    job = run_id()
    common = dict(backend="c10d", endpoint=c10d_store, run_id=job, local_addr="127.0.0.1", nnodes="1:2",
                  conf=RDZV_CONF + ",is_host=false")
    a = cluster.agent("a", **common)  # type: ignore[arg-type]
    a.wait_for(r"step=2 rank=0 world=1 ")
    b = cluster.agent("b", **common)  # type: ignore[arg-type]
    worker = b.wait_for(r"step=3 rank=\d+ world=2 .* pid=(\d+)")
    a.wait_for(r"step=3 rank=\d+ world=2 ")
    mark = a.mark()
    os.kill(b.pid, signal.SIGSTOP)
    os.kill(int(worker[1]), signal.SIGSTOP)
    line = a.wait_for(r"where this node's workers were when round \d+ ended \(round \d+: [^;]*; captured in "
                      r"[\d.]+s\): (.*)$", start=mark)
    waited = r"rank \d on node \S+: in \w+ \(collective\.py:\d+\); all stacks in \S+/stacks_1\.txt$"
    assert re.match(waited, line[1]), line[0]
    a.wait_for(r"step=\d+ rank=0 world=1 ", start=a.mark())
    b.kill()  # its frozen worker dies with it (PR_SET_PDEATHSIG)
    cluster.stop_training()
    assert a.wait_exit(60) == 0, a.text()[-3000:]
    cluster.assert_no_orphans()
