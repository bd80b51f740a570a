"""The standalone store (`elasticrun store serve`) stalls past the lease TTL, or restarts
empty: the job goes on, in a new round at the same size, with its restart budget intact.

A stall longer than the TTL lets every lease lapse: each agent gives up its membership,
stops its workers and registers again under the same id. A restarted store has nothing
of the job: no round, no spec, no leases. In both cases the nodes say which round they
ran when they register again, so the leader sees that they left it and numbers the next
round above it; without that, every agent waited for a round number that the leader
(or a new store numbering from 1) never wrote, until join_timeout.
"""

from __future__ import annotations

import signal

import pytest

from tests.fault.conftest import FaultCluster, check_no_line_lost, serve_store, step_pattern
from tests.support.elastic_cluster import RDZV_CONF, run_id
from tests.support.reliability_rows import Reliability

pytestmark = pytest.mark.timeout(180)



def _start_job(cluster: FaultCluster) -> tuple[object, str, list]:
    store, endpoint = serve_store("127.0.0.1", cluster.tmp / "store.log", env=cluster._env)
    cluster.procs.append(store)
    job = run_id()
    conf = RDZV_CONF + ",is_host=false"
    agents = [
        cluster.agent(n, endpoint=endpoint, run_id=job, local_addr=f"127.0.0.{i + 2}", nnodes="1:2", conf=conf)
        for i, n in enumerate("ab")
    ]
    rounds = {int(p.wait_for(step_pattern(2, step=3))["round"]) for p in agents}
    assert len(rounds) == 1, rounds
    return store, endpoint, agents


@pytest.mark.parametrize("fault", ["stall", "restart"])
def test_job_goes_on_after_the_store_stalls_or_restarts_empty(
    fault_cluster: FaultCluster, reliability: Reliability, fault: str
) -> None:
    cluster = fault_cluster
    store, endpoint, agents = _start_job(cluster)
    before = int(agents[0].wait_for(step_pattern(2))["round"])
    marks = [p.mark() for p in agents]
    clock = reliability.clock()
    if fault == "stall":
        store.signal(signal.SIGSTOP)
        for p, mark in zip(agents, marks, strict=True):
            p.wait_for(r"lost its membership", start=mark)
        store.signal(signal.SIGCONT)
    else:
        port = endpoint.rsplit(":", 1)[1]
        store.signal(signal.SIGKILL)
        store.wait_exit()
        new_store, _ = serve_store("127.0.0.1", cluster.tmp / "store2.log", port=int(port), env=cluster._env)
        cluster.procs.append(new_store)  # named "store" too: killed by PID at the end
    later = rf"(?!{before}\b)\d+"  # any round but the one that ran before the fault
    after = [p.wait_for(step_pattern(2, round=later), start=mark) for p, mark in zip(agents, marks, strict=True)]
    recovered = clock()
    rounds = {int(m["round"]) for m in after}
    assert len(rounds) == 1 and rounds.pop() > before, (before, [m.group(0) for m in after])
    assert {m["restart"] for m in after} == {"0"}  # a store fault spends no restart
    for p in agents:
        assert "Traceback" not in p.text(), p.text()[-3000:]
        assert "no round of job" not in p.text(), p.text()[-3000:]  # the join timeout's message

    cluster.stop_training()
    for p in agents:
        assert p.wait_exit() == 0, p.text()[-3000:]
    for proc in cluster.procs:
        if proc.name.startswith("store"):
            proc.kill()
    cluster.assert_no_orphans()
    lines = check_no_line_lost(cluster)
    injected = {
        "stall": "SIGSTOP to `elasticrun store serve` for longer than the lease TTL (2 s), then SIGCONT",
        "restart": "SIGKILL to `elasticrun store serve`, a new empty one started on the same port",
    }[fault]
    reliability.record(
        scenario=f"store {'stalls past the TTL' if fault == 'stall' else 'restarts empty'}",
        injected=injected,
        happened="both agents registered again; the job went on at world 2 in a new round, restart budget untouched",
        recovery_s=recovered,
        restarts=0,
        lost=f"0 of {lines['lines']} log lines",
        **lines,
    )
