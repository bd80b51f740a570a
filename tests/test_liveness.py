"""A dead agent noticed in about a second, a stopped one judged by its lease.

The liveness port (elasticrun/rendezvous/liveness.py) on its own, then end to end with
real agents on both backends: with a lease TTL far longer than any wait of the test, a
SIGKILLed participant is found gone by its refused port and the survivors go on, a
SIGKILLed spare is found gone too (the leader looks at the nodes outside the round about
once a second), and so is a node that dies while waiting for the first round, which is
then formed without it, and a leader that dies then (the first waiting nodes look at it);
a SIGSTOPped agent (its kernel still accepts) is not removed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from elasticrun.rendezvous.liveness import LivenessPort, Verdict, probe
from tests.support.elastic_cluster import RDZV_CONF, Cluster, Rdzv
from tests.support.helpers import wait_until
from tests.test_elastic_agents import finish, kill_node, leader, node_id, start, step
from tests.test_spares import spares, status

pytestmark = pytest.mark.timeout(180)

#: a lease TTL no wait of these tests comes near: whatever happens, happens before it
LONG_TTL = "heartbeat_timeout=120,last_call_timeout=0.5,join_timeout=60"


async def test_a_listening_port_accepts_and_a_closed_one_refuses() -> None:
    port = await LivenessPort.open("127.0.0.1")
    assert port is not None
    assert await probe("127.0.0.1", port.port) is Verdict.LISTENING
    await port.close()
    assert await probe("127.0.0.1", port.port) is Verdict.GONE


async def test_a_stopped_process_still_accepts() -> None:
    code = (
        "import socket, sys, time\n"
        "s = socket.create_server(('127.0.0.1', 0)); print(s.getsockname()[1], flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGSTOP)
        assert await probe("127.0.0.1", port) is Verdict.LISTENING
        proc.kill()
        proc.wait()
        assert await probe("127.0.0.1", port) is Verdict.GONE
    finally:
        proc.kill()
        proc.wait()


def _conf(rdzv: Rdzv) -> str:
    return rdzv.conf.replace(RDZV_CONF, LONG_TTL)


@pytest.mark.parametrize("who", ["member", "leader"])
def test_a_killed_participant_is_found_gone_long_before_its_lease_ends(cluster: Cluster, rdzv: Rdzv, who: str) -> None:
    # the survivors' workers fail as their collective breaks (--broken-wait 0): the
    # leader checks every member, and the dead one's port refuses; a dead leader is
    # checked by the nodes whose workers failed, which end its lease
    crash = ("--broken-wait", "0")
    agents = [start(cluster, rdzv, n, i + 2, "2:3", conf=_conf(rdzv), worker_args=crash) for i, n in enumerate("abc")]
    before = {p.name: step(p, 3) for p in agents}
    boss = leader(agents)
    victim = boss if who == "leader" else next(p for p in agents if p is not boss)
    survivors = [p for p in agents if p is not victim]
    marks = {p.name: p.mark() for p in survivors}
    kill_node(victim, int(before[victim.name]["pid"]))

    for p in survivors:
        assert step(p, 2, start=marks[p.name])["restart"] == "0"  # a death is free
    if who == "member":
        assert re.search(rf"lost {node_id(victim)} \(agent gone: .* refused the liveness check\)", boss.text())
    else:
        assert any(re.search(rf"leader {node_id(victim)}: its liveness port refused", p.text()) for p in survivors)
    finish(cluster, *survivors)


def test_a_killed_spare_is_found_gone_long_before_its_lease_ends(cluster: Cluster, rdzv: Rdzv) -> None:
    # no restart request makes the leader look at a spare: it looks on its own
    members = [start(cluster, rdzv, n, i + 2, "2", conf=_conf(rdzv)) for i, n in enumerate("ab")]
    for p in members:
        step(p, 2)
    dead, live = (start(cluster, rdzv, n, i + 4, "2", conf=_conf(rdzv)) for i, n in enumerate(("dead", "live")))
    for p in (dead, live):
        p.wait_for(r"waiting: spare: ")
    assert sorted(spares(rdzv)) == sorted([node_id(dead), node_id(live)])

    dead.kill()

    def gone() -> list[dict] | None:
        """The `lost` events once the dead spare is no longer listed (the event follows the revoke)."""
        now = status(rdzv)
        listed = [n["node_id"] for n in now["nodes"] if n["spare"]]
        lost = [e for e in now["events"] if e["kind"] == "lost"]
        return lost if listed == [node_id(live)] and lost else None

    # within the wait, not the 120 s lease TTL: only the leader's look can end it
    lost = wait_until(gone, 30, "the dead spare's registration to end, with an event")
    assert [e["node"] for e in lost] == [node_id(dead)] and "liveness port refused" in lost[0]["detail"]
    boss = leader(members)
    boss.wait_for(rf"spare node {node_id(dead)}: its liveness port refused a connection")
    assert f"spare node {node_id(live)}" not in boss.text()
    finish(cluster, *members, live)


def test_a_node_killed_while_waiting_for_the_first_round_is_left_out_of_it(cluster: Cluster, rdzv: Rdzv) -> None:
    # no round runs yet, so no collective breaks: the leader looks at the waiting nodes
    waiting = [start(cluster, rdzv, n, i + 2, "3", conf=_conf(rdzv)) for i, n in enumerate("ab")]
    for p in waiting:
        p.wait_for(r"waiting for nodes: 2 of min 3 registered")
    boss = leader(waiting)
    dead = next(p for p in waiting if p is not boss)

    dead.kill()

    def gone() -> list[dict] | None:
        """The `lost` events once the dead node is no longer listed (the event follows the revoke)."""
        now = status(rdzv)
        lost = [e for e in now["events"] if e["kind"] == "lost"]
        return lost if [n["node_id"] for n in now["nodes"]] == [node_id(boss)] and lost else None

    # within the wait, not the 120 s lease TTL: only the leader's look can end it
    lost = wait_until(gone, 30, "the dead node's registration to end, with an event")
    assert [e["node"] for e in lost] == [node_id(dead)] and "liveness port refused" in lost[0]["detail"]
    boss.wait_for(rf"waiting node {node_id(dead)}: its liveness port refused a connection")

    # the first round is the live three's, and it runs: no restart, no loss
    nodes = [boss, *(start(cluster, rdzv, n, i + 4, "3", conf=_conf(rdzv)) for i, n in enumerate("cd"))]
    for p in nodes:
        step(p, 3, restart=0)
    assert re.search(r"round 1: ", boss.text()) and not re.search(r"round 2: ", boss.text())
    finish(cluster, *nodes)


def test_a_leader_killed_before_the_first_round_is_replaced_long_before_its_lease_ends(
    cluster: Cluster, rdzv: Rdzv
) -> None:
    # no member's collective breaks to make a node look: the first waiting nodes look
    waiting = [start(cluster, rdzv, n, i + 2, "3", conf=_conf(rdzv)) for i, n in enumerate("ab")]
    for p in waiting:
        p.wait_for(r"waiting for nodes: 2 of min 3 registered")
    dead = leader(waiting)
    heir = next(p for p in waiting if p is not dead)
    mark = heir.mark()

    dead.kill()

    # within the wait, not the 120 s lease TTL: only the waiting node's look can end it
    heir.wait_for(rf"leader {node_id(dead)}: its liveness port refused a connection", start=mark, timeout=30)
    heir.wait_for(rf"node {node_id(heir)} leads job", start=mark, timeout=30)
    nodes = [heir, *(start(cluster, rdzv, n, i + 4, "3", conf=_conf(rdzv)) for i, n in enumerate("cd"))]
    for p in nodes:
        step(p, 3, restart=0)
    assert not re.search(r"round 2: ", heir.text())
    finish(cluster, *nodes)


def test_a_stopped_agent_shorter_than_its_lease_is_not_removed(cluster: Cluster, rdzv: Rdzv) -> None:
    crash_dir = cluster.tmp / "crash"
    crash_dir.mkdir()
    args = ("--crash-dir", str(crash_dir))
    a = start(cluster, rdzv, "a", 2, "2", conf=_conf(rdzv), max_restarts=1, worker_args=args)
    a.wait_for(r"node \S+ leads job")
    b = start(cluster, rdzv, "b", 3, "2", conf=_conf(rdzv), max_restarts=1, worker_args=args)
    for p in (a, b):
        step(p, 2, restart=0)
    marks = {p.name: p.mark() for p in (a, b)}

    # b's agent stops (its worker runs on); a's worker fails: the leader checks b
    b.signal(signal.SIGSTOP)
    bad = crash_dir / node_id(a)
    bad.touch()
    checking = a.wait_for(r"checking that every node is alive \(no answer yet from ([^)]*)\)", start=marks["a"])
    assert node_id(a) not in checking.group(1)  # the leader deciding is alive: never waited for
    bad.unlink()
    b.signal(signal.SIGCONT)

    # b answers the ping: a worker failure with both nodes, not a loss
    for p in (a, b):
        step(p, 2, start=marks[p.name], restart=1)
    after = a.text()[marks["a"]:]
    assert re.search(r"round 2: restart after a worker failure", after), after
    assert f"lost {node_id(b)}" not in after
    finish(cluster, a, b)
