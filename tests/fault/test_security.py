"""Job-level security and spec checks with real agents.

One running job on a standalone, token-protected store (`elasticrun store serve
--token-file`); then, against the same --rdzv-id:

- nodes whose job spec differs in one field — the script, --nproc-per-node, the
  --nnodes min:max — and a second job (another script, size, workers and restart
  budget): each is refused before it registers, with exit code 2 and one line naming
  what differs and the fix; it starts no worker;
- an agent with a wrong token and one with none: refused by the store (exit 2, one
  line), the token in neither its output nor the store's;

and through all of it the running job is undisturbed: still round 1, one node, its
worker never restarted. Then, on its own: an agent hosting the store with mutual TLS
(`client_ca`), which job control reaches with a client certificate and not without one,
and which refuses an agent without one. tests/test_rendezvous.py covers the spec check in-process
(nproc only); these run it end to end. Workers are plain Python (no torch), so the
whole module takes seconds.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticrun.errors import StoreAuthError
from elasticrun.launcher.control import JobTarget, JobView, read_job
from elasticrun.rendezvous.keys import Keys
from elasticrun.store.client.c10d import C10dClient
from elasticrun.store.client.grpc_store import GrpcStore
from elasticrun.store.credentials import worker_prefix
from elasticrun.store.server.limits import MAX_STREAMS_PER_CONNECTION
from elasticrun.store.settings import parse_access
from tests.support.certs import TestCa, write_pair
from tests.support.elastic_cluster import RDZV_CONF, Cluster, Proc
from tests.support.helpers import ELASTICRUN, free_port

pytestmark = pytest.mark.timeout(120)

TICKER = """\
import os, sys, time
from pathlib import Path

stop = Path(sys.argv[1])
print(f"worker up round={os.environ.get('ELASTICRUN_ROUND')} "
      f"restart={os.environ['TORCHELASTIC_RESTART_COUNT']} pid={os.getpid()}", flush=True)
n = 0
while not stop.exists():
    n += 1
    print(f"tick {n}", flush=True)
    time.sleep(0.1)
"""


class Job:
    """A token-protected store, and agents of one run id on it."""

    def __init__(self, cluster: Cluster, tmp: Path, store_prefix: tuple[str, ...] | None = ()) -> None:
        """`store_prefix`: what runs `store serve` (e.g. under `prlimit`); None: no store (an agent hosts it)."""
        self.cluster = cluster
        self.tmp = tmp
        self.token = "job-token-" + secrets.token_hex(10)
        self.token_file = tmp / "token"
        self.token_file.write_text(self.token)
        self.run_id = "sec-" + secrets.token_hex(4)
        self.stop_file = tmp / "stop"
        self.script = tmp / "train.py"
        self.other_script = tmp / "other.py"
        for path in (self.script, self.other_script):
            path.write_text(TICKER)
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        if store_prefix is not None:
            self.store = self.serve(prefix=store_prefix)

    def serve(self, name: str = "store", prefix: tuple[str, ...] = ()) -> Proc:
        """`elasticrun store serve` on the job's port, once it serves."""
        store = self.cluster.launch(
            name,
            "store", "serve", "--host", "127.0.0.1",
             "--port", str(self.port), "--token-file", str(self.token_file), prefix=prefix,
        )
        store.wait_for(r"serving on")
        return store

    def agent(self, name: str, *, script: Path | None = None, nnodes: str = "1:3", nproc: int = 1,
              max_restarts: int = 0, token_file: Path | None | str = "default", conf: str = "",
              is_host: bool = False, prefix: tuple[str, ...] = ()) -> Proc:
        token_file = self.token_file if token_file == "default" else token_file
        conf = f"{RDZV_CONF},is_host={str(is_host).lower()}{conf}" + (f",token_file={token_file}" if token_file else "")
        return self.cluster.launch(
            name, f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}",
            f"--rdzv-conf={conf}", "--local-addr=127.0.0.1", f"--max-restarts={max_restarts}",
            "--shutdown-timeout=5", f"--log-dir={self.tmp / 'logs'}",
            str(script or self.script), str(self.stop_file), prefix=prefix,
        )

    def view(self) -> JobView:
        async def read() -> JobView:
            conf = {"token_file": str(self.token_file)}
            target = JobTarget("c10d", self.endpoint, self.run_id, conf, parse_access("c10d", self.endpoint, conf, {}))
            async with target.open() as store:
                return await read_job(store, target)

        return asyncio.run(read())


@pytest.fixture
def job(cluster: Cluster, tmp_path: Path) -> Job:
    # the store is started through the cluster, so its cleanup kills it too (by PID)
    cluster._env.pop("ELASTICRUN_STORE_TOKEN", None)  # "no token" must mean none
    return Job(cluster, tmp_path)


def node_id(agent: Proc) -> str:
    return f"{socket.gethostname()}_{agent.pid}"


def refused(agent: Proc, *patterns: str) -> str:
    """The agent exited 2 with one error line matching every pattern; it started no worker."""
    code = agent.wait_exit()
    text = agent.text()
    errors = [line for line in text.splitlines() if line.startswith("elasticrun: error: ")]
    assert code == 2 and len(errors) == 1, f"{agent.name} exited {code}:\n{text[-3000:]}"
    for pattern in patterns:
        assert re.search(pattern, errors[0]), f"{agent.name}: /{pattern}/ not in {errors[0]!r}"
    assert "Traceback" not in text and "worker up" not in text, text[-3000:]
    return errors[0]


def assert_undisturbed(job: Job, running: Proc, ticks_before: int) -> None:
    """The job is as it was: round 1, only `running`, its worker not restarted and ticking on."""
    view = job.view()
    assert view.round is not None and view.round.number == 1, view.round
    assert [p.node_id for p in view.round.participants] == [node_id(running)]
    assert set(view.nodes) == {node_id(running)}, sorted(view.nodes)
    running.wait_for(rf"^\[0\]<stdout>: tick {ticks_before + 5}$")
    assert len(re.findall(r"worker up", running.text())) == 1, running.text()[-3000:]


def finish(job: Job, running: Proc) -> None:
    job.stop_file.touch()
    assert running.wait_exit() == 0, running.text()[-3000:]


def ticks(agent: Proc) -> int:
    found = re.findall(r"^\[0\]<stdout>: tick (\d+)$", agent.text(), re.MULTILINE)
    return int(found[-1]) if found else 0


def test_nodes_with_another_spec_are_refused(job: Job, reliability) -> None:
    a = job.agent("a")
    a.wait_for(r"^\[0\]<stdout>: tick 3$")
    clock = reliability.clock()
    others = {
        "script": job.agent("other-script", script=job.other_script),
        "nproc": job.agent("other-nproc", nproc=2),
        "min:max": job.agent("other-nnodes", nnodes="1:4"),
    }
    lines = {
        "script": refused(others["script"], r"job spec differs from the running job",
                          rf"command: job has \[.*{job.script.name}", rf"this node \[.*{job.other_script.name}",
                          r"start it with the same arguments, or use another --rdzv-id"),
        "nproc": refused(others["nproc"], r"nproc_per_node: job has '1', this node '2'"),
        "min:max": refused(others["min:max"], r"nnodes: job has '1:3', this node '1:4'"),
    }
    for field, line in lines.items():
        # exactly the field that differs is named, no other
        named = re.findall(r"(\w+): job has", line)
        assert named == [{"script": "command", "nproc": "nproc_per_node", "min:max": "nnodes"}[field]], line
    refused_s = clock()
    assert_undisturbed(job, a, ticks(a))
    finish(job, a)
    job.store.kill()
    job.cluster.assert_no_orphans()
    reliability.record(
        part="security",
        scenario="node with another job spec",
        injected="three agents joined a running job (1:3 nodes, 1 worker) with another script, "
        "--nproc-per-node=2, --nnodes=1:4",
        happened="each refused before registering: exit 2, one line naming the differing field "
        "(command / nproc_per_node / nnodes) and the fix; the job stayed at round 1, its worker never restarted",
        recovery_s=refused_s, restarts=0, lost="nothing",
    )


def test_second_job_reusing_a_running_id_is_refused(job: Job, reliability) -> None:
    a = job.agent("a")
    a.wait_for(r"^\[0\]<stdout>: tick 3$")
    second = job.agent("second-job", script=job.other_script, nnodes="2", nproc=2, max_restarts=3)
    line = refused(second, r"job spec differs from the running job", r"use another --rdzv-id")
    assert set(re.findall(r"(\w+): job has", line)) == {"command", "nnodes", "nproc_per_node", "max_restarts"}, line
    assert_undisturbed(job, a, ticks(a))
    # the same second job under its own id is fine: the refusal was about the id's job
    job.run_id, first_id = "sec-" + secrets.token_hex(4), job.run_id
    own = job.agent("second-job-own-id", script=job.other_script, nnodes="1", nproc=2, max_restarts=3)
    own.wait_for(r"^\[1\]<stdout>: tick 3$")
    finish(job, a)
    assert own.wait_exit() == 0
    job.run_id = first_id
    job.store.kill()
    job.cluster.assert_no_orphans()
    reliability.record(
        part="security",
        scenario="second job reusing a running job's id",
        injected="a job with another script, --nnodes=2, --nproc-per-node=2, --max-restarts=3 started with "
        "the running job's --rdzv-id",
        happened="refused at once (exit 2) naming command, nnodes, nproc_per_node, max_restarts; the running "
        "job undisturbed; the same job under its own id ran",
        restarts=0, lost="nothing",
    )


def test_agents_without_the_token_are_refused(job: Job, tmp_path: Path, reliability) -> None:
    a = job.agent("a")
    a.wait_for(r"^\[0\]<stdout>: tick 3$")
    wrong_file = tmp_path / "wrong-token"
    wrong = "not-" + job.token
    wrong_file.write_text(wrong)
    intruders = [job.agent("wrong-token", token_file=wrong_file), job.agent("no-token", token_file=None)]
    for intruder in intruders:
        line = refused(intruder, r"refused us", r"missing or wrong store token")
        assert job.token not in intruder.text() and wrong not in intruder.text(), line
    assert_undisturbed(job, a, ticks(a))
    finish(job, a)
    job.store.kill()
    job.cluster.assert_no_orphans()
    for proc in (job.store, a):
        assert job.token not in proc.text(), f"the token appears in {proc.name}'s output"
    reliability.record(
        part="security",
        scenario="agent with a wrong or no store token",
        injected="two agents joined a token-protected job's store, one with a wrong token file, one with none",
        happened="both refused by the store (exit 2, 'missing or wrong store token'); no change to the job; "
        "the token in no output of the store, the job's agent or the intruders",
        restarts=0, lost="nothing",
    )


def test_mutual_tls_on_the_store_an_agent_hosts(cluster: Cluster, tmp_path: Path, reliability) -> None:
    cluster._env.pop("ELASTICRUN_STORE_TOKEN", None)  # the certificates alone guard this store
    server_ca, client_ca = TestCa("server CA"), TestCa("client CA")
    (tmp_path / "server-ca.pem").write_bytes(server_ca.pem)
    (tmp_path / "client-ca.pem").write_bytes(client_ca.pem)
    server_cert, server_key = write_pair(server_ca.issue(), tmp_path, "server")
    node_cert, node_key = write_pair(client_ca.issue("node0"), tmp_path, "node0")
    ops_cert, ops_key = write_pair(client_ca.issue("ops"), tmp_path, "ops")
    trust = f"tls_ca={tmp_path / 'server-ca.pem'}"
    endpoint, run_id = f"127.0.0.1:{free_port()}", "mtls-" + secrets.token_hex(4)
    script, stop_file = tmp_path / "train.py", tmp_path / "stop"
    script.write_text(TICKER)

    def agent(name: str, conf: str) -> Proc:
        return cluster.launch(name, "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", f"--rdzv-conf={RDZV_CONF},{conf}",
            "--local-addr=127.0.0.1", "--shutdown-timeout=5", f"--log-dir={tmp_path / 'logs'}",
            str(script), str(stop_file),
        )

    def status(conf: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*ELASTICRUN, "status", "--json", "--rdzv-backend=c10d",
             f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", f"--rdzv-conf={conf}"],
            capture_output=True, text=True, timeout=60, env=cluster._env,
        )

    host = agent("host", f"is_host=true,tls_cert={server_cert},tls_key={server_key},"
                         f"client_ca={tmp_path / 'client-ca.pem'},{trust},"
                         f"client_cert={node_cert},client_key={node_key}")
    host.wait_for(r"^\[0\]<stdout>: tick 3$")
    # job control with a certificate of the clients' CA reads the job; without one it is told why, at once
    # (store_timeout is long: a refusal taken for an unreachable store would outlast the test)
    seen = status(f"{trust},client_cert={ops_cert},client_key={ops_key}")
    assert seen.returncode == 0, seen.stderr
    assert json.loads(seen.stdout)["job"]["state"] == "running", seen.stdout
    for conf in (f"{trust},store_timeout=600", f"{trust},store_timeout=600,client_cert={server_cert},"
                                               f"client_key={server_key}"):
        bare = status(conf)
        errors = [line for line in bare.stderr.splitlines() if line.startswith("elasticrun: error: ")]
        assert bare.returncode == 2 and len(errors) == 1, bare.stderr
        assert re.search(rf"the store at {endpoint} (requires a client certificate|refused this client's "
                         r"certificate)", errors[0]), errors[0]
    # an agent without a client certificate cannot join
    intruder = agent("no-certificate", f"is_host=false,{trust},store_timeout=600")
    refused(intruder, rf"the store at {endpoint} requires a client certificate and this client has none",
            r"client_cert=<file>,client_key=<file>")
    assert len(re.findall(r"worker up", host.text())) == 1, host.text()[-3000:]
    stop_file.touch()
    assert host.wait_exit() == 0, host.text()[-3000:]
    cluster.assert_no_orphans()
    reliability.record(
        part="security",
        scenario="mutual TLS on the store an agent hosts",
        injected="job control with a client certificate of the clients' CA, without one, and with one of "
        "another CA; an agent without one",
        happened="the certified client read the job; the others were refused at once (exit 2, one line naming "
        "the client certificate); the job ran on undisturbed",
        restarts=0, lost="nothing",
    )


FLOOD = Path(__file__).resolve().parents[1] / "workers" / "headers_flood.py"


async def victim_puts(endpoint: str, token: str, seconds: float) -> list[float]:
    """An admin client's put latencies, one put every 10 ms for `seconds`, sorted."""
    victim = GrpcStore(endpoint, token=token)
    latencies = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        await victim.put("/elasticrun/victim/r/job/state", b"x" * 100)
        latencies.append(time.perf_counter() - t)
        await asyncio.sleep(0.01)
    await victim.close()
    return sorted(latencies)


def test_an_anonymous_headers_flood_stalls_no_one(job: Job, reliability) -> None:
    """Calls opened with no token and no message, as fast as the store takes
    them over 8 connections, while a 2-node job runs and a third node joins.

    The flood goes on until the join is done (SIGTERM), up to 5,000,000 calls or
    120 s: a flood of fixed length ended before a loaded machine's join did."""
    a, b = job.agent("a", nnodes="2:3"), job.agent("b", nnodes="2:3")
    for agent in (a, b):
        agent.wait_for(r"^\[\d\]<stdout>: tick 3$")
    flood = job.cluster.start("flood", [sys.executable, str(FLOOD), job.endpoint, "8", "5000000", "120"])
    flood.wait_for(r"^flooding$")
    flood_began = time.monotonic()
    c = job.agent("c", nnodes="2:3")
    # every put goes through (a refused or failed one raises): the figures are recorded, not
    # bounded here, since a wall-clock bound fails on a loaded machine (bench_abuse.py times them)
    latencies = asyncio.run(victim_puts(job.endpoint, job.token, 3.0))
    p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
    for agent in (a, b, c):  # the newcomer joined: a new round, every node's worker up in it
        agent.wait_for(r"worker up round=2 ")
        agent.wait_for(r"^\[\d\]<stdout>: tick 3$", start=agent.text().index("worker up round=2 "))
    joined_during_flood = "flood-sent" not in flood.text()
    flooded_for = time.monotonic() - flood_began
    flood.signal(signal.SIGTERM)
    counts = dict(item.split("=") for item in flood.wait_for(r"^sent=.*$")[0].split())
    assert joined_during_flood, f"the flood ended before the newcomer's round: the test showed nothing ({counts})"
    for agent in (a, b):  # rounds 1 and 2, no membership lost to the flood
        assert len(re.findall(r"worker up", agent.text())) == 2, agent.text()[-3000:]
    job.stop_file.touch()
    for agent in (a, b, c):
        assert agent.wait_exit() == 0, agent.text()[-3000:]
    job.store.kill()
    job.cluster.assert_no_orphans()
    reliability.record(
        part="security",
        scenario="anonymous calls that never send their message (headers-only flood)",
        injected=f"8 TCP connections sent {int(counts['sent']):,} raw HTTP/2 HEADERS frames (no token, no "
        f"message) in {flooded_for:.0f} s while a 2-node job ran, a third node joined, and an admin client put a key "
        "every 10 ms",
        happened=f"every call refused from its headers ({counts['answered']} answered UNAUTHENTICATED, the rest "
        f"REFUSED_STREAM past {MAX_STREAMS_PER_CONNECTION} streams per connection, each connection shut once refused: "
        f"the flood connected {counts['connections']} times); the newcomer joined in round "
        f"2 and every worker stepped on; every victim put went through: p50 {p50 * 1000:.1f} ms, "
        f"p99 {p99 * 1000:.1f} ms",
        restarts=0, lost="nothing",
        victim_put_p50_ms=round(p50 * 1000, 1), victim_put_p99_ms=round(p99 * 1000, 1),
    )


#: sets 5 c10d keys of 1 KiB with its agent's worker credential, says so, and runs on
KEY_WRITER = """\
import os, sys, time
from pathlib import Path
from elasticrun.store.client.c10d import C10dClient

stop, endpoint = Path(sys.argv[1]), os.environ["KEY_WRITER_STORE"]
credential = Path(os.environ["ELASTICRUN_STORE_TOKEN_FILE"]).read_text().strip()
client = C10dClient(endpoint, token=credential, timeout=10)
for i in range(5):
    client.set(f"key{i}", b"x" * 1024)
print(f"keys set round={os.environ.get('ELASTICRUN_ROUND')}", flush=True)
while not stop.exists():
    time.sleep(0.1)
"""


def test_worker_keys_and_credentials_live_with_their_run(job: Job, tmp_path: Path, reliability) -> None:
    """After `stop`, the job's worker keys are gone; the credential a worker
    of that run held is refused once the job runs again under the same id."""
    writer = tmp_path / "writer.py"
    writer.write_text(KEY_WRITER)
    job.cluster._env["KEY_WRITER_STORE"] = job.endpoint
    admin = functools.partial(GrpcStore, job.endpoint, token=job.token)
    keys = worker_prefix(job.run_id)

    async def worker_keys() -> list[str]:
        store = admin()
        try:
            return [kv.key for kv in (await store.get_prefix(keys)).kvs]
        finally:
            await store.close()

    first = job.agent("first", script=writer, conf=",closed_ttl=0.5")
    first.wait_for(r"keys set round=1")
    assert len(asyncio.run(worker_keys())) == 5
    leaked = next((tmp_path / "logs").glob("*/store_token")).read_text().strip()  # a worker's, copied out
    stop = subprocess.run(
        [*ELASTICRUN, "stop", "--rdzv-id", job.run_id, "--rdzv-backend=c10d",
         f"--rdzv-endpoint={job.endpoint}", f"--rdzv-conf=token_file={job.token_file}"],
        capture_output=True, text=True, timeout=60, env=job.cluster._env,
    )
    assert stop.returncode == 0, stop.stderr
    first.wait_exit()
    assert asyncio.run(worker_keys()) == [], "the stopped job's worker keys outlived it"

    def with_leaked() -> str:
        client = C10dClient(job.endpoint, token=leaked, timeout=10)
        try:
            client.set("key0", b"evil")
        except StoreAuthError as e:
            return str(e)
        finally:
            client.close()
        return "accepted"

    # refused at once, while the closed record lives, and after
    assert "that has ended" in (ended_at_once := with_leaked()), ended_at_once

    async def closed_record_gone() -> None:  # it lives closed_ttl: until then the id starts no job
        store = admin()
        try:
            async with asyncio.timeout(30):
                while await store.get(Keys(job.run_id).round) is not None:
                    await asyncio.sleep(0.05)
        finally:
            await store.close()

    asyncio.run(closed_record_gone())
    assert "that has ended" in (ended_later := with_leaked()), ended_later
    assert asyncio.run(worker_keys()) == [], "the ended run's credential wrote"
    second = job.agent("second", script=writer, conf=",closed_ttl=0.5")
    second.wait_for(r"keys set round=1")

    refusal = with_leaked()
    assert "another run of job" in refusal, refusal
    assert len(asyncio.run(worker_keys())) == 5  # the new run's, untouched
    finish(job, second)
    job.store.kill()
    job.cluster.assert_no_orphans()
    reliability.record(
        part="security",
        scenario="worker keys and credentials outlive their job",
        injected="a job's worker set 5 c10d keys; its credential copied out; `elasticrun stop`; the job started "
        "again under the same id; the copied credential used against it",
        happened="the keys were deleted with the job's close; the ended run's credential was refused at once "
        "after `stop` and after the closed record expired (UNAUTHENTICATED: a run that has ended), and once "
        "the job ran again (another run of the job); the new run's workers set their keys",
        restarts=0, lost="nothing",
    )


def test_a_store_restart_starts_a_new_run_of_worker_keys_and_credentials(
    job: Job, tmp_path: Path, reliability
) -> None:
    """The store restarted empty under a running job; its agents form it
    anew, a new run: the old run's worker credential is refused, and the worker keys
    are the new run's only."""
    writer = tmp_path / "writer.py"
    writer.write_text(KEY_WRITER)
    job.cluster._env["KEY_WRITER_STORE"] = job.endpoint
    a = job.agent("a", script=writer, conf=",store_host_grace=60")
    a.wait_for(r"keys set round=1")
    token_file = next((tmp_path / "logs").glob("*/store_token"))
    leaked = token_file.read_text().strip()
    job.store.kill()
    job.store = job.serve("store-again")
    a.wait_for(r"keys set round=\d+", start=a.text().index("keys set round=1") + 1)

    async def after() -> tuple[list[str], str]:
        store = GrpcStore(job.endpoint, token=job.token)
        try:
            keys = [kv.key for kv in (await store.get_prefix(worker_prefix(job.run_id))).kvs]
        finally:
            await store.close()
        client = C10dClient(job.endpoint, token=leaked, timeout=10)
        try:
            await asyncio.to_thread(client.set, "key9", b"evil")
            return keys, "accepted"
        except StoreAuthError as e:
            return keys, str(e)
        finally:
            client.close()

    keys, refusal = asyncio.run(after())
    assert "another run of job" in refusal, refusal
    assert sorted(keys) == [worker_prefix(job.run_id) + f"key{i}" for i in range(5)], keys
    assert token_file.read_text().strip() != leaked  # the agent wrote its workers the new run's
    finish(job, a)
    job.store.kill()
    job.cluster.assert_no_orphans()
    reliability.record(
        part="security",
        scenario="worker credentials across a store restart",
        injected="a job's worker set 5 c10d keys; its credential copied out; `store serve` killed and started "
        "again empty on its port; the job formed anew; the copied credential used against it",
        happened="the job's first node drew a new run: the agent wrote its workers a credential of it; the old "
        "one was refused (UNAUTHENTICATED: another run of the job); the worker keys were the new run's only",
        restarts=0, lost="nothing",
    )
