"""Connections that cost the store nothing: idle-connection floods on a served and a hosted store.

An anonymous client opens far more HTTP/2 connections than the store's process has
descriptors for (its soft and hard limit set to 1,024 with `prlimit`), sends the preface
and acknowledges pings, and opens no call: what took a store's every descriptor in under
a second, and killed the agent hosting it at its next scan of /proc. Meanwhile the job
steps on, `status` answers, a node joins, and the hosting agent lives; the flood's
connections are closed within seconds (`grpc.max_connection_idle_ms`), and those past
the store's connection cap at once. Floods go to 127.0.0.1 only, bounded in count
(`FLOOD_CONNECTIONS`) and time.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from elasticrun.store.server.limits import DESCRIPTOR_RESERVE, connection_cap
from tests.elastic_cluster import Cluster, Proc
from tests.fault.test_security import Job

pytestmark = pytest.mark.timeout(150)

WORKERS = Path(__file__).resolve().parents[1] / "workers"
IDLE_FLOOD = WORKERS / "idle_flood.py"
#: the store's process may hold this many descriptors, no more (soft and hard)
DESCRIPTORS = 1024
PRLIMIT = ("prlimit", f"--nofile={DESCRIPTORS}:{DESCRIPTORS}", "--")
#: more than the process has descriptors for
FLOOD_CONNECTIONS = 1500
#: how long the flood holds what it opened, at most
FLOOD_SECONDS = 40


@pytest.fixture
def served(cluster: Cluster, tmp_path: Path) -> Job:
    """A job on `store serve` limited to `DESCRIPTORS` descriptors."""
    cluster._env.pop("ELASTICRUN_STORE_TOKEN", None)
    return Job(cluster, tmp_path, store_prefix=PRLIMIT)


@pytest.fixture
def hosted(cluster: Cluster, tmp_path: Path) -> Job:
    """A job whose first agent will host the store."""
    cluster._env.pop("ELASTICRUN_STORE_TOKEN", None)
    return Job(cluster, tmp_path, store_prefix=None)


def flood(cluster: Cluster, endpoint: str) -> Proc:
    """An idle-connection flood on `endpoint`, once every connection is made or refused."""
    proc = cluster.start("idle-flood", [sys.executable, str(IDLE_FLOOD), endpoint, str(FLOOD_CONNECTIONS),
                                        str(FLOOD_SECONDS)])
    proc.wait_for(r"^opened \d+ failed \d+$")
    return proc


def closed_within(proc: Proc) -> tuple[float, int]:
    """Seconds from the flood's last connection made to the store's closing them all, and how many it held
    a second after they were made or refused (the connect of one refused succeeds; then it is closed)."""
    closed = float(proc.wait_for(r"^all-closed (\S+)$", timeout=FLOOD_SECONDS + 10)[1])
    counts = [int(n) for n in re.findall(r"^open (\d+)$", proc.text(), re.MULTILINE)]
    return closed, max(counts[1:], default=0)


def stepped_on(*agents: Proc) -> None:
    """Every agent's worker is up in round 2 and has stepped 3 times in it."""
    for agent in agents:
        agent.wait_for(r"worker up round=2 ")
        agent.wait_for(r"^\[\d\]<stdout>: tick 3$", start=agent.text().index("worker up round=2 "))


def status_answers(job: Job) -> None:
    conf = f"token_file={job.token_file}"
    seen = job.cluster.control("status", "--rdzv-backend=c10d", f"--rdzv-endpoint={job.endpoint}",
                               f"--rdzv-id={job.run_id}", f"--rdzv-conf={conf}")
    assert seen.returncode == 0, seen.stderr
    assert "running" in seen.stdout, seen.stdout


def test_an_idle_connection_flood_on_a_served_store(served: Job, reliability) -> None:
    job = served
    a = job.agent("a")
    a.wait_for(r"^\[0\]<stdout>: tick 3$")
    clock = reliability.clock()
    attack = flood(job.cluster, job.endpoint)
    status_answers(job)
    b = job.agent("b")
    stepped_on(a, b)
    joined_s = clock()
    closed_s, opened = closed_within(attack)
    job.stop_file.touch()
    for agent in (a, b):
        assert agent.wait_exit() == 0, agent.text()[-3000:]
    assert "Traceback" not in job.store.text(), job.store.text()[-3000:]
    job.store.kill()
    attack.kill()
    job.cluster.assert_no_orphans()
    cap = connection_cap(DESCRIPTORS)
    assert opened <= cap, f"the store held {opened} of the flood's connections at once, past its cap {cap}"
    reliability.record(
        part="security",
        scenario="idle-connection flood on a served store",
        injected=f"{FLOOD_CONNECTIONS:,} HTTP/2 connections with no call and no token (preface, pings answered) "
        f"on `store serve` limited to {DESCRIPTORS:,} descriptors, while a 1-node job ran",
        happened=f"the store held {opened} at once (its cap {cap}: the limit less {DESCRIPTOR_RESERVE} kept for "
        f"itself) and closed them {closed_s:.0f} s after the last was made; `status` answered, a second node "
        "joined (round 2) and the workers stepped on",
        recovery_s=joined_s, restarts=0, lost="nothing",
    )


def test_an_idle_connection_flood_on_a_hosted_store(hosted: Job, reliability) -> None:
    """The same flood on the store an agent hosts: the agent lives and its job goes on."""
    job = hosted
    host = job.agent("host", nnodes="2:3", is_host=True, prefix=PRLIMIT)
    b = job.agent("b", nnodes="2:3")
    for node in (host, b):
        node.wait_for(r"^\[\d\]<stdout>: tick 3$")
    clock = reliability.clock()
    attack = flood(job.cluster, job.endpoint)
    status_answers(job)
    c = job.agent("c", nnodes="2:3")
    stepped_on(host, b, c)
    joined_s = clock()
    closed_s, opened = closed_within(attack)
    assert host.popen.poll() is None, host.text()[-3000:]
    job.stop_file.touch()
    for node in (host, b, c):
        assert node.wait_exit() == 0, node.text()[-3000:]
    text = host.text()
    assert "Traceback" not in text, text[-3000:]
    assert len(re.findall(r"out of file descriptors", text)) <= 1, text[-3000:]
    attack.kill()
    job.cluster.assert_no_orphans()
    cap = connection_cap(DESCRIPTORS)
    assert opened <= cap, f"the store held {opened} of the flood's connections at once, past its cap {cap}"
    reliability.record(
        part="security",
        scenario="idle-connection flood on the store an agent hosts",
        injected=f"{FLOOD_CONNECTIONS:,} HTTP/2 connections with no call and no token on the store of an agent "
        f"limited to {DESCRIPTORS:,} descriptors, while a 2-node job ran",
        happened=f"the hosting agent lived with descriptors to spare: its store held {opened} at once (its cap "
        f"{cap}) and closed them {closed_s:.0f} s after the last was made; `status` answered, a third node "
        "joined (round 2), every worker stepped on",
        recovery_s=joined_s, restarts=0, lost="nothing",
    )
