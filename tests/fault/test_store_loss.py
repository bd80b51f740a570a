"""The c10d store's host is lost: SIGKILL the standalone `elasticrun store serve`, or the
agent that hosts the store in-process (is_host=true; its worker dies with it).

Every other agent must notice (its lease can no longer be renewed), stop its workers,
give up on the store, and exit 200 with one clear line that names the endpoint — no
traceback — and nothing of the test may be left running (the test tag: agents, workers,
and the store server, which carries the tag here too). A `store serve` may come back, so
the agents wait `store_timeout` for it. A store hosted by an agent comes back only with
a new agent at its endpoint (a restarted head: tests/fault/test_head_restart.py), or
from a successor (a job of three nodes or more: tests/fault/test_store_failover.py; this
one has two): the agents say so as soon as its port refuses them, wait `store_host_grace` (short here) for
a new one, and exit when none comes (store_timeout stays at its 10 s default there:
waiting it out instead would show in RELIABILITY.md's exit times).
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.fault.conftest import FaultCluster, check_no_line_lost, serve_store, step_pattern
from tests.support.elastic_cluster import RDZV_CONF, pid_alive, run_id
from tests.support.helpers import free_port, wait_until
from tests.support.reliability_rows import Reliability

pytestmark = pytest.mark.timeout(180)

STORE_TIMEOUT = 3
#: seconds the survivors of a store-hosting agent wait for a new one at its endpoint
HOST_GRACE = 2


@pytest.mark.parametrize("host", ["store-serve", "agent"])
def test_store_host_lost_agents_fail_clearly_and_leave_nothing(
    fault_cluster: FaultCluster, reliability: Reliability, host: str
) -> None:
    cluster = fault_cluster
    job = run_id()
    waits = f"store_timeout={STORE_TIMEOUT}" if host == "store-serve" else f"store_host_grace={HOST_GRACE}"
    conf = f"{RDZV_CONF},{waits}"
    if host == "store-serve":
        store, endpoint = serve_store("127.0.0.1", cluster.tmp / "store.log", env=cluster._env)
        cluster.procs.append(store)  # tagged: killed by PID at the end, checked as ours
        victim = store
        names, nnodes = ["a", "b", "c"], "3"
    else:
        endpoint = f"127.0.0.1:{free_port()}"
        victim = cluster.agent("h", endpoint=endpoint, run_id=job, local_addr="127.0.0.1", nnodes="2",
                               conf=conf + ",is_host=true")
        victim.wait_for(r"hosting the rendezvous store on .*: a job of at most 2 node\(s\) cannot fail over")
        names, nnodes = ["a"], "2"
    agents = [
        cluster.agent(n, endpoint=endpoint, run_id=job, local_addr=f"127.0.0.{i + 2}", nnodes=nnodes,
                      conf=conf + ",is_host=false")
        for i, n in enumerate(names)
    ]
    everyone = agents + ([victim] if host == "agent" else [])
    running = {p.name: p.wait_for(step_pattern(len(everyone))) for p in everyone}
    workers = [int(m["pid"]) for m in running.values()]
    marks = {p.name: p.mark() for p in agents}

    killed_at = time.monotonic()
    victim.signal(signal.SIGKILL)
    victim.wait_exit()
    ends: dict[str, float] = {}
    codes: dict[str, int] = {}
    for p in agents:
        codes[p.name] = p.wait_exit()
        ends[p.name] = time.monotonic() - killed_at
    wait_until(lambda: not any(pid_alive(w) for w in workers), what="every worker to stop")
    cluster.assert_no_orphans()

    for p in agents:
        text = p.text()
        assert codes[p.name] == 200, text[-4000:]
        assert "Traceback" not in text, text[-4000:]
        p.wait_for(r"lost its membership: .*store", start=marks[p.name])  # workers stopped first
        errors = re.findall(r"^elasticrun: error: .*$", text, re.MULTILINE)
        assert len(errors) == 1, text[-4000:]
        assert re.search(rf"store at {re.escape(endpoint)} is unreachable", errors[0]), errors[0]
        if host == "agent":
            p.wait_for(rf"refused a connection: waiting until \d\d:\d\d:\d\d \(store_host_grace={HOST_GRACE}s\) "
                       "for a new store there", start=marks[p.name])
            assert re.search(rf"the agent that hosted it is gone, and no new store answered there within "
                             rf"store_host_grace={HOST_GRACE}s$", errors[0]), errors[0]
    lines = check_no_line_lost(cluster)

    line = re.findall(r"^elasticrun: error: .*$", agents[0].text(), re.MULTILINE)[0]
    reliability.record(
        scenario=(
            f"c10d store host lost ({'standalone store serve' if host == 'store-serve' else 'store-hosting agent'})"
        ),
        injected=(
            "SIGKILL to "
            f"{'`elasticrun store serve`' if host == 'store-serve' else 'the agent hosting the store (is_host=true)'}"
            f" while {len(everyone)} nodes train"
        ),
        happened=(
            f"{len(agents)} other agents stopped their workers, exited {sorted(set(codes.values()))} after "
            f"{min(ends.values()):.1f}-{max(ends.values()):.1f} s "
            f"({waits}) with one line: "
            f"`{_shorten(line)}`; no process left"
        ),
        recovery_s=None,
        restarts=0,
        lost=f"the job (by design: no store, no job); 0 of {lines['lines']} log lines",
        exit_s=round(max(ends.values()), 2),
        **lines,
    )


def _shorten(line: str) -> str:
    """The error line up to its cause's first clause, for the table."""
    line = line.replace("elasticrun: error: ", "")
    return line if len(line) <= 90 else line[:87] + "..."
