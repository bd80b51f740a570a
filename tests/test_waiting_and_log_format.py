"""What an agent's own lines say, and how: real agents on the built-in store.

- Every line states what is true at that moment. The walk through a job's states
  (formed, joined with room, drained, stopped; a final failure; the store's host lost)
  checks the lines a user reads at the default level, in order, and the detailed
  (LOGLEVEL=INFO) lines of the node whose view is the tricky one: a node joining a job
  with room is no spare, survivors call a drained node drained, after the job's end
  nobody waits for a round or leads.
- A job that goes well says little (two lines), as under torchrun; LOGLEVEL=INFO
  shows the rest, LOGLEVEL=WARNING nothing.
- While a node waits for a round it says what it waits for and how long it has waited,
  on each change and again every few seconds while nothing changes (a log shows a wait
  of minutes as it goes, not one line and then silence until join_timeout).
- Text lines carry an ISO date-time with its zone and the node id; `--log-format=json`
  makes every line of the agent's own one JSON object, the final error line included;
  neither writes terminal codes into a pipe.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support.elastic_cluster import RDZV_CONF, WORKER, Cluster, Proc, Rdzv, run_id
from tests.support.helpers import ELASTICRUN, free_port
from tests.test_elastic_agents import node_id, start

pytestmark = pytest.mark.timeout(120)

ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d"
TICKER = Path(__file__).resolve().parent / "workers" / "tick_worker.py"
#: the last call lasts long enough that a joining node's first line comes before it ends;
#: a lease outlasts a loaded machine's pauses (a lost membership would change the lines)
WALK_CONF = RDZV_CONF.replace("last_call_timeout=0.5", "last_call_timeout=2").replace(
    "heartbeat_timeout=2", "heartbeat_timeout=6"
)


def healthy(number: int, nodes: int, ranks: str = r"(\d)-\1", world: int | None = None) -> str:
    """A round's start, as each node says it (one worker a node unless `ranks` says)."""
    return (
        rf"workers init -> healthy: round {number}: node rank \d/{nodes}, ranks {ranks} of {world or nodes}, "
        r"restart 0/0, master [\w.]+:\d+"
    )


def own_lines(agent: Proc) -> list[tuple[str, str]]:
    """(level, message) of each of the agent's own lines (not its workers')."""
    return [(m[1], m[2]) for m in re.finditer(rf"^\[elasticrun {ISO} (\w+) \S+\] (.*)$", agent.text(), re.M)]


def walker(cluster: Cluster, name: str, addr: int, endpoint: str, job: str, nnodes: str, *,
           level: str | None = None, env: dict[str, str] | None = None, worker: Path = TICKER,
           conf: str = WALK_CONF + ",is_host=false", worker_args: list[str] | None = None) -> Proc:
    """An agent at the default level (LOGLEVEL unset) or at `level`."""
    saved = dict(cluster._env)
    cluster._env.pop("LOGLEVEL")
    cluster._env.update({"LOGLEVEL": level} if level else {}, **(env or {}))
    try:
        return cluster.agent(name, backend="c10d", endpoint=endpoint, run_id=job, local_addr=f"127.0.0.{addr}",
                             nnodes=nnodes, conf=conf, worker=worker, worker_args=worker_args or [])
    finally:
        cluster._env = saved


def control(command: str, endpoint: str, job: str, *args: str) -> None:
    done = subprocess.run(
        [*ELASTICRUN, command, *args, "--rdzv-backend=c10d",
         f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}", "--timeout=60"],
        capture_output=True, text=True, timeout=90,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def assert_lines(agent: Proc, expected: list[str]) -> None:
    """The agent's own lines at the default level are these (regexes), in this order."""
    got = [message for _, message in own_lines(agent)]
    assert len(got) == len(expected) and all(re.fullmatch(e, g) for e, g in zip(expected, got, strict=True)), (
        "\n".join(["expected:", *expected, "got:", *got])
    )


def test_the_lines_of_a_job_joined_with_room_drained_and_stopped_are_true(
    cluster: Cluster, c10d_store: str
) -> None:
    job = run_id()
    # max 4, not 3: a newcomer that fills max is added at once, without a last call, and
    # the leader's round would then race c's first line (it did once in CI, by ms)
    a, b = (walker(cluster, n, i, c10d_store, job, "2:4") for n, i in (("a", 2), ("b", 3)))
    for p in (a, b):
        p.wait_for(r"tick=2 rank=\d world=2")
    c = walker(cluster, "c", 4, c10d_store, job, "2:4", level="INFO")
    joining = c.wait_for(r"node \S+ waiting: (.*); waits as long as the job runs$")[1]
    # round 1 runs 2 of max 4: c is no spare, it joins at the next round (which the
    # leader may have opened already, after the last call, when c first says so)
    room = r"not in round 1 \(2 of max 4 nodes\): the leader adds it after the last call(; the leader: .*)?"
    opened = r"round 2 opened: reading this node's place in it"
    assert re.fullmatch(room, joining) or re.fullmatch(opened, joining), joining
    for p in (a, b, c):
        p.wait_for(r"tick=2 rank=\d world=3")
    marks = {p.name: p.mark() for p in (a, b)}
    control("drain", c10d_store, job, "--node", node_id(c))
    assert c.wait_exit() == 0
    for p in (a, b):
        p.wait_for(r"tick=2 rank=\d world=2", start=marks[p.name])
    control("stop", c10d_store, job)
    for p in (a, b):
        assert p.wait_exit() == 0, p.text()[-3000:]

    me = re.escape(node_id(c))
    for p in (a, b):  # what a user reads, at the default level
        assert_lines(p, [
            healthy(1, 2),
            rf"workers healthy -> stopped: round 2: scale up to 3 nodes; joined: {me}",
            healthy(2, 3),
            rf"workers healthy -> stopped: round 3: drained {me}",  # not "lost"
            healthy(3, 2),
            rf"workers healthy -> stopped: rendezvous '{job}' is closed \(stopped\): stopped by \S+",
        ])
    said = [message for _, message in own_lines(c)]
    assert not [m for m in said if "spare" in m], said
    leaving = re.fullmatch(rf"node {me} leaving job '{job}': drained: requested by (\S+)", said[-2])
    assert leaving and said[-1] == f"workers healthy -> stopped: drained: requested by {leaving[1]}", said
    cluster.assert_no_orphans()


def test_the_lines_of_a_job_that_fails_are_true(cluster: Cluster, c10d_store: str) -> None:
    job = run_id()
    script = cluster.tmp / "fail_here.py"
    script.write_text(
        "import os, runpy\n"
        "if os.environ.get('FAIL_HERE'):\n"
        "    raise SystemExit('worker failed on purpose')\n"
        f"runpy.run_path({str(TICKER)!r}, run_name='__main__')\n"
    )
    ok = walker(cluster, "ok", 2, c10d_store, job, "2", worker=script)
    bad = walker(cluster, "bad", 3, c10d_store, job, "2", worker=script, level="INFO", env={"FAIL_HERE": "1"})
    for p in (ok, bad):
        assert p.wait_exit() == 1, p.text()[-3000:]

    report = r"={72}"  # the failure report's first line; the rest follows on lines of its own
    assert_lines(ok, [
        healthy(1, 2),
        rf"workers healthy -> failed: rendezvous '{job}' is closed \(failed\): {report}",
    ])
    failed = r"worker rank (\d) failed with exit code 1"
    said = own_lines(bad)
    start = next(i for i, (_, m) in enumerate(said) if re.match(failed, m))
    after = said[start:]
    assert re.fullmatch(
        failed + r"; no restarts left \(--max-restarts=0\): asking the leader to end the job, unless it finds "
        r"a node was lost", after[0][1]
    ), after
    assert after[0][0] == "INFO"  # not shown by default: the leader has not decided yet
    # what it waits for now is the leader's verdict, not a round that ended
    asked = ("asked the leader to end the job (a worker failed here, no restarts left), unless it finds a "
             "node died meanwhile")
    waits = [m for _, m in after if " -> init: " in m or " waiting: " in m]
    assert waits and all(asked in m for m in waits), waits
    assert not [m for _, m in after if "formed with" in m or "leads job" in m], after
    (error,) = [i for i, (level, _) in enumerate(after) if level == "ERROR"]  # the report, once
    assert re.fullmatch(report, after[error][1]), after
    (end,) = [i for i, (level, _) in enumerate(after) if level == "WARNING" and "workers" in after[i][1]]
    assert end > error and re.fullmatch(
        r"workers init -> failed: " + failed + r"; no restarts left \(--max-restarts=0\)", after[end][1]
    ), after
    cluster.assert_no_orphans()


def test_a_survivor_of_a_lost_node_says_so_once_and_not_that_the_job_ends(cluster: Cluster, c10d_store: str) -> None:
    """With --max-restarts=0, the survivor's workers fail as their peer dies: that is
    the leader's to judge (a node died: a new round, for free), so the default lines
    name the lost node once and never say the job ends."""
    job, broken = run_id(), ["--broken-wait", "0"]  # a broken collective fails the worker
    a, b = (walker(cluster, n, i, c10d_store, job, "1:2", worker=WORKER, worker_args=broken)
            for n, i in (("a", 2), ("b", 3)))
    for p in (a, b):
        p.wait_for(r"step=2 rank=\d world=2")
    mark = len(own_lines(a))
    b.signal(signal.SIGKILL)
    a.wait_for(r"workers init -> healthy: round \d+: node rank 0/1")
    after = [m for _, m in own_lines(a)[mark:]]
    lost = re.escape(node_id(b))
    assert len([m for m in after if re.search(lost, m)]) == 1, after
    assert not [m for m in after if "job ends" in m or "no restarts left" in m], after
    cluster.stop_training()
    assert a.wait_exit() == 0, a.text()[-3000:]
    cluster.assert_no_orphans()


def test_a_lone_agent_at_the_store_it_hosts_says_the_endpoint_may_be_wrong(cluster: Cluster) -> None:
    """Agents given different ports on the endpoint's host each host a store and would
    wait out join_timeout alone, in silence."""
    job, endpoint = run_id(), f"127.0.0.1:{free_port()}"
    conf = WALK_CONF.replace("join_timeout=60", "join_timeout=4") + ",is_host=true"
    lone = walker(cluster, "lone", 1, endpoint, job, "2", conf=conf)
    assert lone.wait_exit() == 200, lone.text()[-3000:]  # join_timeout: the infrastructure's
    warned = [m for level, m in own_lines(lone) if level == "WARNING" and "nobody else registered" in m]
    assert warned == [
        f"node {node_id(lone)}: nobody else registered in 2s at the store this agent hosts on {endpoint}; if the "
        "other nodes were given another --rdzv-endpoint (a mistyped port), each hosts a store of its own "
        "and waits alone"
    ], lone.text()[-3000:]


def test_survivors_of_a_lost_store_host_claim_no_round(cluster: Cluster) -> None:
    job, endpoint = run_id(), f"127.0.0.1:{free_port()}"
    host = walker(cluster, "host", 1, endpoint, job, "2", conf=WALK_CONF + ",is_host=true")
    host.wait_for(r"hosting the rendezvous store on")
    # no new host comes: the survivor waits store_host_grace for one, then ends
    survivor = walker(cluster, "survivor", 2, endpoint, job, "2", conf=WALK_CONF + ",is_host=false,store_host_grace=2")
    for p in (host, survivor):
        p.wait_for(r"tick=2 rank=\d world=2")
    host.kill()
    assert survivor.wait_exit() != 0
    me, store = re.escape(node_id(survivor)), re.escape(endpoint)
    lost = rf"node {me} lost its membership: .*store at {store} is unreachable: .*"
    waits = (
        rf"node {me} waiting: the store at {store} \(hosted by the agent on 127\.0\.0\.1\) refused a connection: "
        r"waiting until \d\d:\d\d:\d\d \(store_host_grace=2s\) for a new store there; \d s left"
    )
    assert_lines(survivor, [healthy(1, 2), lost, "workers healthy -> stopped: " + lost, waits])
    assert re.search(rf"^elasticrun: error: store at {re.escape(endpoint)} is unreachable", survivor.text(), re.M)
    cluster.assert_no_orphans()


def test_a_job_that_goes_well_says_little(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello from', os.environ['RANK'])\n")

    def run(*flags: str, **env: str) -> subprocess.CompletedProcess[str]:
        clean = {k: v for k, v in os.environ.items() if k not in ("LOGLEVEL", "ELASTICRUN_LOG_FORMAT")}
        return subprocess.run(
            [*ELASTICRUN, "--standalone", "--nproc-per-node=2", *flags, str(script)],
            capture_output=True, text=True, timeout=60, env={**clean, **env},
        )

    quiet = run()
    assert quiet.returncode == 0, quiet.stderr
    assert sorted(quiet.stdout.splitlines()) == ["[0]<stdout>: hello from 0", "[1]<stdout>: hello from 1"]
    lines = [m[1] for m in re.finditer(rf"^\[elasticrun {ISO} INFO \S+\] (.*)$", quiet.stderr, re.M)]
    assert len(lines) == len(quiet.stderr.splitlines()) == 2, quiet.stderr  # torchrun: none
    assert re.fullmatch(healthy(1, 1, ranks="0-1", world=2), lines[0]), lines[0]
    assert lines[1] == "workers healthy -> succeeded: all workers succeeded"
    detailed = run(LOGLEVEL="INFO")
    assert len(detailed.stderr.splitlines()) > 2 and "leads job" in detailed.stderr
    assert run(LOGLEVEL="WARNING").stderr == ""

    missing = run("--log-format=json", "--max-restarts=-1")
    (line,) = missing.stderr.splitlines()  # the error, as JSON like every other line
    record = json.loads(line)
    assert missing.returncode == 2 and record["level"] == "ERROR"
    assert record["message"] == "--max-restarts must be >= 0, got -1"

    # in JSON, the workers' lines are JSON too: a log pipeline reads every line of both streams
    both = run("--log-format=json", LOGLEVEL="INFO")
    assert both.returncode == 0, both.stderr
    records = [json.loads(line) for line in (both.stdout + both.stderr).splitlines()]
    said = sorted((r["rank"], r["stream"], r["text"]) for r in records if "rank" in r)
    assert said == [(0, "stdout", "hello from 0"), (1, "stdout", "hello from 1")], records
    assert all(re.fullmatch(ISO, r["time"]) and r["node"] for r in records), records


def test_a_waiting_node_says_what_it_waits_for_and_how_long(cluster: Cluster, c10d_store: str) -> None:
    rdzv = Rdzv("c10d", c10d_store, RDZV_CONF + ",is_host=false", run_id())
    a = start(cluster, rdzv, "a", 2, "3:4")
    me = node_id(a)
    waiting = rf"\[elasticrun {ISO} INFO {me}\] node {me} waiting: waiting for nodes: 1 of min 3 registered \(max 4\)"
    a.wait_for(waiting + r": [^;]+; 0 s of join_timeout 60 s$")
    # nothing changes: the same line again, a few seconds on
    later = a.wait_for(waiting + r": [^;]+; (\d+) s of join_timeout 60 s$", count=2)
    assert int(later.group(1)) >= 4

    b = start(cluster, rdzv, "b", 3, "3:4", extra=("--log-format=json",))
    # a change is said at once, by both nodes
    a.wait_for(rf"node {me} waiting: waiting for nodes: 2 of min 3 registered \(max 4\)")
    line = b.wait_for(r'^\{.*"message": "node [^ ]+ waiting: waiting for nodes: 2 of min 3 .*\}$').group(0)
    record = json.loads(line)
    assert record["node"] == node_id(b) and record["level"] == "INFO" and record["logger"] == "elasticrun.rendezvous"
    assert re.fullmatch(ISO, record["time"])
    for p in (a, b):
        p.signal(signal.SIGTERM)
        p.wait_exit()
    own = [ln for ln in b.text().splitlines() if not ln.startswith("[")]  # not a worker's line
    assert own and all(json.loads(ln)["node"] == node_id(b) for ln in own)
    assert all("\033" not in p.text() for p in (a, b))
    cluster.assert_no_orphans()
