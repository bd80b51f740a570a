"""The parts of in-process mode, each on its own: the agent<->worker line (the agent's
WorkerChannel against the worker's AgentLink, over a real Unix socket), the training
State's commit/restore, and the socket shutdown that interrupts a gloo collective.
The whole mode runs end to end in tests/test_inprocess.py.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elasticrun.agent import worker_link as agent_link
from elasticrun.agent.env import round_env
from elasticrun.agent.worker_link import WorkerChannel
from elasticrun.rendezvous.handler import Assignment
from elasticrun.worker.elastic import MembershipChanged, State
from elasticrun.worker.elastic import link as worker_link
from elasticrun.worker.elastic import session as session_module
from elasticrun.worker.elastic.link import AgentGoneError, AgentLink, WorkerAssignment
from elasticrun.worker.elastic.run import broken_by_peer
from elasticrun.worker.elastic.session import (
    CollectiveAbandonedError,
    GroupSession,
    SupersededError,
    _shut_down,
    _socket_inodes,
)
from tests.support.helpers import free_port, wait_until

pytestmark = pytest.mark.timeout(30)

WORKERS = Path(__file__).parent / "workers"


def test_both_ends_name_the_same_variable() -> None:
    # the worker side must not import agent code (DESIGN.md), so the name is written twice
    assert agent_link.SOCKET_VAR == worker_link.SOCKET_VAR


async def test_assign_ready_change_interrupt_and_broken_travel_over_the_line() -> None:
    ch = WorkerChannel()
    await ch.start()
    try:
        # an assignment made before the worker connects reaches it on hello
        ch.assign(3, {0: {"RANK": "4", "WORLD_SIZE": "6", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}})
        link = await asyncio.to_thread(AgentLink, ch.path, 0)
        await asyncio.wait_for(ch.wait_connected([0]), 10)
        assert not ch.ready([0])  # imported the API, still starting up
        a = await asyncio.to_thread(link.next_assignment, 0)
        await asyncio.wait_for(ch.wait_ready([0]), 10)  # asking for a round says it is ready
        assert (a.round, a.rank, a.world_size, a.master_addr, a.master_port) == (3, 4, 6, "10.0.0.1", 1234)
        assert not link.superseded(3)

        changes: list[tuple[int, bool]] = []
        link.on_change(lambda round_number, interrupt: changes.append((round_number, interrupt)))
        ch.change(3, interrupt=False)  # nodes joined: no interrupt
        await asyncio.to_thread(wait_until, lambda: link.superseded(3), 10, "the change", 0.01)
        assert not link.peer_lost(3)
        ch.change(3, interrupt=True)  # a peer is gone: interrupt now
        await asyncio.to_thread(wait_until, lambda: len(changes) == 2, 10, "the interrupt", 0.01)
        assert changes == [(3, False), (3, True)]
        assert link.peer_lost(3) and not link.peer_lost(4)

        ch.assign(4, {0: {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}})
        assert (await asyncio.to_thread(link.next_assignment, 3)).round == 4

        link.report_broken(4, "Traceback ...\nRuntimeError: boom", by_peer=True)
        report = await asyncio.wait_for(ch.broken(4), 10)
        assert (report.local_rank, report.round, report.by_peer) == (0, 4, True) and "boom" in report.error
        assert report.last_line() == "RuntimeError: boom" and ch.broken_in(3) is None

        ch.disconnect()  # the agent stops its workers: the line closes
        with pytest.raises(AgentGoneError):
            await asyncio.to_thread(link.next_assignment, 4)
    finally:
        await ch.close()
    assert not os.path.exists(ch.path)


async def test_a_bad_line_from_a_worker_drops_that_worker_only() -> None:
    ch = WorkerChannel()
    await ch.start()
    try:
        good = await asyncio.to_thread(AgentLink, ch.path, 0)
        reader, writer = await asyncio.open_unix_connection(ch.path)
        writer.write(b'{"hello": 1}\n{not json\n')
        await writer.drain()
        assert await reader.read() == b""  # the agent hung up on it
        await asyncio.wait_for(ch.wait_connected([0]), 10)
        assert not ch.connected([1])
        ch.assign(1, {0: {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}})
        assert (await asyncio.to_thread(good.next_assignment, 0)).round == 1
        writer.close()
    finally:
        await ch.close()


def test_a_lost_peer_breaks_a_join_in_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 1 joins round 2, whose rank 0 never comes (its node died). The agent's word
    # that round 2 lost a peer must end the join now, not after the group's 60 s timeout.
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # join() exports them; restored after the test
    session = GroupSession(WorkerAssignment(2, env), "gloo", datetime.timedelta(seconds=60))
    outcome: list[BaseException] = []

    def join() -> None:
        try:
            session.join()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome.append(e)

    joining = threading.Thread(target=join, daemon=True)
    joining.start()
    session.round_over(2, interrupt=True)
    joining.join(20)
    assert not joining.is_alive() and len(outcome) == 1 and isinstance(outcome[0], SupersededError)
    session.leave()


#: rank 0 of round 3: joins the group, then never calls the collective its rank 1 waits in
_IDLE_PEER = """
import datetime, sys
from elasticrun.worker.elastic.link import WorkerAssignment
from elasticrun.worker.elastic.session import GroupSession
env = dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
GroupSession(WorkerAssignment(3, env), "gloo", datetime.timedelta(seconds=60)).join()
print("joined", flush=True)
sys.stdin.read()  # in the group until the test lets go (closes stdin) or kills it
"""


def test_a_collective_that_an_interrupt_does_not_break_is_abandoned(monkeypatch: pytest.MonkeyPatch) -> None:
    # gloo at times closes a pair's socket on a peer's shutdown and leaves the send posted
    # on it waiting (seen in the store-stall tests): the interrupt then finds nothing to
    # shut down. The same here: the shutdown does nothing, and the peer never comes.
    port = free_port()
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # join() exports them; restored after the test
    peer = subprocess.Popen(
        [sys.executable, "-c", _IDLE_PEER, str(port)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
    )
    try:
        session = GroupSession(WorkerAssignment(3, env), "gloo", datetime.timedelta(seconds=60))
        session.join()
        assert peer.stdout is not None and peer.stdout.readline() == "joined\n"
        monkeypatch.setattr(session_module, "_shut_down", lambda inodes: None)
        interrupting = threading.Timer(0.2, session.round_over, args=(3, True))
        interrupting.start()
        with pytest.raises(CollectiveAbandonedError) as abandoned:
            dist.all_reduce(torch.ones(1))  # would wait out the group's 60 s
        assert broken_by_peer(abandoned.value)
        session.leave()  # at once: the group's threads are joined where the collective ends
        assert not dist.is_initialized()
    finally:
        peer.kill()
        peer.wait()


def _raised(error: BaseException, through: str = "") -> BaseException:
    """`error` as raised (with its traceback), from a function compiled as if in file `through`."""
    code = compile("def fail(error):\n    raise error\n", through or "train.py", "exec")
    scope: dict = {}
    exec(code, scope)
    try:
        scope["fail"](error)
    except BaseException as e:
        return e
    raise AssertionError("not raised")


@pytest.mark.parametrize(
    ("error", "by_peer"),
    [
        (_raised(ValueError("shapes (3,) and (4,) do not match")), False),  # the script's own bug
        (_raised(RuntimeError("CUDA out of memory")), False),
        # gloo's words for a peer that left, as DDP's reducer raises them from backward()
        (_raised(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:4000")), True),
        (_raised(dist.DistBackendError("NCCL communicator was aborted on rank 1")), True),
        # anything raised on its way through torch.distributed
        (_raised(RuntimeError("timed out"), through=os.path.join(os.path.dirname(dist.__file__), "c10d.py")), True),
    ],
)
def test_a_failure_out_of_a_collective_is_told_apart(error: BaseException, by_peer: bool) -> None:
    """Only a failure that a peer's re-formation could cause waits for the round's end."""
    assert broken_by_peer(error) is by_peer


def test_commit_and_restore_cover_model_optimizer_and_values() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = State(model=model, optimizer=opt, step=0, history=[1])

    def train_step() -> None:
        opt.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        opt.step()

    train_step()
    state.step = 1
    state.history.append(2)
    state.commit()
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = opt.state_dict()["state"][0]["momentum_buffer"].clone()

    train_step()  # a step that a failed collective would roll back
    state.step = 2
    state.history.append(3)
    state.restore()
    assert state.step == 1 and state.history == [1, 2] and state.commits == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, committed[k])
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], momentum)


def test_state_refuses_unknown_names_and_replacing_objects() -> None:
    state = State(model=torch.nn.Linear(1, 1), step=0)
    with pytest.raises(AttributeError, match="holds no 'epoch'"):
        state.epoch = 1
    with pytest.raises(AttributeError, match="cannot replace its 'model'"):
        state.model = torch.nn.Linear(1, 1)
    with pytest.raises(AttributeError, match="holds model, step"):
        _ = state.epoch
    with pytest.raises(ValueError):
        State()


def test_commit_leaves_through_the_membership_check() -> None:
    state = State(step=0)
    calls = []

    def check() -> None:
        calls.append(state.step)
        if state.step == 2:
            raise MembershipChanged("round 1 is over")

    state._attach(check)
    state.step = 1
    state.commit()
    state.step = 2
    with pytest.raises(MembershipChanged):
        state.commit()
    # the commit was taken before leaving: nothing to roll back
    state.step = 99
    state.restore()
    assert state.step == 2 and calls == [1, 2]
    # a script's `except Exception` must not swallow the way out
    assert not issubclass(MembershipChanged, Exception)


def test_interrupt_shuts_connected_sockets_and_spares_listeners() -> None:
    before = _socket_inodes()
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    served, _ = listener.accept()
    group = _socket_inodes() - before
    outside = socket.socket(socket.AF_UNIX)  # opened later: not the group's
    try:
        _shut_down(group)
        assert served.recv(1) == b""  # the peer sees the connection end at once
        with pytest.raises(OSError):
            client.send(b"x")
        # the listener still accepts (gloo aborts the process if its accept fails)
        late = socket.create_connection(listener.getsockname())
        listener.accept()[0].close()
        late.close()
    finally:
        for s in (listener, client, served, outside):
            s.close()


def _sync(tmp_path: Path, commits: dict[int, int], *extra: str) -> dict[int, dict]:
    """Run sync_worker.py's ranks (0, 1, ... with these commit counts); each rank's state after sync()."""
    assert list(commits) == list(range(len(commits)))
    proc = subprocess.Popen(
        [sys.executable, str(WORKERS / "sync_worker.py"), str(free_port()),
         ",".join(str(c) for c in commits.values()), str(tmp_path), *extra]
    )
    try:
        assert proc.wait(timeout=80) == 0
    finally:
        proc.kill()
        proc.wait()
    return {r: torch.load(tmp_path / f"{r}.after.pt", weights_only=False) for r in commits}


def _assert_same_training_state(got: dict, want: dict) -> None:
    assert (got["step"], got["commits"]) == (want["step"], want["commits"])
    assert torch.equal(got["best"], want["best"])
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
    assert got["optimizer"]["state"].keys() == want["optimizer"]["state"].keys()
    for i, slots in want["optimizer"]["state"].items():
        for k, v in slots.items():
            have = got["optimizer"]["state"][i][k]
            assert have.device == v.device and torch.equal(have, v), (i, k)


@pytest.mark.timeout(90)  # three or four gloo processes on two cores
def test_sync_gives_every_rank_the_newest_commit(tmp_path: Path) -> None:
    # A job's first round, no one synced before: rank 1 holds the most commits, rank 0
    # is fresh (no optimizer state at all), rank 2 is behind. After sync() all three
    # hold rank 1's commit exactly: weights, Adam's moments and its CPU step counters,
    # plain values and a tensor value.
    after = _sync(tmp_path, {0: 0, 1: 3, 2: 1})
    newest = torch.load(tmp_path / "1.before.pt", weights_only=False)
    assert newest["optimizer"]["state"] and newest["commits"] == 3
    assert not torch.load(tmp_path / "0.before.pt", weights_only=False)["optimizer"]["state"]
    for r in after:
        _assert_same_training_state(after[r], newest)
        assert after[r]["tag"] == "rank1"


@pytest.mark.timeout(90)
def test_sync_moves_state_only_to_newcomers_spread_over_survivors(tmp_path: Path) -> None:
    # Ranks 0 and 1 synced before and committed as often (their tags differ on purpose);
    # ranks 2 and 3 are newcomers. Survivors keep their own state (nothing moves between
    # them); newcomer 2 gets survivor 0's, newcomer 3 survivor 1's.
    after = _sync(tmp_path, {0: 2, 1: 2, 2: 0, 3: 1}, str(free_port()))
    survivors = [torch.load(tmp_path / f"{r}.before.pt", weights_only=False) for r in (0, 1)]
    assert [after[r]["tag"] for r in range(4)] == ["survivor0", "survivor1", "survivor0", "survivor1"]
    for r in range(4):
        _assert_same_training_state(after[r], survivors[r % 2])


@pytest.mark.timeout(90)
def test_sync_copies_to_a_node_that_froze_with_another_state_under_the_same_count(tmp_path: Path) -> None:
    # Rank 2 committed one step more than ranks 0 and 1 just before they went on
    # without it; they then committed once in the next round. All hold 2 commits, rank 2
    # another state; when it comes back, it must get theirs, not keep its own.
    proc = subprocess.Popen([sys.executable, str(WORKERS / "sync_worker.py"), str(free_port()), "frozen",
                             str(tmp_path), str(free_port()), str(free_port())])
    try:
        assert proc.wait(timeout=80) == 0
    finally:
        proc.kill()
        proc.wait()
    before = {r: torch.load(tmp_path / f"{r}.before.pt", weights_only=False) for r in range(3)}
    after = {r: torch.load(tmp_path / f"{r}.after.pt", weights_only=False) for r in range(3)}
    assert {b["commits"] for b in before.values()} == {2} and before[2]["tag"] == "frozen"  # the same count
    for r in range(3):
        assert after[r]["tag"] == "survivors" and after[r]["step"] == 2, (r, after[r])
        assert torch.equal(after[r]["weight"], before[0]["weight"]), r


@pytest.mark.timeout(90)  # two gloo processes on two cores
@pytest.mark.parametrize("told", ["while forming", "with its assignment", "to both, both forming"])
async def test_a_round_superseded_while_forming_is_abandoned_for_the_next(tmp_path: Path, told: str) -> None:
    """Rounds 4 and 5 opened back to back: node A's agent heard of round 4 and its worker
    began forming that group (or heard that round 4 was over with the assignment itself,
    before the worker began); node B's agent saw only round 5. A must leave round 4 when
    told it is over, or it waits for B there until the group's timeout, and B waits for
    it in round 5. Or both heard of round 4 and were told at once that it is over: they
    must leave it together (or make it together and then leave), never one of them."""
    channels = [WorkerChannel(), WorkerChannel()]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for ch in channels:
            await ch.start()
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKERS / "inprocess_worker.py"), "--steps", "3", "--sleep", "0"],
                env={**os.environ, agent_link.SOCKET_VAR: ch.path, "LOCAL_RANK": "0", "GLOO_SOCKET_IFNAME": "lo"},
                stdout=open(tmp_path / f"{len(procs)}.out", "wb"), stderr=subprocess.STDOUT,
            ))
        for ch in channels:
            await asyncio.wait_for(ch.wait_ready([0]), 60)
        ports = {4: free_port(), 5: free_port()}

        def env(round_number: int, rank: int) -> dict[str, str]:
            a = Assignment(round=round_number, node_rank=rank, node_count=2, rank_offset=rank, world_size=2,
                           master_addr="127.0.0.1", master_port=ports[round_number], restart_count=0)
            return round_env(a, 0)

        if told == "with its assignment":  # the worker reads the assignment knowing the round is over
            channels[0].change(4, interrupt=False)
        channels[0].assign(4, {0: env(4, 0)})
        if told == "to both, both forming":
            channels[1].assign(4, {0: env(4, 1)})
        if told == "while forming":
            # A's worker is forming round 4 once its rank-0 store listens (B never comes there)
            await asyncio.to_thread(wait_until, lambda: _accepts(ports[4]), 30, "round 4's store", 0.01)
        for ch in channels:
            ch.change(4, interrupt=False)  # nodes joined: not a lost peer
        for rank, ch in enumerate(channels):
            ch.assign(5, {0: env(5, rank)})
        for proc in procs:
            assert await asyncio.to_thread(proc.wait, 60) == 0
        out = [(tmp_path / f"{i}.out").read_text() for i in range(2)]
        joined_at = []
        for rank, text in enumerate(out):
            joined = re.search(rf"joined rank={rank} world=2 round=5 .* step=(\d+)", text)
            assert joined, text
            joined_at.append(int(joined[1]))
            assert re.search(rf"step=3 rank={rank} world=2 round=5 ", text), text
            assert "Traceback" not in text, text
        # B never was in round 4 unless told of it: then both may have made it, and trained
        # there a step or two before leaving, together
        assert joined_at == [0, 0] if told != "to both, both forming" else joined_at[0] == joined_at[1], out
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        for ch in channels:
            await ch.close()


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True
