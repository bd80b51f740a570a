"""Restart mode keeps each worker's committed state in host memory its agent owns.

End to end with real launchers, agents and gloo workers (tests/workers/state_worker.py):
a worker SIGKILLed after a commit, or in the middle of one, is restarted and resumes
from its last whole commit, every shard intact, with no file read; a state too big for
`--state-memory` fails at its first commit with one line; the agent's files go when the
agent ends, even by SIGKILL. And the host copy's format on its own: a record torn in
its write, or a slot cleared for a commit that never finished, is never taken.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from elasticrun import state_layout
from elasticrun.agent import state_files
from elasticrun.launcher.flag_values import byte_size
from elasticrun.worker.elastic import State
from elasticrun.worker.elastic.host_copy import HostCopy
from tests.support.elastic_cluster import Cluster, Proc, pid_alive
from tests.support.helpers import wait_until

pytestmark = pytest.mark.timeout(180)

WORKER = Path(__file__).resolve().parent / "workers" / "state_worker.py"
BEGIN = re.compile(
    r"begin rank=(?P<rank>\d+) restart=(?P<restart>\d+) restored=(?P<restored>\w+) from=(?P<source>[\w ]+) "
    r"step=(?P<step>\d+) digest=(?P<digest>\w+) intact=(?P<intact>\w+) pid=(?P<pid>\d+) file=(?P<file>\S*)"
)


def launch(cluster: Cluster, nproc: int, *args: str, flags: tuple[str, ...] = ()) -> Proc:
    return cluster.launch(
        "job", "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=1", "--shutdown-timeout=5",
        f"--log-dir={cluster.tmp / 'logs'}", *flags, str(WORKER), *args,
    )


def begins(job: Proc) -> list[re.Match[str]]:
    return list(BEGIN.finditer(job.text()))


def digest_at(job: Proc, rank: int, step: int) -> str:
    """The digest rank `rank` printed at step `step` in the first attempt."""
    first = job.text().split(f"begin rank={rank} restart=1")[0]
    found = re.findall(rf"step={step} rank={rank} digest=(\w+)", first)
    assert len(found) == 1, (rank, step, found)
    return found[0]


@pytest.mark.parametrize("model", ["plain", "fsdp"])
def test_a_sharded_state_survives_its_workers_sigkill(cluster: Cluster, model: str) -> None:
    """Rank 1 is SIGKILLed right after its commit 12: the restarted group resumes within
    one commit of it, both ranks at the same one (rank 0 cannot commit 13 without rank
    1's step; it may be stopped while copying 12, then both resume at 11), each rank
    with its own shard exactly as it was, model and optimizer included, read from the
    same file the agent gave the first attempt; the agent removes the files when it ends.
    With FSDP2 (`fsdp`) the model's parameters and their momentum are DTensors: each
    rank's shards come back as DTensors again, and the job trains on to its end."""
    fsdp = ("--fsdp",) if model == "fsdp" else ()
    job = launch(
        cluster, 2, "--kind=sharded", "--kill=after-commit", "--kill-at=12", "--kill-rank=1", "--steps=15", *fsdp
    )
    assert job.wait_exit() == 0, job.text()[-4000:]
    first, again = {}, {}
    for m in begins(job):
        (first if m["restart"] == "0" else again)[int(m["rank"])] = m
    assert sorted(again) == [0, 1], job.text()[-4000:]
    step = int(again[0]["step"])
    assert step in (11, 12) and again[1]["step"] == again[0]["step"], job.text()[-4000:]
    for rank, m in again.items():
        assert (m["restored"], m["source"], m["intact"]) == ("True", "own memory", "True"), m[0]
        assert m["digest"] == digest_at(job, rank, step)
        assert m["file"] == first[rank]["file"] != "", (m[0], first[rank][0])
        assert first[rank]["restored"] == "False"
        assert not Path(m["file"]).exists()
    assert first[0]["file"] != first[1]["file"]
    cluster.assert_no_orphans()


def test_a_worker_killed_in_the_middle_of_a_commit_restores_the_previous_one(cluster: Cluster) -> None:
    """The worker dies while its commit 6 is being copied (32 MB written into the slot,
    its record cleared, one whole commit held): the restart takes commit 5, whole."""
    job = launch(
        cluster, 1, "--kind=replicated", "--kill=mid-copy", "--kill-at=6", "--kill-rank=0", "--steps=8",
        "--numel=4000000",
    )
    assert job.wait_exit() == 0, job.text()[-4000:]
    assert "mid-copy held=[5]" in job.text(), job.text()[-4000:]
    (again,) = [m for m in begins(job) if m["restart"] == "1"]
    assert (again["restored"], again["source"], again["intact"], again["step"]) == ("True", "own memory", "True", "5")
    assert again["digest"] == digest_at(job, 0, 5)
    cluster.assert_no_orphans()


def test_a_replicated_rank_torn_in_a_commit_gets_the_newest_from_a_peer(cluster: Cluster) -> None:
    """Two ranks of a replicated State; rank 1 dies while copying commit 6, which rank
    0 finished: rank 0 resumes from its own commit 6, and rank 1, which holds only 5,
    receives 6 from it."""
    job = launch(
        cluster, 2, "--kind=replicated", "--kill=mid-copy", "--kill-at=6", "--kill-rank=1", "--steps=8",
        "--numel=1000000",
    )
    assert job.wait_exit() == 0, job.text()[-4000:]
    assert "mid-copy held=[5]" in job.text(), job.text()[-4000:]
    again = {int(m["rank"]): m for m in begins(job) if m["restart"] == "1"}
    assert (again[0]["source"], again[0]["step"]) == ("own memory", "6"), again[0][0]
    assert (again[1]["restored"], again[1]["source"], again[1]["step"]) == ("True", "a peer", "6"), again[1][0]
    assert again[0]["digest"] == again[1]["digest"] == digest_at(job, 0, 6)
    cluster.assert_no_orphans()


def test_a_state_too_big_fails_at_its_first_commit_with_one_line(cluster: Cluster) -> None:
    """8 MB of state in 1 MiB: the first commit stops the worker with one line (no
    traceback) saying what it needs, which the failure report repeats; exit 2 (usage)."""
    job = launch(cluster, 1, "--numel=1000000", "--steps=3", flags=("--state-memory=1M", "--max-restarts=0"))
    assert job.wait_exit() != 0
    text = job.text()
    line = (
        "elasticrun: the state does not fit in the host memory each worker has for it: commit 1 takes 7.6 MiB, "
        "and room is made for 4 copies, of 0.2 MiB each; raise --state-memory to at least 30.5 MiB"
    )
    assert f"<stderr>: {line}\n" in text, text[-4000:]
    assert "Traceback" not in text and "step=1 " not in text, text[-4000:]
    assert "exit code 2" in text


def test_the_agents_state_files_go_with_it_when_it_is_killed(cluster: Cluster) -> None:
    """SIGKILL to the agent: its warden removes the state files (and its workers die)."""
    job = launch(cluster, 2, "--steps=1000000")
    files = {Path(m["file"]) for m in (job.wait_for(BEGIN.pattern, count=n) for n in (1, 2))}
    pids = {int(m["pid"]) for m in begins(job)}
    job.wait_for(r"step=2 rank=1 ")  # both have committed
    assert all(f.exists() and f.stat().st_mode & 0o777 == 0o600 for f in files), files
    job.kill()
    wait_until(lambda: not any(f.exists() for f in files), 30, "the warden to remove the state files")
    wait_until(lambda: not any(pid_alive(p) for p in pids), 30, "the workers to die with their agent")


# --- the host copy on its own --------------------------------------------------------------


def test_files_of_agents_that_are_gone_are_swept(tmp_path: Path) -> None:
    """An agent killed with its warden leaves its files: the next agent of the same user
    and pid namespace removes them, and leaves alone a live agent's, another namespace's
    and any other file."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    mine = state_files._process(os.getpid())
    assert mine is not None
    started, namespace = mine
    names = {
        "dead": f"elasticrun-state-{gone.pid}.{started}.{namespace}-00ff-0",
        "dead replica": f"elasticrun-replica-{gone.pid}.{started}.{namespace}-00ff-3",
        "reused pid": f"elasticrun-state-{os.getpid()}.{started + 1}.{namespace}-00ff-0",
        "live": f"elasticrun-state-{os.getpid()}.{started}.{namespace}-00ff-0",
        "other namespace": f"elasticrun-state-{gone.pid}.{started}.{namespace + 1}-00ff-0",
        "not ours": "elasticrun-state-00ff-0",
    }
    for name in names.values():
        (tmp_path / name).touch()
    assert state_files.sweep(tmp_path) == 3
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(names[k] for k in ("live", "other namespace", "not ours"))


def _commit(copy: HostCopy, commits: int, value: float) -> None:
    named = iter([("t", {"w": torch.full((1000,), value), "n": commits})])
    copy.write(named, commits, 0, 0, 1)


def _file(tmp_path: Path, size: int = 1 << 20) -> Path:
    path = tmp_path / "state"
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_a_torn_record_is_never_taken(tmp_path: Path) -> None:
    path = _file(tmp_path)
    copy = HostCopy(path)
    for n in (1, 2, 3):
        _commit(copy, n, float(n))
    assert [r.commits for r in HostCopy(path).held()] == [2, 3]
    newest = HostCopy(path).held()[-1]
    with open(path, "r+b") as f:  # one byte of the newest record's step, flipped
        f.seek(newest.slot * 512 + 16)
        byte = f.read(1)
        f.seek(newest.slot * 512 + 16)
        f.write(bytes([byte[0] ^ 1]))
    (left,) = HostCopy(path).held()
    assert left.commits == 2
    restored = HostCopy(path).read(left, torch.device("cpu"))
    assert restored["t"]["n"] == 2 and torch.equal(restored["t"]["w"], torch.full((1000,), 2.0))


def test_pinned_commits_outlive_the_commits_after_them_and_the_agent_sees_the_candidate(tmp_path: Path) -> None:
    """A ShardedState's pins (elasticrun.worker.elastic.buddy_pins): the candidate and the
    safe commit stay in the file however many commits follow, beside the newest two; the
    agent reads the candidate and acks it, and the worker reads the ack."""
    from elasticrun.agent.commit_files import CommitFile

    path = _file(tmp_path)
    copy = HostCopy(path)
    _commit(copy, 1, 1.0)
    copy.pin(copy.next_generation, 0)
    _commit(copy, 2, 2.0)
    candidate = copy.held()[-1]
    for n in range(3, 7):
        _commit(copy, n, float(n))
    assert [r.commits for r in HostCopy(path).held()] == [2, 5, 6]
    agent = CommitFile(path)
    assert agent.candidate() == candidate.generation and not copy.buddy_holds(candidate.generation)
    agent.acknowledge(candidate.generation)
    assert copy.buddy_holds(candidate.generation)
    copy.pin(copy.next_generation, candidate.generation)  # commit 2 is safe, commit 7 the next candidate
    for n in range(7, 11):
        _commit(copy, n, float(n))
    assert [r.commits for r in HostCopy(path).held()] == [2, 7, 9, 10]
    restored = HostCopy(path).read(HostCopy(path).held()[0], torch.device("cpu"))
    assert restored["t"]["n"] == 2 and torch.equal(restored["t"]["w"], torch.full((1000,), 2.0))
    copy.pin(0, 0)  # a new group: nothing pinned, the commits take the free slots again
    _commit(copy, 11, 11.0)
    _commit(copy, 12, 12.0)
    assert [r.commits for r in HostCopy(path).held()][-2:] == [11, 12]
    agent.close()


def test_a_commit_that_never_finished_leaves_the_previous_one(tmp_path: Path) -> None:
    """The payloads are taken while the copy runs: one that fails half-way leaves the
    slot it was writing cleared, and a new worker takes the commit before."""
    path = _file(tmp_path)
    copy = HostCopy(path)
    _commit(copy, 1, 1.0)
    _commit(copy, 2, 2.0)

    def payloads():  # the first object copied, then a failure before the end
        yield "t", {"w": torch.full((1000,), 3.0), "n": 3}
        raise OSError("killed")

    with pytest.raises(OSError):
        copy.write(payloads(), 3, 0, 0, 1)
    assert [r.commits for r in HostCopy(path).held()] == [2]


def test_a_file_too_small_for_its_copies_is_refused(tmp_path: Path) -> None:
    from elasticrun.errors import StateMemoryError

    with pytest.raises(StateMemoryError, match="too small for 4 copies"):
        HostCopy(_file(tmp_path, state_layout.HEADER_BYTES))
    assert os.path.exists(tmp_path / "state")


@pytest.mark.parametrize(
    ("value", "size"), [("0", 0), ("100", 100), ("1.5K", 1536), ("512M", 512 << 20), ("8g", 8 << 30), ("1T", 1 << 40)]
)
def test_state_memory_takes_sizes(value: str, size: int) -> None:
    assert byte_size(value, "--state-memory") == size


def test_restore_rolls_back_to_the_last_commit_held_in_host_memory(tmp_path: Path) -> None:
    """With a host copy a commit is kept there only (not also in the process), and
    restore() rolls back from there; commit(every=2) commits every second call only, in
    host memory or (without one) in the process; a new worker resumes from the last."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = State(model=model, optimizer=optimizer, step=0)
    state._keep_in(HostCopy(_file(tmp_path)))
    assert not state.restored and state.restored_from == "nothing"

    def train_step() -> None:
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        state.step += 1

    def snapshot() -> list[torch.Tensor]:
        return [t.clone() for t in model.state_dict().values()] + [
            s["momentum_buffer"].clone() for s in optimizer.state.values()
        ]

    def rolled_back_to(kept: list[torch.Tensor], step: int) -> bool:
        train_step()
        state.restore()
        return all(torch.equal(a, b) for a, b in zip(kept, snapshot(), strict=True)) and state.step == step

    train_step()
    state.commit()  # call 1: a commit
    assert rolled_back_to(snapshot(), 1) and state.commits == 1
    train_step()
    state.commit(every=2)  # call 2: a commit
    kept = snapshot()
    assert rolled_back_to(kept, 2) and state.commits == 2
    train_step()
    state.commit(every=2)  # call 3: none
    assert rolled_back_to(kept, 2) and state.commits == 2

    model2 = torch.nn.Linear(4, 4)
    optimizer2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    again = State(model=model2, optimizer=optimizer2, step=0)
    again._keep_in(HostCopy(tmp_path / "state"))
    assert (again.restored, again.restored_from, again.step, again.commits) == (True, "own memory", 2, 2)
    assert all(torch.equal(a, b) for a, b in zip(model2.state_dict().values(), kept, strict=False))

    plain = State(step=0)  # no host copy: in the process, every second call
    for _ in range(3):
        plain.step += 1
        plain.commit(every=2)
    plain.step += 1
    plain.restore()
    assert (plain.commits, plain.step) == (1, 2)


def test_an_optimizer_step_waits_for_the_commit_copying_its_parameters(tmp_path: Path) -> None:
    """A commit leaves the copy of the optimizer's parameters and state to a thread and
    returns; the optimizer's next step waits for that copy, so the commit holds the
    values it was made with, never the step's. Buffers (a forward changes them) are
    copied before commit() returns. The thread is held busy here, so the copy is still
    in flight when the step is asked for."""
    import threading

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = State(model=model, optimizer=optimizer, step=0)
    host = HostCopy(_file(tmp_path))
    state._keep_in(host)

    def train_step() -> None:
        optimizer.zero_grad()
        model(torch.randn(8, 64)).sum().backward()
        optimizer.step()

    def values() -> list[torch.Tensor]:
        return [t.clone() for t in model.state_dict().values()] + [
            s["momentum_buffer"].clone() for s in optimizer.state.values()
        ]

    train_step()
    state.commit()  # the first: makes the copying thread
    host.settle()
    release = threading.Event()
    assert host._finisher is not None
    busy = host._finisher.submit(release.wait)  # the thread cannot copy until released
    train_step()
    kept = values()
    state.commit()
    assert [r.commits for r in host.held()] == [1]  # commit 2's copy is in flight
    model(torch.randn(8, 64))  # a forward: changes the BatchNorm buffers, which commit 2 holds already
    stepping = threading.Thread(target=optimizer.step)
    stepping.start()
    release.set()
    stepping.join(timeout=30)
    busy.result(timeout=30)
    host.settle()
    assert not stepping.is_alive()
    newest = host.held()[-1]
    assert newest.commits == 2
    committed = host.read(newest, torch.device("cpu"))
    now = values()
    got = list(committed["model"].values()) + [s["momentum_buffer"] for s in committed["optimizer"]["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(kept, got, strict=True))
    assert not torch.equal(now[0], kept[0])  # the step did change the weights, after the copy
