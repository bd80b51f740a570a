"""End-to-end elastic rendezvous: real agents (`python -m elasticrun`) as nodes on
127.0.0.x, real training workers (tests/workers/train_worker.py; their collective:
tests/workers/collective.py), a real store: a
standalone `elasticrun store serve` for c10d (so killing an agent never kills it) or
the session's etcd server, each scenario on both backends. The etcd cluster
scenarios (member, leader and majority loss) run against a 3-member etcd.

Every wait is for an event (a line in an agent's output, a process exit), bounded by a
deadline; every process is killed by PID at the end, and each test checks that none of
its agents or workers is left.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket

import pytest

from tests.support.elastic_cluster import RDZV_CONF, WORKER, Cluster, Proc, Rdzv, pid_alive, run_id
from tests.support.helpers import free_port, wait_until

pytestmark = pytest.mark.timeout(180)

#: one training step as the worker prints it, for a given world size
STEP = (
    r"step=(?P<step>\d+) rank=(?P<rank>\d+) world={world} group_rank=(?P<group_rank>\d+) "
    r"restart=(?P<restart>\d+) round=(?P<round>\d+) pid=(?P<pid>\d+)"
)


def start(cluster: Cluster, rdzv: Rdzv, name: str, addr: int, nnodes: str, **kw) -> Proc:
    kw.setdefault("conf", rdzv.conf)
    return cluster.agent(
        name,
        backend=rdzv.backend,
        endpoint=rdzv.endpoint,
        run_id=kw.pop("run_id", rdzv.run_id),
        local_addr=f"127.0.0.{addr}",
        nnodes=nnodes,
        **kw,
    )


def step(agent: Proc, world: int, *, start: int = 0, count: int = 1, **groups: object) -> re.Match[str]:
    """The `count`-th training step at `world` in `agent`'s output after `start`."""
    pattern = STEP.format(world=world)
    for key, value in groups.items():
        pattern = pattern.replace(rf"(?P<{key}>\d+)", rf"(?P<{key}>{value})")
    return agent.wait_for(pattern, start=start, count=count)


def finish(cluster: Cluster, *agents: Proc) -> None:
    """Tell the workers to stop; every agent exits 0; nothing of the test is left."""
    cluster.stop_training()
    for agent in agents:
        code = agent.wait_exit()
        assert code == 0, f"{agent.name} exited {code}:\n{agent.text()[-4000:]}"
    cluster.assert_no_orphans()


def node_id(agent: Proc) -> str:
    """The agent's node id (the launcher's default: host_pid)."""
    return f"{socket.gethostname()}_{agent.pid}"


def leader(agents: list[Proc]) -> Proc:
    """The agent that leads the job (the only one so far that logged taking the lead)."""
    leaders = [p for p in agents if re.search(r"node \S+ leads job", p.text())]
    assert len(leaders) == 1, [p.name for p in leaders]
    return leaders[0]


def kill_node(agent: Proc, worker_pid: int, *, worker_too: bool = True) -> None:
    """SIGKILL a node's agent and (by default) its worker, by PID; wait until both are gone.

    With worker_too=False only the agent is killed: its worker must die with it.
    """
    os.kill(agent.pid, signal.SIGKILL)
    if worker_too:
        try:
            os.kill(worker_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait_exit()
    wait_until(lambda: not pid_alive(worker_pid), what=f"worker {worker_pid} of {agent.name} to go")


# --- scale up ------------------------------------------------------------------------


def test_scale_up_two_to_three_keeps_node_ranks(cluster: Cluster, rdzv: Rdzv) -> None:
    a = start(cluster, rdzv, "a", 2, "2:3")
    b = start(cluster, rdzv, "b", 3, "2:3")
    before = {p.name: step(p, 2, restart=0) for p in (a, b)}
    assert sorted(m["group_rank"] for m in before.values()) == ["0", "1"]

    c = start(cluster, rdzv, "c", 4, "2:3")
    after = {p.name: step(p, 3) for p in (a, b, c)}
    for name in ("a", "b"):  # survivors keep their node ranks
        assert after[name]["group_rank"] == before[name]["group_rank"]
        assert int(after[name]["round"]) > int(before[name]["round"])
    assert after["c"]["group_rank"] == "2"  # the newcomer goes last
    assert {m["restart"] for m in after.values()} == {"0"}  # scale-up is not a failure
    finish(cluster, a, b, c)


# --- scenario 2: a node leaves on SIGTERM -------------------------------------------------


def test_sigterm_node_leaves_others_continue_without_spending_restarts(
    cluster: Cluster, rdzv: Rdzv
) -> None:
    agents = [start(cluster, rdzv, n, i + 2, "2:3", max_restarts=0) for i, n in enumerate("abc")]
    before = {p.name: step(p, 3) for p in agents}
    c = leader(agents)  # the harder case: the leader leaves, another takes over
    a, b = (p for p in agents if p is not c)
    marks = {p.name: p.mark() for p in (a, b)}

    c.signal(signal.SIGTERM)
    assert c.wait_exit() == 128 + signal.SIGTERM  # retryable for a scheduler: 143, not a training failure
    c.wait_for(r"worker got SIGTERM rank=\d+ world=3")  # its worker was told, not killed
    c.wait_for(r"leaving job .*received SIGTERM")

    after = {p.name: step(p, 2, start=marks[p.name]) for p in (a, b)}
    for m in after.values():
        assert m["restart"] == "0"  # membership restarts are free (--max-restarts=0)
    # survivors keep their order
    old = sorted((a.name, b.name), key=lambda n: int(before[n]["group_rank"]))
    assert [after[n]["group_rank"] for n in old] == ["0", "1"]
    finish(cluster, a, b)


# --- scenario 3: a node dies (SIGKILL) --------------------------------------------------


@pytest.mark.parametrize("on_broken_collective", ["wait", "crash"])
def test_sigkill_node_survivors_continue_after_lease_expiry(
    cluster: Cluster, rdzv: Rdzv, on_broken_collective: str
) -> None:
    # "crash": the survivors' workers exit 1 as soon as their collective breaks, long
    # before the dead node's lease expires; that must still not spend the budget (0).
    wait = "60" if on_broken_collective == "wait" else "0"
    agents = [
        start(cluster, rdzv, n, i + 2, "2:3", max_restarts=0, worker_args=("--broken-wait", wait))
        for i, n in enumerate("abc")
    ]
    before = {p.name: step(p, 3) for p in agents}
    c = leader(agents)  # the harder case: the leader dies; its key goes with its lease
    a, b = (p for p in agents if p is not c)
    dead = node_id(c)
    marks = {p.name: p.mark() for p in (a, b)}

    kill_node(c, int(before[c.name]["pid"]))

    for p in (a, b):
        m = step(p, 2, start=marks[p.name])
        assert m["restart"] == "0"
    # the leader (or the one that took over from the dead one) saw the node go
    assert any(re.search(rf"round \d+: lost {dead}", p.text()) for p in (a, b))
    finish(cluster, a, b)


# --- scenario 4: fixed size, a node is replaced -------------------------------------------


def test_fixed_size_waits_for_a_replacement(cluster: Cluster, rdzv: Rdzv) -> None:
    first = [start(cluster, rdzv, "a", 2, "2"), start(cluster, rdzv, "b", 3, "2")]
    for p in first:
        step(p, 2)
    a = leader(first)
    b = next(p for p in first if p is not a)
    before = step(b, 2)
    mark = a.mark()

    # only b's agent is killed: its worker must not outlive it
    kill_node(b, int(before["pid"]), worker_too=False)
    # the survivor stops its workers and waits for a second node
    stopped = a.wait_for(r"workers healthy -> stopped", start=mark).end()
    a.wait_for(r"waiting for nodes: 1 of min 2 registered \(max 2\)", start=stopped)
    assert re.search(STEP.format(world=1), a.text()) is None

    c = start(cluster, rdzv, "c", 4, "2")
    resumed = [step(p, 2, start=stopped if p is a else 0, restart=0) for p in (a, c)]
    assert resumed[0]["round"] == resumed[1]["round"] != before["round"]
    finish(cluster, a, c)


# --- scenario 5: a worker failure within the budget ----------------------------------------


def test_worker_failure_restarts_the_group_once(cluster: Cluster, rdzv: Rdzv) -> None:
    marker = cluster.tmp / "failed-once"
    fail = ["--fail-rank", "1", "--fail-step", "3", "--fail-marker", str(marker)]
    a = start(cluster, rdzv, "a", 2, "2", max_restarts=1, worker_args=fail)
    b = start(cluster, rdzv, "b", 3, "2", max_restarts=1, worker_args=fail)
    for p in (a, b):  # every node restarts its workers, and the count is 1 everywhere
        step(p, 2, restart=1, count=3)
    assert marker.exists()
    assert "injected failure at step 3" in a.text() + b.text()
    finish(cluster, a, b)


# --- scenario 6: the budget runs out ------------------------------------------------------


def test_budget_exhausted_every_agent_fails_with_the_root_cause(cluster: Cluster, rdzv: Rdzv) -> None:
    fail = ["--fail-rank", "1", "--fail-step", "2"]
    a = start(cluster, rdzv, "a", 2, "2", max_restarts=1, worker_args=fail)
    b = start(cluster, rdzv, "b", 3, "2", max_restarts=1, worker_args=fail)
    for p in (a, b):
        code = p.wait_exit()
        assert code != 0, f"{p.name} exited 0:\n{p.text()[-4000:]}"
        text = p.text()
        assert re.search(r"rank\s*: 1 \(local rank 0\)", text), text[-4000:]
        assert "exit      : exit code 1" in text, text[-4000:]
        assert "RuntimeError: injected failure at step 2" in text, text[-4000:]
    cluster.assert_no_orphans()


# --- scenario 7: a closed rendezvous, and jobs sharing one store -------------------------


async def _end_closed_window(rdzv: Rdzv, run_id: str) -> None:
    """End the closed job's window now, as its closed_ttl would: revoke the lease its
    round record is bound to, and wait for the record to go.

    The test sets the window's end itself: with a short closed_ttl instead, a late agent
    that is slow to start (a loaded machine) would miss the window and start a new job.
    """
    from elasticrun.rendezvous.keys import Keys
    from elasticrun.store.interface import EventType

    if rdzv.backend == "etcd":
        from elasticrun.store.settings import open_client, parse_access

        store = open_client(parse_access("etcd", rdzv.endpoint, {"store_timeout": "10"}, {}))
    else:
        from elasticrun.store.client.grpc_store import GrpcStore

        store = GrpcStore(rdzv.endpoint, timeout=10)
    try:
        key = Keys(run_id).round
        kv = await store.get(key)
        assert kv is not None and kv.lease, f"the closed round record should be bound to a lease: {kv}"
        async with asyncio.timeout(30):
            watch = store.watch(key, start_revision=kv.mod_revision + 1)
            await store.revoke_lease(kv.lease)
            async for event in watch:
                if event.type is EventType.DELETE:
                    break
    finally:
        await store.close()


def test_closed_rendezvous_then_fresh_job_and_two_jobs_on_one_store(cluster: Cluster, rdzv: Rdzv) -> None:
    conf = rdzv.conf + ",closed_ttl=600"
    first = start(cluster, rdzv, "first", 2, "1", conf=conf, worker_args=["--steps", "3"])
    assert first.wait_exit() == 0
    first.wait_for(r"closed \(succeeded\)")

    late = start(cluster, rdzv, "late", 3, "1", conf=conf)
    assert late.wait_exit() == 0, late.text()  # as the job ended: a requeued node of it is no failure
    late.wait_for(
        r"WARNING .*workers init -> stopped: job '" + re.escape(rdzv.run_id) + r"' ended \d+s ago \(succeeded: .*\), "
        r"before this node started: this node ran nothing\. The id stays taken for closed_ttl=600s"
    )
    assert "worker started" not in late.text()

    asyncio.run(_end_closed_window(rdzv, rdzv.run_id))
    again = start(cluster, rdzv, "again", 2, "1", conf=conf)
    other = start(cluster, rdzv, "other", 3, "1", conf=conf, run_id=run_id())
    for p in (again, other):  # both jobs train at the same time on one store
        m = step(p, 1, count=2)
        assert m["round"] == "1" and m["restart"] == "0"  # a clean start
    finish(cluster, again, other)


def test_a_rerun_of_the_default_id_says_the_job_ended_and_this_node_ran_nothing(
    cluster: Cluster, c10d_store: str
) -> None:
    """torchrun users run one command twice; without --rdzv-id both runs are job 'none'."""
    kw = dict(backend="c10d", endpoint=c10d_store, run_id="none", nnodes="1", conf=RDZV_CONF + ",is_host=false")
    default_id = "the job id is 'none', the default: every job on this store without --rdzv-id shares it"
    first = cluster.agent("first", local_addr="127.0.0.2", worker_args=["--steps", "1"], **kw)
    assert first.wait_exit() == 0, first.text()
    assert first.text().count(default_id) == 1, first.text()
    again = cluster.agent("again", local_addr="127.0.0.3", **kw)
    assert again.wait_exit() == 0, again.text()  # the exit code of the ended job, which succeeded
    again.wait_for(r"job 'none' ended \d+s ago \(succeeded: .*\), before this node started: this node ran nothing")
    assert default_id in again.text() and "worker started" not in again.text()


def test_a_script_that_differs_in_content_is_named_and_the_job_runs(cluster: Cluster, c10d_store: str) -> None:
    """Code sits at different paths on different nodes, and one node's copy may be stale:
    the path never matters, the content is said (once per node, as a warning), and the
    job runs, since a debug print is no reason to refuse a node."""
    workers = WORKER.parent
    same, edited = cluster.tmp / "same", cluster.tmp / "edited"
    for folder in (same, edited):
        folder.mkdir()
        for name in ("train_worker.py", "collective.py", "worker_tag.py"):
            shutil.copy(workers / name, folder / name)
    (edited / "train_worker.py").write_text((workers / "train_worker.py").read_text() + "# a stale copy\n")
    rdzv = Rdzv("c10d", c10d_store, RDZV_CONF + ",is_host=false", run_id())
    a = start(cluster, rdzv, "a", 2, "3")
    a.wait_for(r"waiting: registered")  # a's spec is the job's
    b = start(cluster, rdzv, "b", 3, "3", worker=same / "train_worker.py")
    c = start(cluster, rdzv, "c", 4, "3", worker=edited / "train_worker.py")
    for p in (a, b, c):
        step(p, 3)
    differs = r"this node's train_worker\.py differs in content from the one the job's first node read"
    c.wait_for(r"WARNING .*" + differs + r" \(sha256 [0-9a-f]{12} here, [0-9a-f]{12} there\): "
               r"the nodes may train different code")
    assert not re.search(differs, a.text() + b.text())
    finish(cluster, a, b, c)


# --- scenario 8: what a lone node waits for ---------------------------------------------


def test_lone_node_says_what_it_waits_for_and_times_out(cluster: Cluster, rdzv: Rdzv) -> None:
    conf = rdzv.conf.replace("join_timeout=60", "join_timeout=3")
    a = start(cluster, rdzv, "a", 2, "2:3", conf=conf)
    a.wait_for(r"waiting for nodes: 1 of min 2 registered \(max 3\)")
    code = a.wait_exit()
    assert code != 0
    a.wait_for(r"join_timeout=3s.*waiting for nodes: 1 of min 2 registered \(max 3\)")
    assert "Traceback" not in a.text()
    assert "worker started" not in a.text()
    cluster.assert_no_orphans()


# --- c10d: an agent hosts the store itself ----------------------------------------------


def test_c10d_agent_hosts_the_store(cluster: Cluster) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv = Rdzv("c10d", endpoint, RDZV_CONF, run_id())
    host = start(cluster, rdzv, "host", 2, "2", conf=RDZV_CONF + ",is_host=true")
    said = host.wait_for(r"hosting the rendezvous store on 127\.0\.0\.1:\d+.*$").group(0)
    # in the same line: a job of two nodes cannot fail over, what that means, and what instead
    for words in ("cannot fail over", "exits 200", "elasticrun store serve", "etcd"):
        assert words in said, said
    guest = start(cluster, rdzv, "guest", 3, "2", conf=RDZV_CONF + ",is_host=false")
    for p in (host, guest):
        step(p, 2)
    assert "hosting the rendezvous store" not in guest.text()
    finish(cluster, host, guest)


# --- the agents' etcd cluster loses members -------------------------------------------

#: the member test's heartbeat timeout: etcd fails over well within it
TRIO_HEARTBEAT = 3
#: training steps to wait for after a change: with 0.1 s per step, longer than
#: TRIO_HEARTBEAT, so a lease that was not renewed meanwhile would have expired
STEPS_AFTER = 35


def _trio_rdzv(etcd_trio, conf: str = RDZV_CONF) -> Rdzv:
    return Rdzv("etcd", ",".join(etcd_trio.endpoints), conf, run_id())


def test_etcd_member_then_leader_loss_keeps_the_workers_running(cluster: Cluster, etcd_trio) -> None:
    rdzv = _trio_rdzv(etcd_trio, RDZV_CONF.replace("heartbeat_timeout=2", f"heartbeat_timeout={TRIO_HEARTBEAT}"))
    assert f"heartbeat_timeout={TRIO_HEARTBEAT}" in rdzv.conf
    a = start(cluster, rdzv, "a", 2, "2")
    b = start(cluster, rdzv, "b", 3, "2")
    first = {p.name: step(p, 2) for p in (a, b)}

    def still_training(mark: dict[str, int]) -> None:
        for p in (a, b):
            m = first[p.name]
            step(p, 2, start=mark[p.name], count=STEPS_AFTER, pid=m["pid"], round=m["round"])

    # the member every agent talks to first (endpoint 0) goes away
    mark = {p.name: p.mark() for p in (a, b)}
    etcd_trio.stop_member(0)
    still_training(mark)
    etcd_trio.start_member(0)

    # then the raft leader (whichever member that is now)
    mark = {p.name: p.mark() for p in (a, b)}
    etcd_trio.stop_member(etcd_trio.leader_index())
    still_training(mark)

    for p in (a, b):
        text = p.text()
        assert "healthy -> stopped" not in text, text[-4000:]
        assert "lost its membership" not in text, text[-4000:]
        assert len(set(re.findall(r"worker started .* pid=(\d+)", text))) == 1
    finish(cluster, a, b)


def test_etcd_majority_loss_agents_fail_clearly(cluster: Cluster, etcd_trio) -> None:
    rdzv = _trio_rdzv(etcd_trio, RDZV_CONF + ",store_timeout=3")
    a = start(cluster, rdzv, "a", 2, "2")
    b = start(cluster, rdzv, "b", 3, "2")
    for p in (a, b):
        step(p, 2)

    raft_leader = etcd_trio.leader_index()
    etcd_trio.stop_member(raft_leader)
    etcd_trio.stop_member((raft_leader + 1) % 3)
    for p in (a, b):
        code = p.wait_exit()
        text = p.text()
        assert code != 0, text[-4000:]
        assert re.search(r"lost its membership: .*store did not renew its lease", text), text[-4000:]
        assert "elasticrun: error:" in text, text[-4000:]
        assert "Traceback" not in text, text[-4000:]
    cluster.assert_no_orphans()


def test_etcd_brief_majority_loss_leader_still_decides(cluster: Cluster, etcd_trio) -> None:
    """The leader's watch breaks while etcd has no quorum; once it is back, the leader
    must still decide rounds (here: admit a third node), not sit dead on its key."""
    conf = "heartbeat_timeout=8,last_call_timeout=0.5,join_timeout=60,store_timeout=1"
    rdzv = _trio_rdzv(etcd_trio, conf)
    a = start(cluster, rdzv, "a", 2, "2:3")
    b = start(cluster, rdzv, "b", 3, "2:3")
    for p in (a, b):
        step(p, 2)
    lead = leader([a, b])
    mark = lead.mark()

    stopped = [etcd_trio.leader_index()]
    stopped.append((stopped[0] + 1) % 3)
    for i in stopped:
        etcd_trio.stop_member(i)
    lead.wait_for(r"leader of job '[^']+': store call failed", start=mark)
    for i in stopped:
        etcd_trio.start_member(i)

    c = start(cluster, rdzv, "c", 4, "2:3", conf=conf)
    for p in (a, b, c):
        step(p, 3, restart=0)
    finish(cluster, a, b, c)
