"""Churn: many membership changes in one bounded run, then nothing may be leaked or lost.

Two agents, a and b, stay for the whole run (--nnodes=2:3, --max-restarts=0: a spent
restart would end the job). Each cycle:

1. a node x joins: the job scales up to 3 (a round: every worker restarts);
2. S standby agents join while the job is at its maximum (they register and wait);
3. half of them are SIGKILLed, the other half drained with one `elasticrun drain`;
4. x leaves: drained on even cycles, SIGKILLed (agent and worker) on odd ones: the job
   goes back to world 2 (another round).

Every change is checked to have happened (the registrations in the store, the rounds in
the workers' output). At the end: a and b exit 0, no process of the test is left, the
open file descriptors and RSS of a, b and the store server grew no more than a small
margin past their value after the first (warm-up) cycle, the step counter never went
back past a checkpoint, and every attempt's log holds every numbered line of its worker.

The CI run does 5 cycles with S=4: 50 changes, 10 of them rounds. `ELASTICRUN_SOAK=1
python -m pytest tests/fault -m soak` runs the soak: 40 cycles, 400 changes.
"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import time
from dataclasses import dataclass, field

import pytest

from tests.fault.conftest import (
    FaultCluster,
    check_no_line_lost,
    check_steps_never_go_back,
    proc_sample,
    redone,
    serve_store,
    step_pattern,
)
from tests.support.elastic_cluster import Proc, pid_alive, run_id
from tests.support.helpers import wait_until
from tests.support.reliability_rows import Reliability

#: how much a long-lived process may grow past its warm-up value
FD_MARGIN = 8
RSS_MARGIN_KIB = 24 * 1024
#: the store also keeps a watch history of up to 64 MiB by design (elasticrun/store/server/memory.py)
STORE_HISTORY_KIB = 64 * 1024
#: the events the leader keeps in the store (leader.EVENTS_KEPT), plus a few in flight
EVENTS_BOUND = 200 + 20


def node_id(p: Proc) -> str:
    return f"{socket.gethostname()}_{p.pid}"


async def _registered(endpoint: str, job: str) -> set[str]:
    from elasticrun.rendezvous.codec import decode
    from elasticrun.rendezvous.keys import Keys
    from elasticrun.rendezvous.records import NodeInfo

    return {decode(NodeInfo, kv.value).node_id for kv in await _keys(endpoint, Keys(job).nodes)}


async def _keys(endpoint: str, prefix: str) -> list:
    from elasticrun.store.client.grpc_store import GrpcStore

    store = GrpcStore(endpoint, timeout=10)
    try:
        return list((await store.get_prefix(prefix)).kvs)
    finally:
        await store.close()


@dataclass
class Churn:
    cluster: FaultCluster
    endpoint: str
    job: str
    counts: dict[str, int] = field(default_factory=lambda: {"joins": 0, "drains": 0, "kills": 0, "rounds": 0})
    #: agents that left (drained or killed)
    gone: list[int] = field(default_factory=list)
    _addr: int = 10

    def agent(self, name: str) -> Proc:
        self._addr = self._addr + 1 if self._addr < 250 else 10
        self.counts["joins"] += 1
        return self.cluster.agent(
            name, endpoint=self.endpoint, run_id=self.job, local_addr=f"127.0.0.{self._addr}", nnodes="2:3",
            worker_args=("--sleep", "0.05", "--lines", "2"),
        )

    def expect_nodes(self, procs: list[Proc]) -> None:
        want = {node_id(p) for p in procs}
        wait_until(
            lambda: asyncio.run(_registered(self.endpoint, self.job)) == want,
            what=f"the registered nodes to be {sorted(want)}", interval=0.1,
        )

    def drain(self, procs: list[Proc]) -> None:
        argv = ["drain", f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.job}", "--timeout=60"]
        done = self.cluster.control(*argv, *(f"--node={node_id(p)}" for p in procs), timeout=90)
        assert done.returncode == 0, done.stdout + done.stderr
        for p in procs:
            code = p.wait_exit()
            assert code == 0, f"drained {p.name} exited {code}:\n{p.text()[-3000:]}"
            self.gone.append(p.pid)
        self.counts["drains"] += len(procs)

    def kill(self, p: Proc, worker: int | None = None) -> None:
        """SIGKILL a node: its agent and (when it has one) its worker, by PID."""
        p.signal(signal.SIGKILL)
        if worker is not None and pid_alive(worker):
            signal_pid(worker, signal.SIGKILL)
        p.wait_exit()
        if worker is not None:
            wait_until(lambda: not pid_alive(worker), what=f"worker {worker} of {p.name} to go")
        self.gone.append(p.pid)
        self.counts["kills"] += 1


def signal_pid(pid: int, sig: signal.Signals) -> None:
    import os

    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _sample(procs: dict[str, int]) -> dict[str, dict[str, int]]:
    return {name: proc_sample(pid) for name, pid in procs.items()}


def run_churn(cluster: FaultCluster, reliability: Reliability, *, cycles: int, standbys: int, label: str) -> None:
    store, endpoint = serve_store("127.0.0.1", cluster.tmp / "store.log")
    try:
        _churn(cluster, reliability, endpoint, store, cycles=cycles, standbys=standbys, label=label)
    finally:
        store.kill()


def _churn(
    cluster: FaultCluster,
    reliability: Reliability,
    endpoint: str,
    store: Proc,
    *,
    cycles: int,
    standbys: int,
    label: str,
) -> None:
    churn = Churn(cluster, endpoint, run_id())
    began = time.monotonic()
    a = churn.agent("a")
    a.wait_for(r"node \S+ leads job")
    b = churn.agent("b")
    churn.counts["joins"] = 0  # the two that stay are the job, not churn
    for p in (a, b):
        p.wait_for(step_pattern(2))
    watched = {"a": a.pid, "b": b.pid, "store": store.pid}
    samples = {"start": _sample(watched)}
    round_times: list[float] = []

    for i in range(cycles):
        # 1. x joins: scale-up to 3
        marks = {p.name: p.mark() for p in (a, b)}
        t0 = time.monotonic()
        x = churn.agent(f"x{i}")
        x_step = x.wait_for(step_pattern(3))
        for p in (a, b):
            p.wait_for(step_pattern(3), start=marks[p.name])
        round_times.append(time.monotonic() - t0)
        churn.counts["rounds"] += 1
        # 2. standbys join the full job and wait
        spares = [churn.agent(f"s{i}_{j}") for j in range(standbys)]
        churn.expect_nodes([a, b, x, *spares])
        # 3. half are killed, half drained
        half = standbys // 2
        for s in spares[:half]:
            churn.kill(s)
        churn.drain(spares[half:])
        churn.expect_nodes([a, b, x])
        # 4. x leaves: drained or killed; back to world 2
        marks = {p.name: p.mark() for p in (a, b)}
        t0 = time.monotonic()
        if i % 2 == 0:
            churn.drain([x])
        else:
            churn.kill(x, int(x.wait_for(step_pattern(3), start=x_step.start())["pid"]))
        for p in (a, b):
            p.wait_for(step_pattern(2), start=marks[p.name])
        churn.expect_nodes([a, b])
        round_times.append(time.monotonic() - t0)
        churn.counts["rounds"] += 1
        if i == 0:
            samples["warm"] = _sample(watched)
    samples["end"] = _sample(watched)
    churned = time.monotonic() - began
    # the store holds nothing of the nodes that left but a bounded window of events
    from elasticrun.rendezvous.keys import Keys

    keys = Keys(churn.job)
    held = [kv.key for kv in asyncio.run(_keys(endpoint, keys.prefix))]
    gone = {f"{socket.gethostname()}_{pid}" for pid in churn.gone}
    leaked = [
        k for k in held
        if not k.startswith(keys.events) and any(k.rsplit("/", 1)[-1] == g or f"/{g}/" in k for g in gone)
    ]
    assert not leaked, f"the store keeps keys of nodes that left: {leaked[:10]}"
    events = sum(k.startswith(keys.events) for k in held)
    assert events <= EVENTS_BOUND, f"{events} events kept"

    cluster.stop_training()
    for p in (a, b):
        code = p.wait_exit()
        assert code == 0, f"{p.name} exited {code}:\n{p.text()[-4000:]}"
    cluster.assert_no_orphans()

    changes = churn.counts["joins"] + churn.counts["drains"] + churn.counts["kills"]
    assert changes == cycles * (2 + 2 * standbys)
    growth = {}
    for name in watched:
        warm, end = samples["warm"][name], samples["end"][name]
        growth[name] = {"fds": end["fds"] - warm["fds"], "rss_kib": end["rss_kib"] - warm["rss_kib"]}
        assert end["fds"] <= warm["fds"] + FD_MARGIN, f"{name} leaks file descriptors: {samples}"
        bound = RSS_MARGIN_KIB + (STORE_HISTORY_KIB if name == "store" else 0)
        assert end["rss_kib"] <= warm["rss_kib"] + bound, f"{name} grows: {samples}"
    restarts = {row["restart"] for row in cluster.worker_steps()}
    assert restarts == {0}, f"membership changes spent restarts: {restarts}"
    lines = check_no_line_lost(cluster)
    steps = check_steps_never_go_back(cluster)

    def fmt(name: str) -> str:
        w, e = samples["warm"][name], samples["end"][name]
        return f"{name} fds {w['fds']}->{e['fds']}, RSS {w['rss_kib'] // 1024}->{e['rss_kib'] // 1024} MiB"

    reliability.record(
        scenario=f"churn: {changes} membership changes ({label})",
        injected=(
            f"{cycles} cycles of: x joins; {standbys} standbys join, {standbys // 2} SIGKILLed, "
            f"{standbys - standbys // 2} drained; x drained or SIGKILLed "
            f"({churn.counts['joins']} joins, {churn.counts['drains']} drains, {churn.counts['kills']} kills; "
            f"{churn.counts['rounds']} rounds) in {churned:.0f} s"
        ),
        happened=(
            f"every change took effect; a, b never restarted for it; no process left; "
            f"{fmt('a')}; {fmt('b')}; {fmt('store')} (first cycle to last)"
        ),
        recovery_s=sum(round_times) / len(round_times),
        restarts=0,
        lost=(
            f"{redone(steps['steps_redone_max'])} at most (checkpoint every 5 steps); "
            f"0 of {lines['lines']} log lines, SIGKILLed nodes' included"
        ),
        changes=changes,
        store_keys_end=len(held),
        store_events_end=events,
        round_s_max=round(max(round_times), 2),
        samples=samples,
        growth=growth,
        **churn.counts,
        **lines,
        **steps,
    )


@pytest.mark.slow  # fifty changes in a row; tests/fault/test_nemesis.py's shorter runs stay
@pytest.mark.timeout(300)
def test_churn_fifty_changes_leaks_and_loses_nothing(fault_cluster: FaultCluster, reliability: Reliability) -> None:
    run_churn(fault_cluster, reliability, cycles=5, standbys=4, label="CI")


@pytest.mark.soak
@pytest.mark.timeout(1800)
def test_churn_soak_four_hundred_changes(fault_cluster: FaultCluster, reliability: Reliability) -> None:
    run_churn(fault_cluster, reliability, cycles=40, standbys=4, label="soak")


# --- the after-the-fact checks can fail ------------------------------------------------------


def _fake_attempt(cluster: FaultCluster, agent_pid: int, attempt: int, lines: list[str], printed: int) -> None:
    log = cluster.logs / f"job_host_{agent_pid}" / f"attempt_{attempt}" / "0" / "stdout.log"
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"{line}\n" for line in lines))
    worker = re.search(r" pid=(\d+)", lines[0])[1]
    cluster.seq_dir.mkdir(exist_ok=True)
    (cluster.seq_dir / worker).write_text(str(printed))


def _step(step: int, pid: int, seq: int, t: float, world: int = 2) -> str:
    return (
        f"step={step} rank=0 world={world} group_rank=0 restart=0 round=1 pid={pid} "
        f"t={t:.6f} sum={step * world} seq={seq}"
    )


def test_the_line_and_step_checks_can_fail(tmp_path) -> None:
    start = "worker started rank=0 world=2 group_rank=0 restart=0 round=1 pid={pid} resume={r} read_at={t:.6f} seq=0"
    good = FaultCluster(tmp_path / "good")
    _fake_attempt(good, 1, 0, [start.format(pid=11, r=0, t=1.0), _step(0, 11, 1, 2.0),
                               "ckpt step=0 at=2.100000 pid=11 seq=2", _step(1, 11, 3, 3.0)], printed=4)
    _fake_attempt(good, 1, 1, [start.format(pid=12, r=1, t=4.0), _step(1, 12, 1, 5.0)], printed=2)
    assert check_no_line_lost(good)["lines"] == 6
    assert check_steps_never_go_back(good)["steps_redone_max"] == 1

    gap = FaultCluster(tmp_path / "gap")
    _fake_attempt(gap, 1, 0, [start.format(pid=11, r=0, t=1.0), _step(0, 11, 2, 2.0)], printed=3)
    with pytest.raises(AssertionError, match="a gap"):
        check_no_line_lost(gap)
    # the last lines missing: lost too, even where the agent was SIGKILLed (no allowance)
    tail = FaultCluster(tmp_path / "tail")
    _fake_attempt(tail, 1, 0, [start.format(pid=11, r=0, t=1.0), _step(0, 11, 1, 2.0)], printed=5)
    with pytest.raises(AssertionError, match=r"lines 2\.\.4 of worker 11 are lost \(5 printed\)"):
        check_no_line_lost(tail)

    back = FaultCluster(tmp_path / "back")
    _fake_attempt(back, 1, 0, [start.format(pid=11, r=0, t=1.0), _step(5, 11, 1, 2.0),
                               "ckpt step=5 at=2.100000 pid=11 seq=2"], printed=3)
    _fake_attempt(back, 1, 1, [start.format(pid=12, r=3, t=4.0), _step(3, 12, 1, 5.0)], printed=2)
    with pytest.raises(AssertionError, match="resumed at step 3, but step 5 was saved before"):
        check_steps_never_go_back(back)
    skew = FaultCluster(tmp_path / "skew")
    _fake_attempt(skew, 1, 0, [start.format(pid=11, r=0, t=1.0),
                               _step(0, 11, 1, 2.0).replace("sum=0", "sum=1")], printed=2)
    with pytest.raises(AssertionError, match="ranks disagree"):
        check_steps_never_go_back(skew)
