"""A frozen agent: SIGSTOP the agent of one node (the job's leader, the harder case), not
its worker; SIGCONT it once the others train without it.

While frozen it renews nothing, so its lease lapses and the others go on at world 2 for
free (--max-restarts=0: a spent restart would end the job). Its worker is left alone in a
broken group: it either waits there (--broken-wait 60) or exits 1 at once (0) — the
latter is the trap: on waking, the agent finds a failed worker *and* a lost lease, and
must not report that failure to the job. After SIGCONT the node must not disturb the job
(no restart spent, no step of its old group after the survivors' new one began) and
rejoins it (scale-up to world 3).
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.fault.conftest import (
    FaultCluster,
    check_no_line_lost,
    check_steps_never_go_back,
    redone,
    step_pattern,
    steps_in,
)
from tests.support.elastic_cluster import pid_alive, run_id
from tests.support.helpers import wait_until
from tests.support.reliability_rows import Reliability

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize(
    ("backend", "worker"),
    [("c10d", "waits"), ("c10d", "exits"), pytest.param("etcd", "exits", marks=pytest.mark.etcd)],
)
def test_frozen_agent_is_lost_then_rejoins_without_disturbing_the_job(
    fault_cluster: FaultCluster, request: pytest.FixtureRequest, reliability: Reliability, backend: str, worker: str
) -> None:
    cluster = fault_cluster
    if backend == "c10d":
        endpoint = request.getfixturevalue("c10d_store")
    else:
        endpoint = request.getfixturevalue("etcd_server").endpoints[0]
    broken_wait = "60" if worker == "waits" else "0"
    common = dict(
        endpoint=endpoint, backend=backend, run_id=run_id(), nnodes="1:3", worker_args=("--broken-wait", broken_wait)
    )
    c = cluster.agent("c", local_addr="127.0.0.4", **common)
    c.wait_for(r"node \S+ leads job")
    a = cluster.agent("a", local_addr="127.0.0.2", **common)
    b = cluster.agent("b", local_addr="127.0.0.3", **common)
    three = {p.name: p.wait_for(step_pattern(3)) for p in (a, b, c)}
    c_worker = int(three["c"]["pid"])
    marks = {p.name: p.mark() for p in (a, b)}

    stopped_at = time.time()
    os.kill(c.pid, signal.SIGSTOP)
    try:
        two = {p.name: p.wait_for(step_pattern(2, restart=0), start=marks[p.name]) for p in (a, b)}
        for p in (a, b):  # a few steps of the new group while c is still frozen
            p.wait_for(step_pattern(2, round=two[p.name]["round"]), start=marks[p.name], count=5)
        if worker == "exits":  # its worker's collective broke: it is gone, its agent still frozen
            wait_until(lambda: not pid_alive(c_worker), what=f"c's worker {c_worker} to exit")
        first_two = min(
            row["t"] for p in (a, b) for row in steps_in(p.text()[marks[p.name]:]) if row["world"] == 2
        )
        # the leader that took over saw c go (c led the job: its key lapsed with its lease)
        assert any(re.search(rf"round \d+: lost \S+_{c.pid}\b", p.text()) for p in (a, b))
    finally:
        woke_at = time.time()
        os.kill(c.pid, signal.SIGCONT)
    marks = {p.name: p.mark() for p in (a, b, c)}

    lost = c.wait_for(r"lost its membership: (.*)$").group(1)
    # it froze, not the store: the line says so
    assert lost.startswith("this agent did not run for"), lost
    {p.name: p.wait_for(step_pattern(3, restart=0), start=marks[p.name]) for p in (a, b, c)}
    assert not pid_alive(c_worker)

    cluster.stop_training()
    for p in (a, b, c):
        code = p.wait_exit()
        assert code == 0, f"{p.name} exited {code}:\n{p.text()[-4000:]}"
    cluster.assert_no_orphans()

    rows = cluster.worker_steps()
    assert {row["restart"] for row in rows} == {0}, "a restart was spent"
    # no second group: c's old worker made no step once the survivors' group began
    late = [row for row in rows if row["pid"] == c_worker and row["t"] >= first_two]
    assert not late, f"c's old worker trained beside the new group: {late[:3]}"
    # one job: every round's steps were made by one group (one world size per round)
    worlds: dict[int, set[int]] = {}
    for row in rows:
        worlds.setdefault(row["round"], set()).add(row["world"])
    assert all(len(w) == 1 for w in worlds.values()), worlds
    for p in (a, b, c):
        assert "Traceback" not in p.text(), p.text()[-4000:]
    lines = check_no_line_lost(cluster)
    steps = check_steps_never_go_back(cluster)

    rejoined = min(row["t"] for row in rows if row["world"] == 3 and row["t"] > woke_at)
    reliability.record(
        scenario=f"frozen agent (SIGSTOP/SIGCONT, {backend}), its worker {worker}",
        injected=(
            f"SIGSTOP to the leader's agent (not its worker) for {woke_at - stopped_at:.1f} s; "
            f"--broken-wait {broken_wait}"
        ),
        happened=(
            f"others at world 2 after {first_two - stopped_at:.1f} s; on SIGCONT c found its lease lost, "
            f"stopped its old worker, rejoined: world 3 after {rejoined - woke_at:.1f} s; no restart spent"
        ),
        recovery_s=first_two - stopped_at,
        restarts=0,
        lost=f"{redone(steps['steps_redone_max'])}; 0 of {lines['lines']} log lines",
        **lines,
        **steps,
    )
