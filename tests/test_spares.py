"""End to end: spares and node units, with real agents as nodes on 127.0.0.x,
real training workers (tests/workers/collective.py) and a real store (both backends).

A spare is a registered agent that no round takes (the job runs at MAX, or the nodes
are not a whole number of units): it waits, `elasticrun status` shows it as a spare,
and it takes the place of a participant that goes, for free.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support.elastic_cluster import Cluster, Rdzv
from tests.support.helpers import ELASTICRUN, wait_until
from tests.test_elastic_agents import finish, kill_node, node_id, start, step

pytestmark = pytest.mark.timeout(240)


def status(rdzv: Rdzv) -> dict:
    """`elasticrun status --json` of the test's job."""
    argv = [
        *ELASTICRUN, "status", "--json",
        f"--rdzv-backend={rdzv.backend}", f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.run_id}",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def spares(rdzv: Rdzv) -> list[str]:
    return [n["node_id"] for n in status(rdzv)["nodes"] if n["spare"]]


def test_fixed_size_a_spare_steps_in_for_a_killed_participant(cluster: Cluster, rdzv: Rdzv) -> None:
    agents = [start(cluster, rdzv, n, i + 2, "3") for i, n in enumerate("abc")]
    before = {p.name: step(p, 3, restart=0) for p in agents}
    spare = start(cluster, rdzv, "spare", 5, "3")
    spare.wait_for(r"waiting: spare: ")
    later = start(cluster, rdzv, "later", 6, "3")  # a second spare, registered after the first
    later.wait_for(r"waiting: spare: ")
    assert sorted(spares(rdzv)) == sorted([node_id(spare), node_id(later)])

    victim = next(p for p in agents if before[p.name]["group_rank"] == "1")
    survivors = [p for p in agents if p is not victim]
    marks = {p.name: p.mark() for p in survivors}
    kill_node(victim, int(before[victim.name]["pid"]))

    # a step of the round after the loss: a survivor may still print one of the old
    # round after the mark, before its agent sees the loss
    later_round = rf"(?!{before[survivors[0].name]['round']}\b)\d+"
    after = {p.name: step(p, 3, start=marks.get(p.name, 0), round=later_round) for p in (*survivors, spare)}
    assert {m["restart"] for m in after.values()} == {"0"}  # --max-restarts=0: nothing spent
    # the survivors keep their order; the first spare comes in
    assert sorted(m["group_rank"] for m in after.values()) == ["0", "1", "2"]
    assert spares(rdzv) == [node_id(later)]

    # a spare is drained like any node: it leaves, exits 0, and the job runs on
    drain = subprocess.run(
        [*ELASTICRUN, "drain", "--node", node_id(later), "--timeout", "30",
         f"--rdzv-backend={rdzv.backend}", f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.run_id}"],
        capture_output=True, text=True, timeout=60,
    )
    assert drain.returncode == 0, drain.stderr
    assert later.wait_exit() == 0
    assert spares(rdzv) == []
    finish(cluster, *survivors, spare)


def test_node_units_run_whole_units_and_shrink_to_the_lower_multiple(cluster: Cluster, rdzv: Rdzv) -> None:
    unit = ("--node-unit=2",)
    running = [start(cluster, rdzv, n, i + 2, "2:6", extra=unit) for i, n in enumerate("abcd")]
    for p in running:
        step(p, 4)
    # a fifth agent: not a whole unit, so a spare, and the round of four goes on
    spare = start(cluster, rdzv, "e", 6, "2:6", extra=unit)
    spare.wait_for(r"waiting: spare: ")
    assert spares(rdzv) == [node_id(spare)]
    before = {p.name: step(p, 4, start=p.mark()) for p in running}

    # one node lost: the spare takes its place, four again
    victim = running.pop(0)
    marks = {p.name: p.mark() for p in running}
    kill_node(victim, int(before[victim.name]["pid"]))
    running.append(spare)
    later_round = rf"(?!{before[running[0].name]['round']}\b)\d+"  # not a late step of the old round
    after = {p.name: step(p, 4, start=marks.get(p.name, 0), round=later_round) for p in running}
    assert sorted(m["group_rank"] for m in after.values()) == ["0", "1", "2", "3"]
    assert {m["restart"] for m in after.values()} == {"0"}

    # two more lost, no spare left: a round of two, a whole unit
    marks = {p.name: p.mark() for p in running}
    for victim in running[:2]:
        kill_node(victim, int(after[victim.name]["pid"]))
    left = running[2:]
    for p in left:
        step(p, 2, start=marks[p.name])
    # The leader may form the round of two once it has found the first victim dead,
    # with the second still registered beside it: a spare, dead, until the leader's
    # look at the spares finds its port closed (or its lease lapses). Then none.
    wait_until(lambda: spares(rdzv) == [], 30, "the dead nodes' registrations to end")
    finish(cluster, *left)


def test_node_unit_mismatch_is_refused(cluster: Cluster, rdzv: Rdzv) -> None:
    a = start(cluster, rdzv, "a", 2, "2:4", extra=("--node-unit=2",))
    a.wait_for(r"waiting for nodes")
    b = start(cluster, rdzv, "b", 3, "2:4")
    assert b.wait_exit() == 2
    assert "node_unit: job has 2, this node 1" in b.text()
    a.kill()


def test_node_unit_must_divide_nnodes(cluster: Cluster) -> None:
    p = cluster.agent(
        "a", backend="c10d", endpoint="127.0.0.1:1", run_id="units", local_addr="127.0.0.2", nnodes="3:6",
        extra=("--node-unit=2",),
    )
    assert p.wait_exit() == 2
    assert "MIN and MAX must be multiples of --node-unit=2" in p.text()


def test_a_spare_waits_as_long_as_the_job_runs(cluster: Cluster, rdzv: Rdzv) -> None:
    """A spare of a job at its maximum outlives join_timeout (1 s here): it is there for failover."""
    conf = rdzv.conf.replace("join_timeout=60", "join_timeout=1")
    a = start(cluster, rdzv, "a", 2, "1", conf=conf)
    step(a, 1)
    spare = start(cluster, rdzv, "spare", 3, "1", conf=conf)
    said = spare.wait_for(r"waiting: spare: .*max 1 reached.*")
    # the same wait is said again every few seconds while nothing changes: past join_timeout
    again = spare.wait_for(r"waiting: spare: .*", start=said.end())
    assert "join_timeout" not in again.group(0), again.group(0)
    assert spares(rdzv) == [node_id(spare)]
    finish(cluster, a, spare)
