"""Prometheus metrics (`--metrics-port`) of real agents and of `elasticrun store serve`,
scraped over HTTP while a job scales up from 2 to 3 nodes: the counters move, the
gauges follow the job, and every metric documented in docs/deployment.md is exported
(and every exported one documented)."""

from __future__ import annotations

import asyncio
import re
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import elasticrun
from tests.support.elastic_cluster import RDZV_CONF, Cluster, Proc, run_id
from tests.support.helpers import ELASTICRUN, free_port, wait_until

pytestmark = pytest.mark.timeout(120)

TICKER = Path(__file__).resolve().parent / "workers" / "tick_worker.py"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "deployment.md"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """Every sample at http://127.0.0.1:port/metrics, by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    assert "\033" not in text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def at_world(samples: Samples, world: int) -> Samples | None:
    return samples if value(samples, "elasticrun_world_size") == world else None


def running_at_world(samples: Samples, world: int) -> Samples | None:
    """The samples once the world is `world` and the change's time to running was seen."""
    running = value(samples, "elasticrun_change_to_running_seconds_count") >= 1
    return at_world(samples, world) if running else None


def agent(cluster: Cluster, endpoint: str, rid: str, name: str, addr: int, port: int) -> Proc:
    return cluster.launch(name, "--nnodes=2:3", "--nproc-per-node=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rid}", f"--rdzv-conf={RDZV_CONF},is_host=false",
        f"--local-addr=127.0.0.{addr}", "--shutdown-timeout=5", f"--log-dir={cluster.tmp / 'logs'}",
        f"--metrics-port=127.0.0.1:{port}", "--health-check=echo ib0 up", "--health-interval=0.2",
        str(TICKER), "--stop-file", str(cluster.stop_file),
    )


def test_metrics_move_during_a_scale_up(cluster: Cluster) -> None:
    store_port, store_metrics = free_port(), free_port()
    store = cluster.launch("store", "store", "serve", "--host", "127.0.0.1", "--port", str(store_port),
        "--metrics-port", f"127.0.0.1:{store_metrics}",
    )
    store.wait_for(r"serving on")
    endpoint, rid = f"127.0.0.1:{store_port}", run_id()
    ports = {name: free_port() for name in "abc"}
    a, b = (agent(cluster, endpoint, rid, n, i + 2, ports[n]) for i, n in enumerate("ab"))
    for p in (a, b):
        p.wait_for(r"tick=\d+ rank=\d world=2")
    before = scrape(ports["a"])
    assert value(before, "elasticrun_world_size") == 2 and value(before, "elasticrun_nodes") == 2
    assert value(before, "elasticrun_rounds_total") >= 1
    assert value(before, "elasticrun_worker_state", state="healthy") == 1
    assert value(before, "elasticrun_worker_state", state="init") == 0
    assert value(before, "elasticrun_membership_changes_total", cause="scale_up") == 0
    assert value(before, "elasticrun_quarantined_nodes") == 0
    assert value(before, "elasticrun_health_checks_total", result="passed") >= 1  # before joining, at least
    assert value(before, "elasticrun_health_checks_total", result="failed") == 0
    assert value(before, "elasticrun_health_check_info", result="passed", reason="") == 1
    store_before = scrape(store_metrics)
    assert value(store_before, "elasticrun_store_leases") == 2  # one per agent
    assert value(store_before, "elasticrun_store_watchers") >= 2
    assert value(store_before, "elasticrun_store_connections") >= 2

    c = agent(cluster, endpoint, rid, "c", 4, ports["c"])
    c.wait_for(r"tick=\d+ rank=2 world=3")
    for name in "ab":
        # The world size moves when the round starts, the time to running once this
        # node's workers run in it: a scrape between the two saw the one, not the other.
        after = wait_until(
            lambda n=name: running_at_world(scrape(ports[n]), 3),
            what=f"{name}'s metrics at world 3, its workers running", interval=0.2,
        )
        assert value(after, "elasticrun_membership_changes_total", cause="scale_up") == 1
        assert value(after, "elasticrun_rounds_total") == value(before, "elasticrun_rounds_total") + 1
        assert value(after, "elasticrun_restarts_total", cause="worker_failure") == 0
        assert value(after, "elasticrun_worker_state", state="healthy") == 1
    store_after = scrape(store_metrics)
    assert value(store_after, "elasticrun_store_leases") == 3
    ok_puts = value(store_after, "elasticrun_store_calls_total", service="Store", method="Put", code="OK")
    assert ok_puts > value(store_before, "elasticrun_store_calls_total", service="Store", method="Put", code="OK")
    assert value(store_after, "elasticrun_store_history_revisions") > value(
        store_before, "elasticrun_store_history_revisions"
    )
    assert value(store_after, "elasticrun_store_revision") > value(store_before, "elasticrun_store_revision")

    [(_, info)] = [key for key in after if key[0] == "elasticrun_info"]
    nodes = {p.name.removeprefix(f"{rid}_") for p in (cluster.tmp / "logs").iterdir()}  # <run id>_<node id>
    assert dict(info)["node_id"] in nodes and len(nodes) == 3
    assert dict(info) == {"job_id": rid, "node_id": dict(info)["node_id"], "version": elasticrun.__version__}
    assert value(store_after, "elasticrun_info", address=f"127.0.0.1:{store_port}", version=elasticrun.__version__) == 1
    assert value(store_after, "elasticrun_store_key_bytes") > 0
    assert value(store_after, "elasticrun_store_value_bytes") > 0

    documented = set(re.findall(r"^\| `(elasticrun_\w+)`", DOCS.read_text(), flags=re.M))
    exported = {name for name, _ in [*store_after, *after]}
    families = {re.sub(r"_(total|bucket|count|sum)$", "", n) for n in exported if n.startswith("elasticrun_")}
    # the straggler scores have a series per node once its workers make steps (these
    # workers make none): tests/fault/test_straggler.py scrapes them
    assert families | {"elasticrun_straggler_score"} == {re.sub(r"_total$", "", d) for d in documented}

    cluster.stop_training()
    for p in (a, b, c):
        assert p.wait_exit() == 0, p.text()[-3000:]
    store.kill()
    cluster.assert_no_orphans()


def test_grafana_dashboard_queries_only_documented_metrics() -> None:
    """examples/grafana-dashboard.json parses and every query names exported metrics."""
    import json

    dashboard = json.loads((DOCS.parents[1] / "examples" / "grafana-dashboard.json").read_text())
    documented = {
        re.sub(r"_total$", "", d) for d in re.findall(r"^\| `(elasticrun_\w+)`", DOCS.read_text(), flags=re.M)
    }
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used |= {re.sub(r"_(total|bucket)$", "", m) for m in re.findall(r"elasticrun_\w+", target["expr"])}
    assert used and used <= documented, used - documented


def test_the_store_counts_key_and_value_bytes_apart() -> None:
    """elasticrun_store_key_bytes counts the keys' UTF-8 bytes, _value_bytes the values':
    an overwrite changes only the value's, a delete takes both."""
    from elasticrun.store.server.memory import MemoryStore

    async def run() -> list[tuple[int, int]]:
        store, seen = MemoryStore(), []
        for step in (store.put("ab", b"xyz"), store.put("ab", b"x"), store.put("\u00e9", b"12"), store.delete("ab")):
            await step
            seen.append((store.load().key_bytes, store.load().value_bytes))
        return seen

    assert asyncio.run(run()) == [(2, 3), (2, 1), (4, 3), (2, 2)]


def test_agent_metrics_tell_causes_apart() -> None:
    """The agent's hooks, fed the rounds of a job in order: each change lands under its
    cause, a restart is never counted as a membership change, and the time from a
    round's end to running again is observed once per change."""
    from elasticrun.agent.metrics import AgentMetrics
    from elasticrun.agent.spec import WorkerState
    from elasticrun.rendezvous.handler import Assignment

    m = AgentMetrics("job42", "host_7")
    assert m.registry.get_sample_value("elasticrun_info", {"job_id": "job42", "node_id": "host_7",
                                                          "version": elasticrun.__version__}) == 1

    def start(number: int, nodes: int, restarts: int = 0) -> None:
        m.round_started(Assignment(number, 0, nodes, 0, nodes, "127.0.0.1", 1, restarts))
        m.running()

    def count(name: str, **labels: str) -> float:
        return m.registry.get_sample_value(name, labels) or 0.0

    start(1, 2)
    m.round_over()
    start(2, 3)  # a node joined
    m.round_over(failure="worker_failure")  # ours failed: restarted, same members
    start(3, 3, restarts=1)
    m.round_over()
    start(4, 3, restarts=2)  # a worker failed elsewhere
    m.round_over()
    start(5, 2, restarts=2)  # a node left
    m.round_over()
    start(6, 2, restarts=2)  # one left, another came
    m.round_over(failure="hang")
    start(7, 2, restarts=3)
    m.state(WorkerState.HEALTHY)

    changes = {c: count("elasticrun_membership_changes_total", cause=c) for c in ("scale_up", "scale_down", "replace")}
    restarts = {c: count("elasticrun_restarts_total", cause=c) for c in ("worker_failure", "hang", "peer_failure")}
    assert changes == {"scale_up": 1, "scale_down": 1, "replace": 1}
    assert restarts == {"worker_failure": 1, "hang": 1, "peer_failure": 1}
    assert count("elasticrun_rounds_total") == 7 and count("elasticrun_round") == 7
    assert count("elasticrun_change_to_running_seconds_count") == 6
    assert count("elasticrun_worker_state", state="healthy") == 1
    assert count("elasticrun_worker_state", state="init") == 0


def test_the_time_to_the_first_step_after_a_change_is_its_own() -> None:
    """Starting the processes takes milliseconds; their imports and joining the
    collective are where a change's time goes: the first step after it has a histogram."""
    from elasticrun.agent.metrics import AgentMetrics
    from elasticrun.rendezvous.handler import Assignment
    from elasticrun.rendezvous.records import StepReport

    m = AgentMetrics("job42", "host_7")

    def step(number: int, steps: int) -> None:
        m.steps(StepReport("host_7", number, steps, 0.1, 0.1, 0, "optimizer"))

    def first_steps() -> float:
        return m.registry.get_sample_value("elasticrun_change_to_first_step_seconds_count") or 0.0

    m.round_started(Assignment(1, 0, 2, 0, 2, "127.0.0.1", 1, 0))
    m.running()
    step(1, 5)
    assert first_steps() == 0  # the job's first start is no change
    m.round_over()
    m.round_started(Assignment(2, 0, 3, 0, 3, "127.0.0.1", 1, 0))
    m.running()
    step(1, 6)  # a late report of the old round
    step(2, 0)
    assert first_steps() == 0
    step(2, 1)
    step(2, 2)
    assert first_steps() == 1
    assert m.registry.get_sample_value("elasticrun_change_to_running_seconds_count") == 1


def test_metrics_port_is_part_of_the_launch_configuration() -> None:
    """--metrics-port reaches the LaunchConfig (so the CLI, `join` and `elasticrun.launch`
    serve metrics alike), a bad one is a usage line, and parsing it loads no prometheus_client."""
    import subprocess

    code = (
        "import sys\n"
        "from elasticrun.launcher.assemble import build_config\n"
        "from elasticrun.launcher.flags import launch_parser\n"
        "args = launch_parser().parse_args(['--standalone', '--metrics-port', '127.0.0.1:9464', sys.argv[1]])\n"
        "print(build_config(args, {}).agent.metrics, 'prometheus_client' in sys.modules)\n"
    )
    script = Path(__file__).parent / "workers" / "cli_speak.py"
    out = subprocess.run([sys.executable, "-c", code, str(script)], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "MetricsAddress(host='127.0.0.1', port=9464) False", out.stderr
    bad = subprocess.run(
        [*ELASTICRUN, "--standalone", "--metrics-port", "99999", str(script)],
        capture_output=True, text=True, timeout=60,
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "elasticrun: error: --metrics-port takes PORT or HOST:PORT with a port within 0..65535 (0: a free one), "
        "got '99999'"
    ], bad.stderr


def test_metrics_port_0_takes_a_free_port_and_says_which(cluster: Cluster) -> None:
    """Many agents on one host each serve their metrics without a port chosen by hand."""
    script = cluster.tmp / "wait.py"
    script.write_text(
        "import sys, time\nfrom pathlib import Path\n"
        "while not Path(sys.argv[1]).exists():\n    time.sleep(0.05)\n"
    )
    agent = cluster.launch("agent", "--standalone", "--metrics-port=127.0.0.1:0", str(script), str(cluster.stop_file))
    said = agent.wait_for(r"metrics on (http://127\.0\.0\.1:(\d+)/metrics)")
    assert int(said.group(2)) > 0
    agent.wait_for(r"workers init -> healthy")
    with urllib.request.urlopen(said.group(1), timeout=30) as page:
        assert "elasticrun_worker_state" in page.read().decode()
    cluster.stop_training()
    assert agent.wait_exit() == 0, agent.text()[-3000:]


def test_an_agent_that_hosts_no_store_exports_no_store_metric(cluster: Cluster, c10d_store: str) -> None:
    script = cluster.tmp / "wait.py"
    script.write_text(
        "import sys, time\nfrom pathlib import Path\n"
        "while not Path(sys.argv[1]).exists():\n    time.sleep(0.05)\n"
    )
    port = free_port()
    agent = cluster.launch(
        "agent", "--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={c10d_store}", f"--rdzv-id={run_id()}",
        "--rdzv-conf=is_host=false,last_call_timeout=0.1", f"--metrics-port=127.0.0.1:{port}",
        str(script), str(cluster.stop_file),
    )
    agent.wait_for(r"workers init -> healthy")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as page:
        text = page.read().decode()
    assert "elasticrun_worker_state" in text
    assert "elasticrun_store_" not in text, [ln for ln in text.splitlines() if "elasticrun_store_" in ln]
    cluster.stop_training()
    assert agent.wait_exit() == 0, agent.text()[-3000:]
