"""What an agent's own lines say, and how: real agents on the built-in store.

- While a node waits for a round it says what it waits for and how long it has waited,
  on each change and again every few seconds while nothing changes (a log shows a wait
  of minutes as it goes, not one line and then silence until join_timeout).
- Text lines carry an ISO date-time with its zone and the node id; `--log-format=json`
  makes every line of the agent's own one JSON object; neither writes terminal codes
  into a pipe.
"""

from __future__ import annotations

import json
import re
import signal

import pytest

from tests.elastic_cluster import RDZV_CONF, Cluster, Rdzv, run_id
from tests.test_elastic_agents import node_id, start

pytestmark = pytest.mark.timeout(120)

ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d"


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
