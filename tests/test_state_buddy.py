"""Every shard on two nodes: a node's commits are kept by its buddy, and a spare resumes them.

End to end with real agents as nodes on 127.0.0.x, a real store (the built-in one;
the spare's case on etcd too: the replica posts go through either), and gloo workers
(tests/workers/state_worker.py, a ShardedState): each agent copies its workers' commits
to the next node of the round (elasticrun.agent.state_replicas); a node SIGKILLed in a
fixed-size job is replaced by a spare that takes its node rank, and the spare's worker
resumes the lost rank's shard from the buddy, exactly as it was; the commits it fetched
go on to its own buddies with no new commit made, so a shard outlives the nodes that
held it lost one at a time; a node lost with its buddy is said plainly, and no rank
restores (the script's own path runs); what is not an agent of the job is refused at
the replica port, and the job goes on.

The workers hold after commit HOLD (every rank, once): the test acts while every node's
newest commit is HOLD, so that what must be restored is known.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from elasticrun.agent.replica_wire import MAC, MAGIC, NONCE, job_key
from tests.support.elastic_cluster import RDZV_CONF, Cluster, Proc, Rdzv, run_id
from tests.support.helpers import ELASTICRUN, wait_until
from tests.test_elastic_agents import kill_node, node_id
from tests.test_state_restart import BEGIN

pytestmark = pytest.mark.timeout(240)

WORKER = Path(__file__).resolve().parent / "workers" / "state_worker.py"
HOLD = 5
STEPS = HOLD + 3


class Job:
    """One job's agents (`nproc` workers each), meeting at `rdzv`."""

    def __init__(self, cluster: Cluster, rdzv: Rdzv, nnodes: int, nproc: int = 1, *worker_args: str) -> None:
        """`worker_args`: added to the worker's."""
        self.cluster, self.rdzv, self.nnodes, self.nproc = cluster, rdzv, nnodes, nproc
        self.worker_args = worker_args
        self.where = (f"--rdzv-backend={rdzv.backend}", f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.run_id}")

    def agent(self, name: str, addr: int) -> Proc:
        return self.cluster.launch(
            name, f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc}", *self.where,
            f"--rdzv-conf={self.rdzv.conf}",
            f"--local-addr=127.0.0.{addr}", "--max-restarts=0", "--shutdown-timeout=5", "--state-memory=64M",
            f"--log-dir={self.cluster.tmp / 'logs'}", str(WORKER), "--kind=sharded", f"--steps={STEPS}",
            f"--hold-at={HOLD}", f"--hold-file={self.cluster.tmp / 'held'}", "--numel=4096", *self.worker_args,
        )

    def status(self) -> dict[str, dict]:
        """Each node's status (`elasticrun status --json`), by node id."""
        done = subprocess.run(
            [*ELASTICRUN, "status", "--json", *self.where],
            capture_output=True, text=True, timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return {n["node_id"]: n for n in json.loads(done.stdout)["nodes"]}

    def replicated(self, agents: list[Proc], commit: int) -> None:
        """Wait until each of `agents` holds commit `commit` and its buddy holds it too."""
        def done() -> bool:
            nodes = self.status()
            statuses = [(nodes.get(node_id(a)) or {}).get("status") or {} for a in agents]
            return all((s.get("state_held"), s.get("state_replicated")) == (commit, commit) for s in statuses)
        wait_until(done, what=f"every node's commit {commit} held and replicated")


def c10d(endpoint: str) -> Rdzv:
    """A job of its own on the module's store server."""
    return Rdzv("c10d", endpoint, f"{RDZV_CONF},is_host=false", run_id())


def holding(agents: list[Proc], nproc: int = 1) -> dict[str, int]:
    """Wait until every rank holds after commit HOLD; a worker pid of each agent."""
    pids = {}
    for agent in agents:
        m = agent.wait_for(r"begin rank=(\d+) restart=0 restored=False from=nothing step=0 .* pid=(\d+)")
        pids[agent.name] = int(m[2])
        agent.wait_for(rf"holding at step={HOLD} rank=", count=nproc)
    return pids


def ranks_of(agent: Proc) -> list[int]:
    """The global ranks of the agent's first workers."""
    return sorted(int(r) for r in re.findall(r"holding at step=\d+ rank=(\d+)", agent.text()))


def resumed(agent: Proc, start: int, count: int = 1) -> dict[int, re.Match[str]]:
    """The workers' `begin` lines after `start` in `agent`'s output, by rank."""
    agent.wait_for(r"begin rank=", start=start, count=count)
    return {int(m["rank"]): m for m in BEGIN.finditer(agent.text()[start:])}


def how(begin: re.Match[str]) -> tuple[str, ...]:
    """A `begin` line's restored, source, step and intact."""
    return begin["restored"], begin["source"], begin["step"], begin["intact"]


def digest(agent: Proc, rank: int, step: int) -> str:
    found = re.findall(rf"step={step} rank={rank} digest=(\w+)", agent.text())
    assert found, (agent.name, rank, step)
    return found[0]


def replica_port(agent: Proc) -> int:
    return int(agent.wait_for(r"state replicas: this node takes its predecessor's commits on [\d.]+:(\d+)")[1])


@pytest.mark.slow  # the buddy's copy restored in the README's command: tests/test_state_reshard.py
def test_a_spare_resumes_a_lost_nodes_shards_from_its_buddy(cluster: Cluster, rdzv: Rdzv) -> None:
    """Nodes a and b run a fixed-size job of two, two workers each; s waits as a spare. b
    is SIGKILLed while all hold after commit HOLD (held by each node and by its buddy):
    s takes b's node rank, and its workers resume b's shards at commit HOLD from a,
    exactly as b held them (restored_from "buddy"), while a's resume their own; all
    train to the end. Meanwhile, connections to a's replica port that are not the job's
    are refused with one line each, and harm nothing."""
    job = Job(cluster, rdzv, 2, nproc=2)
    a, b = job.agent("a", 2), job.agent("b", 3)
    pids = holding([a, b], nproc=2)
    spare = job.agent("s", 4)
    spare.wait_for(r"waiting: spare: ")
    job.replicated([a, b], HOLD)
    ranks_of_b = ranks_of(b)

    port = replica_port(a)
    with socket.create_connection(("127.0.0.2", port), timeout=10) as rogue:  # not our protocol
        rogue.recv(len(MAGIC) + NONCE)
        rogue.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(64))
        assert rogue.recv(1) == b""  # closed on us
    a.wait_for(r"refused a connection to the replica port from .*: not an elasticrun replica client")
    with socket.create_connection(("127.0.0.2", port), timeout=10) as other:  # another job's key
        hello = other.recv(len(MAGIC) + NONCE)
        assert hello.startswith(MAGIC)
        nc = bytes(NONCE)
        proof = hmac.new(job_key("another-job", None), b"c" + hello[len(MAGIC):] + nc, hashlib.sha256).digest()
        other.sendall(MAGIC + nc + proof + b"G" + bytes(8))
        assert other.recv(MAC) == b""
    a.wait_for(r"refused a connection to the replica port from .*: the client did not prove it belongs to the job")

    marks = {p.name: p.mark() for p in (a, spare)}
    kill_node(b, pids["b"])
    mine, theirs = resumed(a, marks["a"], 2), resumed(spare, marks["s"], 2)
    assert sorted(theirs) == ranks_of_b and sorted(mine) == ranks_of(a)
    for rank, m in theirs.items():
        assert (m["restored"], m["source"], m["step"], m["intact"]) == ("True", "buddy", str(HOLD), "True"), m[0]
        assert m["digest"] == digest(b, rank, HOLD)  # model and optimizer too
        spare.wait_for(rf"rank {rank}'s state comes from its buddy node {re.escape(node_id(a))}: commit {HOLD}")
    for m in mine.values():
        assert (m["restored"], m["source"], m["step"], m["intact"]) == ("True", "own memory", str(HOLD), "True"), m[0]
    for agent in (a, spare):
        assert agent.wait_exit() == 0, agent.text()[-4000:]
    cluster.assert_no_orphans()


@pytest.mark.slow  # the pins run in the README's command too: tests/test_state_reshard.py's ShardedState jobs
def test_a_node_lost_while_commits_outpace_the_copies_resumes_at_a_commit_every_rank_holds(
    cluster: Cluster, c10d_store: str
) -> None:
    """Nodes a and b (a fixed-size job of two, one worker each) commit every step of 50 ms,
    ten times each look an agent takes to copy them, and train on; s waits as a spare. b
    is SIGKILLed mid-run. Had each agent copied its newest commit, b's buddy would hold a
    commit a no longer holds; the ranks agreed on what their buddies hold
    (elasticrun.worker.elastic.buddy_pins), so s's worker resumes b's shard from a's copy
    and a's worker its own, at one step, exactly as b held it."""
    job = Job(cluster, c10d(c10d_store), 2, 1, "--hold-at=0", "--steps=240", "--pace=0.05")
    a, b = job.agent("a", 2), job.agent("b", 3)
    for agent in (a, b):
        agent.wait_for(r"begin rank=\d+ restart=0 ")
    spare = job.agent("s", 4)
    spare.wait_for(r"waiting: spare: ")
    begun = BEGIN.search(b.text())
    assert begun is not None, b.text()[-4000:]
    rank_of_b, worker_of_b = int(begun["rank"]), int(begun["pid"])
    b.wait_for(rf"step=60 rank={rank_of_b} ")
    marks = {p.name: p.mark() for p in (a, spare)}
    kill_node(b, worker_of_b)
    (mine,), (theirs,) = resumed(a, marks["a"]).values(), resumed(spare, marks["s"]).values()
    assert int(theirs["rank"]) == rank_of_b
    assert how(mine)[:2] == ("True", "own memory") and how(mine)[3] == "True", mine[0]
    assert how(theirs) == ("True", "buddy", mine["step"], "True"), theirs[0]
    assert int(mine["step"]) > 0
    assert theirs["digest"] == digest(b, rank_of_b, int(mine["step"]))  # model and optimizer too
    for agent in (a, spare):
        assert agent.wait_exit() == 0, agent.text()[-4000:]
    cluster.assert_no_orphans()


@pytest.mark.slow  # the same loss at a new world size: tests/test_state_reshard.py, in a quarter of the time
def test_a_node_lost_with_its_buddy_is_said_and_nobody_restores(cluster: Cluster, c10d_store: str) -> None:
    """Nodes a, b, c (a ring: b keeps a's commits, c b's, a c's) with spares d and e. b
    and c are SIGKILLed at once: b's commits were only on b and c. The spares take their
    node ranks; d (in b's place) says that rank's state is nowhere; no rank restores
    (shards of one step or none: state.restored False on every rank, the script's own
    path), and the job trains to the end from its start."""
    job = Job(cluster, c10d(c10d_store), 3)
    a, b, c = job.agent("a", 2), job.agent("b", 3), job.agent("c", 4)
    pids = holding([a, b, c])
    d = job.agent("d", 5)
    d.wait_for(r"waiting: spare: ")
    e = job.agent("e", 6)
    e.wait_for(r"waiting: spare: ")
    job.replicated([a, b, c], HOLD)
    ranks = {p.name: ranks_of(p)[0] for p in (a, b, c)}
    # a node and its buddy: the node at rank r, and the one after it
    first = next(p for p in (a, b, c) if ranks[p.name] == (ranks["a"] + 1) % 3)
    second = next(p for p in (a, b, c) if ranks[p.name] == (ranks["a"] + 2) % 3)
    marks = {p.name: p.mark() for p in (a, d, e)}
    kill_node(first, pids[first.name])
    kill_node(second, pids[second.name])
    lost = ranks[first.name]
    begins = {p.name: next(iter(resumed(p, marks[p.name]).values())) for p in (a, d, e)}
    assert {m["restored"] for m in begins.values()} == {"False"}, [m[0] for m in begins.values()]
    assert {m["step"] for m in begins.values()} == {"0"}
    nowhere = rf"the state of ranks {lost} \(node rank {lost}\) is nowhere: neither this node nor its buddy node"
    spare_in_first = next(p for p in (d, e) if begins[p.name]["rank"] == str(lost))
    spare_in_first.wait_for(nowhere)
    for agent in (a, d, e):
        assert agent.wait_exit() == 0, agent.text()[-4000:]
    cluster.assert_no_orphans()


@pytest.mark.slow  # three nodes lost one after another; the spare test above covers one
def test_a_fetched_commit_goes_on_to_the_next_buddy_with_no_commit_made(cluster: Cluster, c10d_store: str) -> None:
    """A ring of three nodes (one worker each: node rank = rank), spares joining one at a
    time, and no rank committing after HOLD: every worker that restored waits (--wait-go),
    and each step needs every rank. Rank 1's commit HOLD, made on x, travels on: x is
    SIGKILLed and s, in its place, fetches it from y (its buddy), and s's agent holds it
    copied at once (status: COMMIT/COPIED HOLD/HOLD); y is SIGKILLed and t takes its place,
    s's new buddy, to which s's agent sends the commit it fetched (HOLD/HOLD again: s's
    workers still made none); s is SIGKILLed and u, in its place, fetches rank 1's shard
    from t, exactly as x committed it. Three nodes that held it lost, one at a time, and
    the shard is whole; then the job trains to the end."""
    job = Job(cluster, c10d(c10d_store), 3, 1, "--wait-go")
    first = [job.agent(name, addr) for name, addr in (("p", 2), ("q", 3), ("r", 4))]
    pids = holding(first)
    node = {ranks_of(p)[0]: p for p in first}  # with one worker a node, its node rank is its rank
    z, x, y = node[0], node[1], node[2]
    job.replicated([z, x, y], HOLD)
    committed = digest(x, 1, HOLD)

    def replace(lost: Proc, worker_pid: int, name: str, addr: int, stay: list[Proc]) -> tuple[Proc, dict]:
        """A spare `name` waits, `lost` is SIGKILLed: the spare's and `stay`'s `begin` lines, by agent name."""
        spare = job.agent(name, addr)
        spare.wait_for(r"waiting: spare: ")
        marks = {p.name: p.mark() for p in (*stay, spare)}
        kill_node(lost, worker_pid)
        begins = {p.name: next(iter(resumed(p, marks[p.name]).values())) for p in (*stay, spare)}
        for m in (begins[p.name] for p in stay):
            assert how(m) == ("True", "own memory", str(HOLD), "True"), m[0]
        return spare, begins

    s, begins = replace(x, pids[x.name], "s", 5, [z, y])
    assert (begins["s"]["rank"], how(begins["s"])) == ("1", ("True", "buddy", str(HOLD), "True")), begins["s"][0]
    assert begins["s"]["digest"] == committed
    job.replicated([z, y, s], HOLD)

    t, begins = replace(y, pids[y.name], "t", 6, [z, s])
    assert (begins["t"]["rank"], how(begins["t"])) == ("2", ("True", "buddy", str(HOLD), "True")), begins["t"][0]
    job.replicated([z, s, t], HOLD)  # s's commit HOLD, fetched from y, is on t now

    s_worker = int(begins["s"]["pid"])
    u, begins = replace(s, s_worker, "u", 7, [z, t])
    assert (begins["u"]["rank"], how(begins["u"])) == ("1", ("True", "buddy", str(HOLD), "True")), begins["u"][0]
    assert begins["u"]["digest"] == committed  # model and optimizer too
    u.wait_for(rf"rank 1's state comes from its buddy node {re.escape(node_id(t))}: commit {HOLD}")
    for p in (z, x, y, s, t, u):  # nobody committed past HOLD until now
        assert f"step={HOLD + 1} " not in p.text(), p.name
    for m in begins.values():  # the workers of the last round, each waiting for its go
        os.kill(int(m["pid"]), signal.SIGUSR1)
    for agent in (z, t, u):
        assert agent.wait_exit() == 0, agent.text()[-4000:]
    cluster.assert_no_orphans()
