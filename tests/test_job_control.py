"""Job control from any host (`elasticrun status|logs|join|drain|stop`) on both backends.

Real agents on 127.0.0.x run a torch-free ticking worker; the control commands run as
real `python -m elasticrun` processes against the same store, and the tests read their
output (tables, JSON) and exit codes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.support.elastic_cluster import RDZV_CONF, Cluster, Proc, Rdzv, run_id
from tests.support.helpers import ELASTICRUN, free_port, wait_until

pytestmark = pytest.mark.timeout(120)

TICKER = Path(__file__).resolve().parent / "workers" / "tick_worker.py"


def agent(
    cluster: Cluster, rdzv: Rdzv, name: str, addr: int, nnodes: str = "1:3", *worker_args: str,
    shutdown_timeout: float = 5, env: dict[str, str] | None = None,
) -> Proc:
    return cluster.launch(
        name, f"--nnodes={nnodes}", "--nproc-per-node=1",
        f"--rdzv-backend={rdzv.backend}", f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.run_id}",
        f"--rdzv-conf={rdzv.conf}", f"--local-addr=127.0.0.{addr}", f"--shutdown-timeout={shutdown_timeout:g}",
        f"--log-dir={cluster.tmp / 'logs'}", str(TICKER), "--stop-file", str(cluster.stop_file), *worker_args,
        env=env,
    )


def ctl(
    rdzv: Rdzv, *args: str, run_id: str | None = None, timeout: float = 60, command: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """Run one job-control command to its end (`command`: join's, after every flag)."""
    argv = [
        *ELASTICRUN, *args,
        f"--rdzv-backend={rdzv.backend}", f"--rdzv-endpoint={rdzv.endpoint}",
        f"--rdzv-id={run_id or rdzv.run_id}",
    ]
    if rdzv.backend == "c10d" and not any(a.startswith("--rdzv-conf") for a in args):
        argv.append("--rdzv-conf=store_timeout=3")
    return subprocess.run([*argv, *command], capture_output=True, text=True, timeout=timeout)


def ticker_command(cluster: Cluster) -> list[str]:
    """The agents' command, as `join` must be given it again."""
    return ["--", str(TICKER), "--stop-file", str(cluster.stop_file)]


def status(rdzv: Rdzv) -> dict:
    done = ctl(rdzv, "status", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def wait_world(rdzv: Rdzv, world: int) -> dict:
    """The job's status once it runs at `world` with every node healthy."""
    def ready() -> dict | None:
        done = ctl(rdzv, "status", "--json")
        if done.returncode == 2 and "no job" in done.stderr:  # the agents have not registered yet
            return None
        assert done.returncode == 0, done.stderr
        s = json.loads(done.stdout)
        states = [n["status"]["state"] for n in s["nodes"] if n["status"] and n["node_rank"] is not None]
        ok = s["job"]["state"] == "running" and s["job"]["world_size"] == world and len(states) == world
        return s if ok else None

    return wait_until(ready, what=f"the job running at world size {world}", interval=0.2)


@pytest.fixture
def job(cluster: Cluster, rdzv: Rdzv) -> Iterator[list[Proc]]:
    agents = [agent(cluster, rdzv, "a", 1), agent(cluster, rdzv, "b", 2)]
    wait_world(rdzv, 2)
    yield agents


def test_status_table_and_json_before_and_after_scale_out(cluster, rdzv, job):
    table = ctl(rdzv, "status")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:4] == ["JOB", "STATE", "ROUND", "WORLD"]
    assert lines[1].split()[:2] == [rdzv.run_id, "running"]
    node_rows = [line.split() for line in lines if line.startswith(socket.gethostname() + "_")]
    assert [row[1] for row in node_rows] == ["healthy", "healthy"]
    assert sorted(row[3] for row in node_rows) == ["0", "1"]
    events = lines[lines.index(next(line for line in lines if line.startswith("EVENTS"))) + 1:]
    assert any(e.split()[1] == "round" and "world size 2" in e for e in events), events

    joined = cluster.launch("c", "join", f"--rdzv-backend={rdzv.backend}",
        f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.run_id}", "--local-addr=127.0.0.3",
        "--timeout=30", *(["--rdzv-conf=is_host=false"] if rdzv.backend == "c10d" else []),
        *ticker_command(cluster),
    )
    after = wait_world(rdzv, 3)
    ranks = {n["node_id"]: n["node_rank"] for n in after["nodes"]}
    assert sorted(ranks.values()) == [0, 1, 2]
    assert after["job"]["round"] >= 2 and after["job"]["restarts"] == 0
    # the causes stay in sight: each node's waits for a round are no job event
    kinds = [e["kind"] for e in after["events"]]
    assert "init" not in kinds and {"healthy", "stopped"} <= set(kinds), after["events"]
    assert joined.wait_for(r"tick=\d+ rank=2 world=3")
    cluster.stop_training()
    for proc in [*job, joined]:
        assert proc.wait_exit() == 0, proc.text()[-3000:]
    cluster.assert_no_orphans()


def test_logs_tail_shows_every_rank_and_follow_sees_new_lines(cluster, rdzv, job):
    wait_until(lambda: all(f"[{r}]<stdout>: tick=" in ctl(rdzv, "logs", "--tail", "3").stdout for r in (0, 1)),
               what="both ranks' lines in the store", interval=0.3)
    tail = ctl(rdzv, "logs", "--tail", "3")
    per_rank = [line for line in tail.stdout.splitlines() if line.startswith("[1]<stdout>: tick=")]
    assert 1 <= len(per_rank) <= 3
    follow = cluster.launch("follow", "logs", "--follow", "--tail", "0", "--rank", "0",
        f"--rdzv-backend={rdzv.backend}", f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.run_id}",
    )
    first = follow.wait_for(r"^\[0\]<stdout>: tick=(\d+) rank=0")
    later = follow.wait_for(rf"^\[0\]<stdout>: tick={int(first.group(1)) + 3} rank=0")
    assert later and "[1]<stdout>" not in follow.text()
    follow.kill()
    cluster.stop_training()
    for proc in job:
        assert proc.wait_exit() == 0


def test_drain_by_count_then_by_name_and_never_below_min(cluster, rdzv):
    agents = [agent(cluster, rdzv, n, i + 1, nnodes="2:3") for i, n in enumerate("abc")]
    s = wait_world(rdzv, 3)
    newest = max(s["nodes"], key=lambda n: n["node_rank"])["node_id"]
    done = ctl(rdzv, "drain", "--count", "1", "--timeout", "30")
    assert done.returncode == 0, done.stderr
    assert newest in done.stdout
    s = wait_world(rdzv, 2)
    assert newest not in [n["node_id"] for n in s["nodes"]]
    refused = ctl(rdzv, "drain", "--node", s["nodes"][0]["node_id"])
    assert refused.returncode == 2
    assert "below the job's minimum of 2" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    drained = [p for p in agents if p.popen.poll() is not None]
    assert len(drained) == 1 and drained[0].popen.returncode == 0
    assert "drained" in drained[0].text()
    cluster.stop_training()
    for proc in agents:
        proc.wait_exit()
    cluster.assert_no_orphans()


def test_drain_by_name(cluster, rdzv):
    agents = [agent(cluster, rdzv, n, i + 1) for i, n in enumerate("ab")]
    s = wait_world(rdzv, 2)
    target = min(s["nodes"], key=lambda n: n["node_rank"])["node_id"]
    done = ctl(rdzv, "drain", "--node", target, "--timeout", "30")
    assert done.returncode == 0, done.stderr
    s = wait_world(rdzv, 1)
    assert [n["node_id"] for n in s["nodes"]] != [target]
    cluster.stop_training()
    for proc in agents:
        proc.wait_exit()
    cluster.assert_no_orphans()


def test_drain_waits_until_the_drained_agent_is_done(cluster, c10d_store):
    """The drained node's workers take 2 s to save on SIGTERM: `drain` returns after that
    (it once returned at once, the agent exiting later); `--no-wait` only asks."""
    rdzv = Rdzv("c10d", c10d_store, RDZV_CONF + ",is_host=false", run_id())
    agents = [agent(cluster, rdzv, n, i + 1, "1:3", "--save-seconds", "2") for i, n in enumerate("abc")]
    s = wait_world(rdzv, 3)
    newest = max(s["nodes"], key=lambda n: n["node_rank"])["node_id"]
    done = ctl(rdzv, "drain", "--count", "1", "--timeout", "60")
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(rf"drained {newest} in \d+\.\ds \(left the job, workers stopped\)\n", done.stdout)
    assert Path(f"{cluster.stop_file}.saved.{newest}").exists()  # its workers had saved
    s = wait_world(rdzv, 2)
    oldest = min(s["nodes"], key=lambda n: n["node_rank"])["node_id"]
    asked = ctl(rdzv, "drain", "--node", oldest, "--no-wait")
    assert (asked.returncode, asked.stdout) == (0, f"drain requested: {oldest}\n"), asked.stderr
    wait_world(rdzv, 1)
    drained = [p for p in agents if newest.endswith(f"_{p.pid}") or oldest.endswith(f"_{p.pid}")]
    assert [p.wait_exit() for p in drained] == [0, 0]
    cluster.stop_training()
    for proc in agents:
        assert proc.wait_exit() == 0
    cluster.assert_no_orphans()


def test_drain_of_an_agent_killed_while_it_stops_its_workers_ends_and_says_so(cluster, c10d_store):
    """A drained agent killed after it left the job, while its worker saves (60 s), never
    deletes its drain request: `drain` sees its liveness port refuse, says so for that
    node, deletes the request, and exits 0 instead of waiting out --timeout; the agent's
    warden stops the worker."""
    import asyncio

    from elasticrun.rendezvous.keys import Keys
    from elasticrun.store.client.grpc_store import GrpcStore

    rdzv = Rdzv("c10d", c10d_store, RDZV_CONF + ",is_host=false", run_id())

    a = agent(cluster, rdzv, "a", 1, "1:2", shutdown_timeout=120)
    b = agent(cluster, rdzv, "b", 2, "1:2", shutdown_timeout=120, env={"TICK_SAVE_SECONDS": "60"})
    wait_world(rdzv, 2)
    b_id = f"{socket.gethostname()}_{b.pid}"
    command = subprocess.Popen(
        [*ELASTICRUN, "drain", "--node", b_id, "--timeout", "100", "--json",
         f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.run_id}", "--rdzv-conf=store_timeout=3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_world(rdzv, 1)  # b left; its worker saves for 60 s
        b.signal(signal.SIGKILL)
        out, err = command.communicate(timeout=90)
    finally:
        command.kill()
        command.wait()
    assert command.returncode == 0, err
    result = json.loads(out)
    assert (result["drained"], result["agent_ended"]) == ([], [b_id]), out

    async def drain_request() -> object:
        store = GrpcStore(rdzv.endpoint, timeout=10)
        try:
            return await store.get(Keys(rdzv.run_id).drain(b_id))
        finally:
            await store.close()

    assert asyncio.run(drain_request()) is None  # deleted for it: nothing left behind
    assert not Path(f"{cluster.stop_file}.saved.{b_id}").exists()  # its worker never finished saving
    cluster.stop_training()
    assert a.wait_exit() == 0
    cluster.assert_no_orphans()  # b's worker too: its warden stopped it


def test_a_piped_status_watch_prints_a_page_only_when_it_changed(cluster, c10d_store):
    """Workers' output moves the store many times a second; a piped watch prints a new
    page only when the job itself changed (once, then for the drain), never a copy."""
    rdzv = Rdzv("c10d", c10d_store, RDZV_CONF + ",is_host=false", run_id())
    agents = [agent(cluster, rdzv, n, i + 1, "1:2") for i, n in enumerate("ab")]
    wait_world(rdzv, 2)
    # the leader's line moves on from "formed" a moment after the round forms: a change
    # of the job, so the watch starts once it has settled
    wait_until(lambda: "round 1 running with 2 nodes" in ctl(rdzv, "status").stdout, what="the leader's settled line")
    watch = subprocess.Popen(
        [*ELASTICRUN, "status", "--watch", f"--rdzv-endpoint={rdzv.endpoint}",
         f"--rdzv-id={rdzv.run_id}"],
        stdout=subprocess.PIPE, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(watch.stdout or ()), daemon=True)
    reader.start()
    try:
        wait_until(lambda: any(line.startswith("JOB") for line in out), what="the first page")

        def ticks() -> int:
            return len(re.findall(r"tick=", ctl(rdzv, "logs", "--tail", "1000").stdout))

        seen = ticks()
        wait_until(lambda: ticks() >= seen + 20, what="20 more ticks: the store changed many times")
        before = [line for line in out if line.startswith("--- ")]
        assert ctl(rdzv, "drain", "--count", "1").returncode == 0
        wait_until(lambda: any(re.match(rf"{rdzv.run_id}\s+running\s+\d+\s+1\s", line) for line in out),
                   what="a page at world size 1")
    finally:
        watch.kill()
        watch.wait()
        reader.join(10)
    assert len(before) == 1, "".join(out)
    pages = "".join(out).split("--- ")[1:]
    unaged = [re.sub(r"\b\d+(m\d+)?s\b", "AGE", page.split("\n", 1)[1]) for page in pages]
    assert all(a != b for a, b in zip(unaged, unaged[1:], strict=False)), "".join(out)
    cluster.stop_training()
    for proc in agents:
        assert proc.wait_exit() == 0


def test_join_is_rolled_back_when_not_admitted(cluster, rdzv):
    agents = [agent(cluster, rdzv, n, i + 1, nnodes="1:2") for i, n in enumerate("ab")]
    wait_world(rdzv, 2)
    extra = ["--rdzv-conf=is_host=false,store_timeout=3"] if rdzv.backend == "c10d" else []
    done = ctl(rdzv, "join", "--timeout", "2", "--local-addr", "127.0.0.3", *extra, timeout=60,
               command=ticker_command(cluster))
    assert done.returncode != 0
    assert "no round of job" in done.stderr and "max 2 reached" in done.stderr
    assert len(status(rdzv)["nodes"]) == 2  # it left: no trace of it
    cluster.stop_training()
    for proc in agents:
        assert proc.wait_exit() == 0


def test_stop_ends_the_job_everywhere(cluster, rdzv, job):
    done = ctl(rdzv, "stop", "--timeout", "30")
    assert done.returncode == 0, done.stderr
    for proc in job:
        assert proc.wait_exit() == 0, proc.text()[-3000:]
        assert "worker got SIGTERM" not in proc.text()  # plain workers: no handler, but stopped
        assert "closed (stopped)" in proc.text()
    cluster.assert_no_orphans()
    after = status(rdzv)
    assert after["job"]["state"] == "stopped"
    # again, as a scheduler's clean-up step would: done already, said in one line
    again = ctl(rdzv, "stop", "--timeout", "30")
    assert again.returncode == 0 and again.stderr == "", again
    assert re.fullmatch(r"job '\S+' had already ended \(stopped: stopped by \S+\): nothing to stop\n", again.stdout)
    said = ctl(rdzv, "stop", "--json")
    assert said.returncode == 0 and json.loads(said.stdout)["already_ended"] == "stopped", said
    events = [
        json.loads(line) for p in (cluster.tmp / "logs").rglob("events.jsonl") for line in p.read_text().splitlines()
    ]
    assert {"healthy", "stopped"} <= {e["kind"] for e in events}


def test_unknown_job_and_bad_endpoint_give_one_line(cluster, rdzv):
    unknown = ctl(rdzv, "status", run_id="no-such-job")
    assert unknown.returncode == 2
    assert unknown.stderr.strip().splitlines() == [
        f"elasticrun: error: no job 'no-such-job' at {rdzv.endpoint} ({rdzv.backend}): "
        "check --rdzv-id and --rdzv-endpoint"
    ]
    bad = subprocess.run(
        [*ELASTICRUN, "status", "--rdzv-endpoint=host:abc", "--rdzv-id=x"],
        capture_output=True, text=True, timeout=30,
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


def list_jobs(rdzv: Rdzv, *flags: str) -> subprocess.CompletedProcess[str]:
    argv = [*ELASTICRUN, "list", *flags,
            f"--rdzv-backend={rdzv.backend}", f"--rdzv-endpoint={rdzv.endpoint}"]
    if rdzv.backend == "c10d":
        argv.append("--rdzv-conf=store_timeout=3")
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_list_shows_every_job_on_the_store_and_json_results(cluster, rdzv, job):
    """`list` finds this job (the store may hold other tests' jobs too) as a table row and
    as JSON; `logs`, `drain` and `stop` answer JSON with --json; `status --watch` piped
    writes no terminal codes."""
    listed = list_jobs(rdzv, "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["id"]: row for row in json.loads(listed.stdout)["jobs"]}
    mine = rows[rdzv.run_id]
    assert (mine["state"], mine["world_size"], mine["nodes"], mine["min_nodes"], mine["max_nodes"]) == (
        "running", 2, 2, 1, 3)
    assert mine["round"] >= 1 and mine["age_s"] >= 0
    table = list_jobs(rdzv).stdout.splitlines()
    assert table[0].split() == ["JOB", "STATE", "ROUND", "WORLD", "NODES", "AGE"]
    assert [line.split()[:2] for line in table if line.startswith(rdzv.run_id)] == [[rdzv.run_id, "running"]]

    watch = subprocess.Popen(
        [*ELASTICRUN, "status", "--watch", f"--rdzv-backend={rdzv.backend}",
         f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.run_id}"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert watch.stdout is not None
        first = [watch.stdout.readline() for _ in range(2)]
    finally:
        watch.kill()
        watch.wait()
    assert first[0].startswith("--- ") and first[1].startswith("JOB"), first
    assert "\033" not in "".join(first)

    wait_until(lambda: "[1]<stdout>: tick=" in ctl(rdzv, "logs").stdout, what="rank 1's lines", interval=0.3)
    lines = [json.loads(line) for line in ctl(rdzv, "logs", "--json", "--rank", "1").stdout.splitlines()]
    assert lines and {line["rank"] for line in lines} == {1} and lines[-1]["text"].startswith("tick=")

    newest = status(rdzv)["job"]["nodes"][-1]
    drained = ctl(rdzv, "drain", "--count", "1", "--json")
    assert drained.returncode == 0, drained.stderr
    assert json.loads(drained.stdout)["drained"] == [newest]
    wait_world(rdzv, 1)
    stopped = ctl(rdzv, "stop", "--json", "--timeout", "30")
    assert stopped.returncode == 0, stopped.stderr
    assert json.loads(stopped.stdout) == {"job": rdzv.run_id, "stopped": True, "nodes": 1, "store_gone": False}
    for proc in job:
        assert proc.wait_exit() == 0
    cluster.assert_no_orphans()
    after = {row["id"]: row for row in json.loads(list_jobs(rdzv, "--json").stdout)["jobs"]}
    assert after[rdzv.run_id]["state"] == "stopped"


# --- join repeats the harmless settings of the first node, and only its operator's command --


async def test_join_carries_the_harmless_settings_of_the_first_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spec's flags and the first node's own harmless ones (JobLaunch.flags) come back
    as the same configuration, through a real rendezvous writing its records; its
    --log-dir, --event-log-handler and working folder do not: they name files and code on
    the joining host, which only its operator chooses."""
    from elasticrun.launcher.assemble import build_config
    from elasticrun.launcher.cli import subcommand_parser
    from elasticrun.launcher.commands import join
    from elasticrun.launcher.control import JobTarget
    from elasticrun.launcher.flags import launch_parser
    from elasticrun.rendezvous.elastic import ElasticRendezvous
    from elasticrun.rendezvous.records import NodeInfo
    from elasticrun.store.server.memory import MemoryStore

    first_dir, join_dir = tmp_path / "first", tmp_path / "join"
    for folder in (first_dir, join_dir):
        folder.mkdir()
        (folder / "train.py").write_text("")
    monkeypatch.chdir(first_dir)
    first = build_config(launch_parser().parse_args([
        "--nnodes=1:3", "--nproc-per-node=2", "--max-restarts=2", "--role=trainer", "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29400", "--rdzv-id=job", "--rdzv-conf=heartbeat_timeout=7,is_host=false",
        "--shutdown-timeout=4", "--state-memory=512M", "--tee=0:3", "--redirects=1",
        "--signals-to-handle=SIGTERM,SIGUSR1",
        "--local-ranks-filter=0", "--health-interval=3", "--virtual-local-rank", f"--log-dir={tmp_path / 'logs'}",
        "--event-log-handler=console", "--progress-timeout=30", "--health-check=first node's check",
        "--run-path", "train.py", "--lr", "0.1",
    ]), {})
    store = MemoryStore()
    me = NodeInfo(node_id="a", host="h", addr="127.0.0.1", nproc=2, pid=1, started_at=0.0)
    flags = first.agent.carried_flags
    node = ElasticRendezvous(store, first.rdzv.settings, me, spec=first.job_spec, launch_flags=flags)
    try:
        await node._check_spec()  # stores the job's records, with this folder as the first node's
        monkeypatch.chdir(join_dir)
        target = JobTarget("c10d", "127.0.0.1:29400", "job", {"is_host": "false"}, first.rdzv.store)  # type: ignore[arg-type]
        monkeypatch.setattr(JobTarget, "open", lambda self: store)
        args = subcommand_parser().parse_args([
            "join", "--rdzv-endpoint=127.0.0.1:29400", "--rdzv-id=job", "--timeout=60", "--local-addr=127.0.0.5",
            "--health-check=test -d /scratch", "--health-check-timeout=5", "--run-path", "train.py", "--lr", "0.1",
        ])
        argv = await join.job_argv(target, args, {})
    finally:
        await node.aclose()
    joined = build_config(launch_parser().parse_args(argv), {})
    assert os.getcwd() == str(join_dir)
    assert joined.job_spec == first.job_spec
    w, f = joined.worker, first.worker
    carried = ("entrypoint", "nproc_per_node", "role", "max_restarts", "redirects", "tee", "progress_timeout",
               "in_process")
    assert {k: getattr(w, k) for k in carried} == {k: getattr(f, k) for k in carried}
    carried_options = ("stop_grace", "signals_to_handle", "local_ranks_filter", "isolate_gpus", "state_memory")
    assert {k: getattr(w.options, k) for k in carried_options} == {k: getattr(f.options, k) for k in carried_options}
    assert (w.options.stop_grace, w.options.isolate_gpus, joined.agent.health_interval) == (4.0, True, 3.0)
    assert w.options.state_memory == 512 << 20
    assert joined.rdzv.local_addr == "127.0.0.5" and joined.rdzv.settings.join_timeout == 60.0
    assert (w.options.log_dir, joined.agent.event_log_handler) == (None, "null")
    assert not any(a.startswith(("--log-dir", "--event-log-handler")) for a in argv), argv
    # a health check runs code: join's own only, never the first node's from the store
    assert (joined.agent.health_check, joined.agent.health_check_timeout) == ("test -d /scratch", 5.0)
    assert "first node's check" not in " ".join(argv)


def test_an_ended_job_keeps_its_nodes_and_last_lines_for_closed_ttl(cluster, rdzv, job):
    """A post-mortem: `status` and `logs` of a job that just ended tell what happened
    (the nodes' last reports outlive their membership by closed_ttl)."""
    wait_until(lambda: all(f"[{r}]<stdout>: tick=" in ctl(rdzv, "logs").stdout for r in (0, 1)),
               what="both ranks' lines in the store", interval=0.3)
    cluster.stop_training()
    for proc in job:
        assert proc.wait_exit() == 0, proc.text()[-3000:]
    ended = status(rdzv)
    assert ended["job"]["state"] == "succeeded" and ended["nodes"] == []
    assert sorted((n["node_rank"], n["state"]) for n in ended["ended_nodes"]) == [(0, "succeeded"), (1, "succeeded")]
    table = ctl(rdzv, "status").stdout.splitlines()
    rows = [line.split() for line in table if line.startswith(socket.gethostname() + "_")]
    assert sorted((row[3], row[1]) for row in rows) == [("0", "succeeded"), ("1", "succeeded")], table
    last = ctl(rdzv, "logs", "--rank", "1", "--tail", "1")
    assert last.returncode == 0 and re.fullmatch(r"\[1\]<stdout>: tick=\d+ rank=1 world=2\n", last.stdout), last


def test_a_watch_draws_the_last_page_when_the_store_goes_with_the_job(cluster):
    """The agent hosting the store exits once the others have left, and its store with
    it: the watch shows the job's end before it says so, and exits 0."""
    rdzv = Rdzv("c10d", f"127.0.0.1:{free_port()}", RDZV_CONF + ",is_host=false", run_id())
    host = Rdzv(rdzv.backend, rdzv.endpoint, RDZV_CONF + ",is_host=true", rdzv.run_id)
    agents = [agent(cluster, host, "a", 1, "2"), agent(cluster, rdzv, "b", 2, "2")]
    for proc in agents:
        proc.wait_for(r"tick=\d+ rank=\d world=2")
    watch = cluster.launch("watch", "status", "--watch", f"--rdzv-endpoint={rdzv.endpoint}",
        f"--rdzv-id={rdzv.run_id}", "--rdzv-conf=store_timeout=3")
    watch.wait_for(r"JOB\s+STATE")
    cluster.stop_training()
    for proc in agents:
        assert proc.wait_exit() == 0, proc.text()[-3000:]
    assert watch.wait_exit() == 0, watch.text()[-3000:]
    last = watch.text().rsplit("--- ", 1)[1]
    assert re.search(rf"^{rdzv.run_id}\s+succeeded\s", last, re.M), watch.text()[-3000:]
    assert len(re.findall(rf"^{socket.gethostname()}_\d+\s+succeeded\s+\S+\s+[01]\s", last, re.M)) == 2, last
    assert watch.text().rstrip().endswith(f"elasticrun: the store went away with the job ({rdzv.endpoint})")
