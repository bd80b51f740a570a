"""The status page, rendered from a job's records (no store): each row from one round."""

from __future__ import annotations

import re

from elasticrun.launcher.commands.status import render
from elasticrun.launcher.control import JobView
from elasticrun.rendezvous.records import NodeInfo, NodeStatus
from elasticrun.rendezvous.rounds import Participant, Round


def _status(node_id: str, round_number: int, node_rank: int, ranks: str) -> NodeStatus:
    return NodeStatus(
        node_id=node_id, host="h", addr="h", state="healthy", reason="", round=round_number, node_rank=node_rank,
        ranks=ranks, world_size=3, restarts=0, attempt=1, pids=(), gpus=(), started_at=0.0, updated_at=0.0,
    )


def test_a_row_takes_its_ranks_from_the_round_shown_not_from_a_report_of_another() -> None:
    """Round 3 has just re-formed without a: b's report still says round 2, where it was
    node rank 2 with rank 2; its row must say node rank 1, rank 1, and that its report is
    round 2's (the page once showed node rank 1 with ranks 2-2)."""
    members = (Participant("c", "h", 1), Participant("b", "h", 1))
    view = JobView(
        run_id="job", revision=9,
        round=Round(number=3, participants=members, restart_count=0, reason="lost a", opened_at=0.0),
        nodes={n: NodeInfo(node_id=n, host="h", addr="h", nproc=1, pid=1, started_at=0.0) for n in ("b", "c")},
        statuses={"c": _status("c", 3, 0, "0-0"), "b": _status("b", 2, 2, "2-2")},
    )
    rows = {line.split()[0]: line.split() for line in render(view, 0.0).splitlines() if re.match(r"[bc] ", line)}
    assert rows["c"][1:5] == ["healthy", "0s", "0", "0-0"]
    assert rows["b"][1:6] == ["healthy", "(round", "2)", "0s", "1"] and rows["b"][6] == "1-1", rows["b"]
