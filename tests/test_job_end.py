"""A job's end is final and quick for every agent, whoever hosts the store.

Each test runs real agents of a c10d job whose store one of them hosts (the endpoint is
its own address): the hosting agent must leave the job like the others and exit as soon
as the other nodes have gone; a lone one at once. A closed job is never formed again by
a leader that lingers (closed_ttl=1 here, so a lingering leader would show at once).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.elastic_cluster import RDZV_CONF, Cluster, Proc, run_id
from tests.support.helpers import ELASTICRUN, free_port

pytestmark = pytest.mark.timeout(120)

TICKER = Path(__file__).resolve().parent / "workers" / "tick_worker.py"
#: a closed job record that expires at once: a leader still leading would re-form it
CONF = RDZV_CONF + ",closed_ttl=1,store_timeout=3"
#: how long an agent may take to exit once its job has ended (a hang is a failure)
EXIT_WITHIN = 30.0


def agent(cluster: Cluster, name: str, addr: int, endpoint: str, job: str, nnodes: str, script: Path) -> Proc:
    return cluster.launch(
        name, f"--nnodes={nnodes}", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}", f"--rdzv-conf={CONF}",
        f"--local-addr=127.0.0.{addr}", "--max-restarts=0", "--shutdown-timeout=5",
        f"--log-dir={cluster.tmp / 'logs'}", str(script), "--stop-file", str(cluster.stop_file),
    )


def failing_script(cluster: Cluster, rank: int) -> Path:
    """Ticks like tick_worker.py, but rank `rank` fails at its start."""
    script = cluster.tmp / "fail_worker.py"
    script.write_text(
        "import os, runpy\n"
        f"if os.environ['RANK'] == '{rank}':\n"
        "    raise SystemExit('worker failed on purpose')\n"
        f"runpy.run_path({str(TICKER)!r}, run_name='__main__')\n"
    )
    return script


def hosting_endpoint() -> str:
    return f"127.0.0.1:{free_port()}"


def assert_ended_once(host: Proc) -> None:
    """The host's log shows one formed round and no round after the job ended."""
    text = host.text()
    assert "Traceback" not in text, text[-3000:]
    rounds = re.findall(r"round \d+: formed", text)
    assert len(rounds) == 1, text[-3000:]


def test_lone_hosting_agent_exits_at_once_when_its_job_fails(cluster: Cluster) -> None:
    endpoint, job = hosting_endpoint(), run_id()
    script = cluster.tmp / "raise.py"
    script.write_text("raise SystemExit('worker failed on purpose')\n")
    host = agent(cluster, "host", 1, endpoint, job, "1:2", script)
    host.wait_for(r"hosting the rendezvous store on")
    assert host.wait_exit(timeout=EXIT_WITHIN) == 1, host.text()[-3000:]
    host.wait_for(r"worker failed on purpose")
    assert "keeping the store up" not in host.text()
    assert_ended_once(host)
    cluster.assert_no_orphans()


def test_every_agent_exits_when_a_worker_fails_whoever_hosts_the_store(cluster: Cluster) -> None:
    endpoint, job = hosting_endpoint(), run_id()
    script = failing_script(cluster, rank=2)
    host = agent(cluster, "host", 1, endpoint, job, "3", script)
    host.wait_for(r"hosting the rendezvous store on")
    others = [agent(cluster, n, i, endpoint, job, "3", script) for i, n in ((2, "b"), (3, "c"))]
    for proc in (host, *others):
        assert proc.wait_exit(timeout=EXIT_WITHIN) == 1, proc.text()[-3000:]
    assert_ended_once(host)
    cluster.assert_no_orphans()


def test_stop_ends_a_job_whose_store_an_agent_hosts(cluster: Cluster) -> None:
    endpoint, job = hosting_endpoint(), run_id()
    host = agent(cluster, "host", 1, endpoint, job, "2", TICKER)
    host.wait_for(r"hosting the rendezvous store on")
    guest = agent(cluster, "guest", 2, endpoint, job, "2", TICKER)
    for proc in (host, guest):
        proc.wait_for(r"tick=2 rank=\d world=2")
    done = subprocess.run(
        [*ELASTICRUN, "stop", "--timeout", "30", "--rdzv-backend=c10d",
         f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}", "--rdzv-conf=store_timeout=3"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"job '{job}' stopped" in done.stdout
    for proc in (host, guest):
        assert proc.wait_exit(timeout=EXIT_WITHIN) == 0, proc.text()[-3000:]
        assert "closed (stopped)" in proc.text()
    assert_ended_once(host)
    cluster.assert_no_orphans()


def test_a_nodes_failure_is_not_covered_by_another_nodes_success(cluster: Cluster, c10d_store: str) -> None:
    """Rank 1 succeeds and its node leaves; rank 0 then fails: its node exits 1, the job failed.

    As under torchrun, where the failing rank's node exits 1: another node's success
    closed the job, but a failure here is never reported as success (docs/concepts.md,
    "How a job ends")."""
    go = cluster.tmp / "go"
    script = cluster.tmp / "late_failure.py"
    script.write_text(
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "if os.environ['RANK'] == '1':\n"
        "    sys.exit(0)\n"
        "print('rank 0 waits', flush=True)\n"
        f"while not Path({str(go)!r}).exists():\n"
        "    time.sleep(0.05)\n"
        "sys.exit(3)\n"
    )
    job = run_id()
    conf = RDZV_CONF + ",is_host=false"
    nodes = [
        cluster.launch(
            name, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={c10d_store}",
            f"--rdzv-id={job}", f"--rdzv-conf={conf}", f"--local-addr=127.0.0.{addr}", "--max-restarts=1",
            f"--log-dir={cluster.tmp / 'logs'}", str(script),
        )
        for name, addr in (("a", 1), ("b", 2))
    ]
    ranks = {}
    for proc in nodes:
        found = proc.wait_for(r"ranks (\d)-\d of 2")
        ranks[int(found.group(1))] = proc
    failing, succeeding = ranks[0], ranks[1]
    failing.wait_for(r"rank 0 waits")
    assert succeeding.wait_exit(timeout=EXIT_WITHIN) == 0, succeeding.text()[-3000:]
    go.touch()
    assert failing.wait_exit(timeout=EXIT_WITHIN) == 1, failing.text()[-3000:]
    text = failing.text()
    assert "-> succeeded" not in text, text[-3000:]
    assert re.search(r"-> failed: .*worker rank 0 failed with exit code 3", text), text[-3000:]
    events = [json.loads(line) for path in (cluster.tmp / "logs").glob("*/events.jsonl")
              for line in path.read_text().splitlines()]
    last = {e["node"]: e["kind"] for e in events}
    assert sorted(last.values()) == ["failed", "succeeded"], last
    where = ("--rdzv-backend=c10d", f"--rdzv-endpoint={c10d_store}")
    status = cluster.control("status", *where, f"--rdzv-id={job}")
    assert status.returncode == 0, status.stdout + status.stderr
    assert re.search(rf"^{job}\s+failed\s", status.stdout, re.MULTILINE), status.stdout
    assert "worker rank 0 failed with exit code 3" in status.stdout, status.stdout
    listed = cluster.control("list", *where)
    assert re.search(rf"^{job}\s+failed\s", listed.stdout, re.MULTILINE), listed.stdout
    cluster.assert_no_orphans()


def test_status_shows_how_the_job_ended_once_the_store_host_is_gone(cluster: Cluster) -> None:
    """The store ended with the agent that hosted it: this machine's run folders say how the job ended."""
    endpoint, job = hosting_endpoint(), run_id()
    script = failing_script(cluster, rank=1)
    host = agent(cluster, "host", 1, endpoint, job, "2", script)
    host.wait_for(r"hosting the rendezvous store on")
    guest = agent(cluster, "guest", 2, endpoint, job, "2", script)
    for proc in (host, guest):
        assert proc.wait_exit(timeout=EXIT_WITHIN) == 1, proc.text()[-3000:]
    where = (f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}", "--rdzv-conf=store_timeout=2")
    done = cluster.control("status", *where, f"--log-dir={cluster.tmp / 'logs'}")
    assert done.returncode == 200, done.stdout + done.stderr
    assert "is unreachable" in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"job '{job}' as this machine's run folders last recorded it (the store is gone):", done.stdout
    ended = re.findall(r"^  (\S+)  (\w+)  [\d-]+ [\d:]+  (.*)$", done.stdout, re.MULTILINE)
    assert len(ended) == 2 and {kind for _, kind, _ in ended} == {"failed"}, done.stdout
    assert any("worker failed on purpose" in why or "worker rank 1 failed" in why for _, _, why in ended), done.stdout
    cluster.assert_no_orphans()


def test_a_worker_failure_among_several_nodes_says_the_restart_is_asked_not_spent(
    cluster: Cluster, c10d_store: str
) -> None:
    """Whether it spends a restart is the leader's to find (a node lost meanwhile spends none).

    The failing node says it asks; the next round's line says what was spent."""
    script = cluster.tmp / "fails_once.py"
    script.write_text(
        "import os, runpy, sys\n"
        "if os.environ['RANK'] == '1' and os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
        "    sys.exit('worker failed on purpose')\n"
        f"runpy.run_path({str(TICKER)!r}, run_name='__main__')\n"
    )
    job, conf = run_id(), RDZV_CONF + ",is_host=false"
    nodes = [
        cluster.launch(
            name, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={c10d_store}",
            f"--rdzv-id={job}", f"--rdzv-conf={conf}", f"--local-addr=127.0.0.{addr}", "--max-restarts=2",
            f"--log-dir={cluster.tmp / 'logs'}", str(script), "--stop-file", str(cluster.stop_file),
        )
        for name, addr in (("a", 1), ("b", 2))
    ]
    for proc in nodes:
        proc.wait_for(r"tick=2 rank=\d world=2")
    failed = next(p for p in nodes if "worker failed on purpose" in p.text())
    text = failed.text()
    assert "asking the leader to restart (it spends 1/2 unless a node was lost meanwhile)" in text, text[-3000:]
    assert "restarting (" not in text, text[-3000:]
    failed.wait_for(r"round 2: node rank \d/2, ranks \d-\d of 2, restart 1/2")
    cluster.stop_training()
    for proc in nodes:
        assert proc.wait_exit(timeout=EXIT_WITHIN) == 0, proc.text()[-3000:]
    cluster.assert_no_orphans()
