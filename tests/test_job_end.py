"""A job's end is final and quick for every agent, whoever hosts the store.

Each test runs real agents of a c10d job whose store one of them hosts (the endpoint is
its own address): the hosting agent must leave the job like the others and exit as soon
as the other nodes have gone; a lone one at once. A closed job is never formed again by
a leader that lingers (closed_ttl=1 here, so a lingering leader would show at once).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.elastic_cluster import RDZV_CONF, Cluster, Proc, run_id
from tests.helpers import ELASTICRUN, free_port

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
