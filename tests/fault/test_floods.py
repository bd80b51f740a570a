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

import asyncio
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from elasticrun.errors import StoreError
from elasticrun.store.client.grpc_store import GrpcStore
from elasticrun.store.server.limits import DESCRIPTOR_RESERVE, MAX_STREAMS_PER_CONNECTION, connection_cap
from tests.fault.test_security import Job
from tests.support.elastic_cluster import Cluster, Proc

pytestmark = pytest.mark.timeout(150)

WORKERS = Path(__file__).resolve().parents[1] / "workers"
IDLE_FLOOD = WORKERS / "idle_flood.py"
HEADERS_FLOOD = WORKERS / "headers_flood.py"
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


#: the calling flood: connections, each making an anonymous call every second for up to a minute
CALLING_CONNECTIONS, CALLING_SECONDS = 1500, 60


def test_anonymous_callers_hold_no_connection(served: Job, reliability) -> None:
    """1,500 connections, more than the store's cap, each opening an anonymous call every
    second (never idle, so gRPC's idle timeout never closes them): the store shuts each
    at its first refused call, and past the anonymous share the oldest that have not
    called yet, so a node joins and `status` answers while the flood's process goes on.

    Before, the 512 connections the cap let in held it for as long as they kept calling:
    every new connection was closed at accept."""
    job = served
    a = job.agent("a")
    a.wait_for(r"^\[0\]<stdout>: tick 3$")
    clock = reliability.clock()
    attack = job.cluster.start("calling-flood", [
        sys.executable, str(HEADERS_FLOOD), job.endpoint, str(CALLING_CONNECTIONS),
        str(CALLING_CONNECTIONS * CALLING_SECONDS), str(CALLING_SECONDS), f"--rate={CALLING_CONNECTIONS}", "--once",
    ])
    attack.wait_for(r"^flooding$")
    status_answers(job)
    b = job.agent("b")
    stepped_on(a, b)
    joined_s = clock()
    attack.wait_for(r"^flood-sent$")  # every connection ended: none kept by the store
    attack.signal(signal.SIGTERM)
    counts = dict(item.split("=") for item in attack.wait_for(r"^sent=.*$")[0].split())
    job.stop_file.touch()
    for agent in (a, b):
        assert agent.wait_exit() == 0, agent.text()[-3000:]
    assert "Traceback" not in job.store.text(), job.store.text()[-3000:]
    job.store.kill()
    job.cluster.assert_no_orphans()
    answered, opened = int(counts["answered"]), int(counts["connections"])
    assert 0 < answered <= connection_cap(DESCRIPTORS) * MAX_STREAMS_PER_CONNECTION, counts
    reliability.record(
        part="security",
        scenario="anonymous callers holding the connection cap",
        injected=f"{CALLING_CONNECTIONS:,} HTTP/2 connections, each opening a call with no token every second "
        f"(never idle), on `store serve` limited to {DESCRIPTORS:,} descriptors, while a 1-node job ran",
        happened=f"the store took {connection_cap(DESCRIPTORS)} (its cap) and shut each once its call was refused "
        f"({answered:,} calls answered of {int(counts['sent']):,} sent over {opened:,} connections); `status` "
        "answered, a second node joined (round 2) and the workers stepped on",
        recovery_s=joined_s, restarts=0, lost="nothing",
    )


#: the paced flood: HEADERS frames a second in all, over this many connections
PACED_RATE, PACED_CONNECTIONS = 50_000, 64
#: the victim's puts: one every 10 ms for this long, each given this long to answer
VICTIM_SECONDS, VICTIM_TIMEOUT = 10.0, 5.0


async def victim_calls(endpoint: str, token: str) -> tuple[list[float], int]:
    """An admin client's put latencies (sorted), one put every 10 ms for `VICTIM_SECONDS`, and how many failed."""
    victim = GrpcStore(endpoint, token=token, timeout=VICTIM_TIMEOUT)
    latencies, failed = [], 0
    end = time.monotonic() + VICTIM_SECONDS
    try:
        while time.monotonic() < end:
            t = time.perf_counter()
            try:
                await victim.put("/elasticrun/victim/r/job/state", b"x" * 100)
            except StoreError:
                failed += 1
            else:
                latencies.append(time.perf_counter() - t)
            await asyncio.sleep(0.01)
    finally:
        await victim.close()
    return sorted(latencies), failed


def test_a_paced_anonymous_headers_flood(served: Job, reliability) -> None:
    """50,000 HEADERS frames a second over 64 connections, no token, while a 2-node job runs,
    a third node joins and an admin client puts a key every 10 ms: its calls go through."""
    job = served
    a, b = job.agent("a", nnodes="2:3"), job.agent("b", nnodes="2:3")
    for agent in (a, b):
        agent.wait_for(r"^\[\d\]<stdout>: tick 3$")
    seconds = int(VICTIM_SECONDS) + 50  # bounded: at most PACED_RATE * seconds frames
    attack = job.cluster.start("paced-flood", [
        sys.executable, str(HEADERS_FLOOD), job.endpoint, str(PACED_CONNECTIONS), str(PACED_RATE * seconds),
        str(seconds), f"--rate={PACED_RATE}",
    ])
    attack.wait_for(r"^flooding$")
    began = time.monotonic()
    c = job.agent("c", nnodes="2:3")
    latencies, failed = asyncio.run(victim_calls(job.endpoint, job.token))
    stepped_on(a, b, c)
    during = "flood-sent" not in attack.text()
    flooded_s = time.monotonic() - began
    attack.signal(signal.SIGTERM)
    counts = dict(item.split("=") for item in attack.wait_for(r"^sent=.*$")[0].split())
    assert during, f"the flood ended before the newcomer's round: the test showed nothing ({counts})"
    calls = len(latencies) + failed
    assert failed <= calls // 100, f"{failed} of {calls} of the victim's puts failed under the flood"
    job.stop_file.touch()
    for agent in (a, b, c):
        assert agent.wait_exit() == 0, agent.text()[-3000:]
    job.store.kill()
    job.cluster.assert_no_orphans()
    p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
    # the rate the flood reached (the whole flood's frames over its whole time, the start included)
    rate = int(counts["sent"]) / (time.monotonic() - began + 1)
    reliability.record(
        part="security",
        scenario="paced anonymous headers flood",
        injected=f"{PACED_CONNECTIONS} TCP connections paced at {PACED_RATE:,} raw HTTP/2 HEADERS frames a second "
        f"(no token, no message; {int(counts['sent']):,} sent in {flooded_s:.0f} s, about {rate:,.0f} a second "
        "reached) while a 2-node job ran, a third node joined, and an admin client put a key every 10 ms",
        happened=f"{calls - failed} of {calls} puts went through (p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms); "
        f"the store shut each of the flood's connections once a call of it was refused ({int(counts['answered']):,} "
        f"answered; the flood connected {int(counts['connections']):,} times); the newcomer joined in round 2 and "
        "every worker stepped on",
        restarts=0, lost="nothing",
        victim_put_p50_ms=round(p50 * 1000, 1), victim_put_p99_ms=round(p99 * 1000, 1),
    )
