"""A flapping node is quarantined: the job trains on without it, and says so.

Two levels:

- the rendezvous in one event loop over an in-memory store: three nodes, one keeps
  asking for restarts (its workers "crash"); after `quarantine_after` failures the next
  round leaves it out, its waiting status says why, `elasticrun status` (rendered from
  the store) shows it, and a new leader inherits the quarantine;
- end to end: three real agents with training workers (tests/workers/train_worker.py --crash-dir),
  the worker on one node crashing at every start; after two failures that node is
  quarantined, the other two train on at world 2, the restart count stops growing, and
  `elasticrun status --json` names the node, its reason and the time left.

Every wait is for an event, bounded; every process is stopped by PID.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from elasticrun.launcher.commands.status import as_json, render
from elasticrun.launcher.control import JobTarget, read_job
from elasticrun.rendezvous.codec import decode
from elasticrun.rendezvous.elastic import ElasticRendezvous
from elasticrun.rendezvous.keys import Keys
from elasticrun.rendezvous.records import JobSpec, NodeInfo, QuarantineEntry, QuarantineTable
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.store.server.memory import MemoryStore
from elasticrun.store.settings import StoreAccess
from tests.support.elastic_cluster import Cluster, Proc, run_id
from tests.support.helpers import ELASTICRUN

WORKER = Path(__file__).resolve().parents[1] / "workers" / "train_worker.py"


# --- the rendezvous alone ----------------------------------------------------------------


def _node(store: MemoryStore, name: str, s: RendezvousSettings) -> ElasticRendezvous:
    me = NodeInfo(node_id=name, host="localhost", addr="127.0.0.1", nproc=1, pid=os.getpid(), started_at=time.time())
    return ElasticRendezvous(store, s, me, spec=JobSpec(command=("train.py",)))


@pytest.mark.timeout(60)
async def test_flapping_node_is_left_out_and_a_new_leader_keeps_it_out() -> None:
    store = MemoryStore()
    s = RendezvousSettings(
        run_id="job", min_nodes=2, max_nodes=4, last_call=0.2, heartbeat_ttl=30.0, join_timeout=30.0,
        quarantine_after=2, quarantine_cooldown=600.0,
    )
    a, b, c, d = (_node(store, n, s) for n in "abcd")
    keys = Keys("job")
    try:
        await a._register()  # a registers first, and leads
        rounds = await asyncio.gather(*(n.next_round() for n in (a, b, c, d)))
        assert {r.node_count for r in rounds} == {4}

        for failure in (1, 2):  # c's workers fail, twice
            ended = asyncio.ensure_future(a.round_ended())
            await c.request_restart(f"worker rank 2 failed with exit code 1 (failure {failure})")
            assert "restart after a worker failure on c" in await ended
            if failure == 1:
                again = await asyncio.gather(*(n.next_round() for n in (a, b, c, d)))
                assert {(r.node_count, r.restart_count) for r in again} == {(4, 1)}
        after = await asyncio.gather(a.next_round(), b.next_round(), d.next_round())
        assert {(r.node_count, r.restart_count) for r in after} == {(3, 2)}
        # The survivors keep their order. b, c and d registered at once, so theirs is the
        # order their registrations landed in (each first resolves its address on a
        # thread: not gather's order), not a fixed one.
        before = {n: r.node_rank for n, r in zip("abcd", again, strict=True)}
        ranks = {n: r.node_rank for n, r in zip("abd", after, strict=True)}
        assert sorted(ranks.values()) == [0, 1, 2] and ranks["a"] == 0  # a registered first
        assert sorted(ranks, key=ranks.__getitem__) == sorted(ranks, key=before.__getitem__)

        # c stays registered and waits, saying why
        waiting = asyncio.ensure_future(c.next_round())
        done, _ = await asyncio.wait({waiting}, timeout=0.5)
        assert not done, "a quarantined node must not be admitted"
        assert re.match(
            r"quarantined until \d\d:\d\d:\d\d \(2 failures, the latest: worker failure: ", c.waiting_status
        )

        # the record in the store, and `elasticrun status` (table and JSON) from it
        table = decode(QuarantineTable, (await store.get(keys.quarantine)).value)
        assert table.get("c").times == 1 and table.get("c").until > time.time() + 500
        # ... kept out of what every node watches (r/job/): c reads only its own hold
        watched = await store.get_prefix(keys.job)
        assert not [kv.key for kv in watched.kvs if b'"failures"' in kv.value], watched
        assert decode(QuarantineEntry, (await store.get(keys.hold("c"))).value) == table.get("c")
        view = await read_job(store, JobTarget("c10d", "memory", "job", {}, StoreAccess("c10d", ("memory",))))
        page = render(view, time.time())
        assert re.search(r"^c\s+quarantined\s", page, re.M), page
        assert re.search(r"^QUARANTINED\s+UNTIL\s+LEFT\s+TIMES\s+REASON$", page, re.M), page
        assert re.search(
            r"^c\s+\d\d:\d\d:\d\d\s+9m\d\ds\s+1\s+2 failures, the latest: worker failure", page, re.M
        ), page
        assert re.search(r"quarantine\s+c\s+quarantined until \d\d:\d\d:\d\d \(1st time\)", page), page
        data = as_json(view)
        assert [n["node_id"] for n in data["nodes"] if n["quarantined"]] == ["c"]  # type: ignore[index]
        (entry,) = data["quarantine"]  # type: ignore[misc]
        assert entry["quarantined"] and entry["registered"] and entry["left_s"] > 500

        # the leader leaves; another leads now, inherits the record, and keeps c out
        ended = asyncio.ensure_future(b.round_ended())
        await a.leave("preempted")
        assert "a left" in await ended  # the new leader found a's departure record
        rb, rd = await asyncio.gather(b.next_round(), d.next_round())
        assert (rb.node_count, rb.restart_count) == (2, 2)
        assert (rb.node_rank, rd.node_rank) == ((0, 1) if ranks["b"] < ranks["d"] else (1, 0))
        done, _ = await asyncio.wait({waiting}, timeout=0.5)
        assert not done, "the new leader must keep the quarantined node out"
        waiting.cancel()
    finally:
        await asyncio.gather(*(n.aclose() for n in (a, b, c, d)), return_exceptions=True)
        await store.close()


# --- end to end -----------------------------------------------------------------------------

STEP = r"step=(?P<step>\d+) rank=\d+ world={world} group_rank=\d+ restart=(?P<restart>\d+) round=(?P<round>\d+) pid=\d+"
CONF = (
    "heartbeat_timeout=2,last_call_timeout=0.5,join_timeout=60,is_host=false,"
    "quarantine_after=2,quarantine_cooldown=600"
)


def _agent(cluster: Cluster, name: str, addr: int, endpoint: str, job: str, crash_dir: Path) -> Proc:
    return cluster.launch(name,
        "--nnodes=2:3", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}",
        f"--rdzv-conf={CONF}", f"--local-addr=127.0.0.{addr}",
        "--max-restarts=5", "--shutdown-timeout=5", f"--log-dir={cluster.tmp / 'logs'}",
        str(WORKER), "--stop-file", str(cluster.stop_file), "--crash-dir", str(crash_dir), "--fail-step", "3",
    )


def _status(endpoint: str, job: str) -> dict:
    out = subprocess.run(
        [*ELASTICRUN, "status", "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--json"],
        capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if k != "ELASTICRUN_TEST_TAG"},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.timeout(240)
def test_a_node_whose_workers_keep_crashing_is_quarantined(cluster: Cluster, c10d_store: str, reliability) -> None:
    job = run_id()
    crash_dir = cluster.tmp / "crash"
    crash_dir.mkdir()
    a = _agent(cluster, "a", 2, c10d_store, job, crash_dir)
    b = _agent(cluster, "b", 3, c10d_store, job, crash_dir)
    for p in (a, b):
        p.wait_for(STEP.format(world=2))
    c = _agent(cluster, "c", 4, c10d_store, job, crash_dir)
    bad = f"{socket.gethostname()}_{c.pid}"  # the launcher's node id: host_pid
    for p in (a, b, c):
        p.wait_for(STEP.format(world=3))

    (crash_dir / bad).touch()  # from now on c's workers crash at step 3 of every start
    c.wait_for(r"RuntimeError: injected crash on bad node", count=2)
    clock = reliability.clock()
    a.wait_for(r"step=\d+ rank=\d+ world=2 group_rank=\d+ restart=2 ")
    recovery = clock()
    c.wait_for(r"waiting: quarantined until \d\d:\d\d:\d\d \(2 failures, the latest: worker failure: ")

    # the job trains on without c, and the restart count stays at 2
    for p in (a, b):
        p.wait_for(r"step=\d+ rank=\d+ world=2 group_rank=\d+ restart=2 ", count=30)
    status = _status(c10d_store, job)
    assert status["job"]["restarts"] == 2 and status["job"]["world_size"] == 2, status["job"]
    assert bad not in status["job"]["nodes"]
    (entry,) = [e for e in status["quarantine"] if e["node_id"] == bad]
    assert entry["quarantined"] and entry["registered"] and entry["times"] == 1
    assert entry["left_s"] > 300
    assert re.match(
        r"2 failures, the latest: worker failure: worker rank \d failed with exit code 1", entry["reason"]
    ), entry
    assert [n["quarantined"] for n in status["nodes"] if n["node_id"] == bad] == [True]
    for p in (a, b, c):
        assert not re.search(r"restart=3 ", p.text())
    # c's workers were started twice (restart 0 and 1) and never again
    assert not re.search(r"worker started rank=\d+ world=\d+ group_rank=\d+ restart=2", c.text())

    reliability.record(
        scenario="flapping node",
        injected="the worker on node c crashes at step 3 of every start (quarantine_after=2)",
        happened="after its 2nd crash c was quarantined (600 s); a, b trained on at world 2, "
        "the restart count stayed at 2; status --json showed c quarantined with its reason",
        recovery_s=recovery,
        restarts=2,
        lost="the steps since the last checkpoint, twice (this worker keeps none)",
    )

    cluster.stop_training()
    for p in (a, b):
        assert p.wait_exit() == 0, p.text()[-4000:]
    # c, still waiting out its quarantine, sees the job end and exits 0
    assert c.wait_exit() == 0, c.text()[-4000:]
    cluster.assert_no_orphans()
