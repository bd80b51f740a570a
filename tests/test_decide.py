"""The leader's round decision, tested as the pure function it is: no store, no sleeping."""

from __future__ import annotations

from elasticrun.rendezvous.decide import Decision, RendezvousSettings, SeenNode, View, decide
from elasticrun.rendezvous.state import NodeInfo, Participant, RestartRequest, Round

SETTINGS = RendezvousSettings(run_id="job", min_nodes=2, max_nodes=3, last_call=1.0)


def node(name: str, seen_at: float = 0.0, nproc: int = 1) -> SeenNode:
    info = NodeInfo(node_id=name, host="h", addr=f"addr-{name}", nproc=nproc, pid=1, started_at=0.0)
    return SeenNode(info=info, seen_at=seen_at)


def nodes(*seen: SeenNode) -> dict[str, SeenNode]:
    return {n.info.node_id: n for n in seen}


def running(*names: str, number: int = 1, restarts: int = 0) -> Round:
    return Round(
        number=number,
        participants=tuple(Participant(n, f"addr-{n}", 1) for n in names),
        restart_count=restarts,
        reason="",
        opened_at=0.0,
    )


def members(decision: Decision) -> list[str]:
    assert decision.round is not None, decision.reason
    return [p.node_id for p in decision.round.participants]


def test_waits_below_min_and_names_who_is_there():
    d = decide(View(nodes=nodes(node("a")), round=None), SETTINGS, now=10.0)
    assert d.round is None
    assert d.reason == "waiting for nodes: 1 of min 2 registered (max 3): a"
    assert d.recheck_at is None


def test_last_call_after_min_then_forms_in_arrival_order():
    view = View(nodes=nodes(node("b", 5.0), node("a", 5.5)), round=None)
    early = decide(view, SETTINGS, now=6.0)
    assert early.round is None and early.recheck_at == 6.5
    assert "last call" in early.reason
    formed = decide(view, SETTINGS, now=6.5)
    assert members(formed) == ["b", "a"]
    assert formed.round is not None and formed.round.number == 1


def test_forms_at_once_when_max_is_reached():
    view = View(nodes=nodes(node("a", 5.0), node("b", 5.0), node("c", 5.0), node("d", 5.0)), round=None)
    d = decide(view, SETTINGS, now=5.0)
    assert members(d) == ["a", "b", "c"]


def test_running_round_with_nothing_new_waits():
    d = decide(View(nodes=nodes(node("a"), node("b")), round=running("a", "b")), SETTINGS, now=100.0)
    assert d.round is None and d.reason == "round 1 running with 2 nodes"


def test_scale_up_after_last_call_keeps_survivor_ranks():
    roomy = RendezvousSettings(run_id="job", min_nodes=2, max_nodes=4, last_call=1.0)
    view = View(nodes=nodes(node("b"), node("a"), node("c", 50.0)), round=running("b", "a", number=4))
    assert decide(view, roomy, now=50.5).round is None
    d = decide(view, roomy, now=51.0)
    assert members(d) == ["b", "a", "c"]
    assert d.round is not None and d.round.number == 5 and d.round.restart_count == 0


def test_full_job_leaves_newcomers_waiting():
    view = View(nodes=nodes(node("a"), node("b"), node("c"), node("d", 9.0)), round=running("a", "b", "c"))
    d = decide(view, SETTINGS, now=100.0)
    assert d.round is None and "1 waiting, max 3 reached" in d.reason


def test_lost_node_ends_round_at_once_and_admits_waiting():
    view = View(nodes=nodes(node("a"), node("c"), node("d", 99.9)), round=running("a", "b", "c", number=2, restarts=1))
    d = decide(view, SETTINGS, now=100.0)
    assert members(d) == ["a", "c", "d"]
    assert d.round is not None and d.round.restart_count == 1  # membership never uses the budget
    assert d.reason.startswith("lost b")


def test_too_few_after_loss_writes_an_empty_round():
    view = View(nodes=nodes(node("a")), round=running("a", "b"))
    d = decide(view, SETTINGS, now=100.0)
    assert members(d) == []
    assert "lost b" in d.reason and "1 of min 2" in d.reason


def test_replacement_reforms_fixed_size_job():
    fixed = RendezvousSettings(run_id="job", min_nodes=2, max_nodes=2, last_call=1.0)
    empty = Round(number=3, participants=(), restart_count=2, reason="lost b", opened_at=0.0)
    view = View(nodes=nodes(node("a", 1.0), node("x", 100.0)), round=empty)
    d = decide(view, fixed, now=100.0)
    assert members(d) == ["a", "x"]
    assert d.round is not None and d.round.number == 4 and d.round.restart_count == 2


def test_restart_request_counts_against_budget_once_every_node_is_alive():
    request = RestartRequest(round=7, node_id="b", reason="exit code 1")
    view = View(
        nodes=nodes(node("a"), node("b")),
        round=running("a", "b", number=7, restarts=2),
        restart=request,
        restart_seen_at=10.0,
        acks=frozenset({"a", "b"}),
    )
    d = decide(view, SETTINGS, now=10.1)
    assert members(d) == ["a", "b"]
    assert d.round is not None and d.round.restart_count == 3
    assert "worker failure on b" in d.reason
    stale = View(nodes=view.nodes, round=view.round, restart=RestartRequest(6, "b", "old"), acks=view.acks)
    assert decide(stale, SETTINGS, now=10.1).round is None


def test_restart_waits_for_every_node_to_show_it_is_alive():
    ttl = SETTINGS.heartbeat_ttl
    view = View(
        nodes=nodes(node("a"), node("b")),
        round=running("a", "b", number=7, restarts=2),
        restart=RestartRequest(round=7, node_id="b", reason="collective failed"),
        restart_seen_at=10.0,
        acks=frozenset({"b"}),
    )
    d = decide(view, SETTINGS, now=10.1)
    assert d.round is None and d.ping == 7 and d.recheck_at == 10.0 + ttl
    assert "no answer yet from a" in d.reason
    # a silent node that still holds its lease when the time is up: a real failure
    late = decide(view, SETTINGS, now=10.0 + ttl)
    assert late.round is not None and late.round.restart_count == 3


def test_a_peer_that_died_makes_the_failure_free():
    view = View(
        nodes=nodes(node("b")),  # a's lease expired while the leader waited for its answer
        round=running("a", "b", number=7, restarts=2),
        restart=RestartRequest(round=7, node_id="b", reason="collective failed"),
        restart_seen_at=10.0,
        acks=frozenset({"b"}),
    )
    d = decide(view, RendezvousSettings(run_id="job", min_nodes=1, max_nodes=3), now=11.0)
    assert members(d) == ["b"]
    assert d.round is not None and d.round.restart_count == 2 and d.reason.startswith("lost a")


def test_closed_job_opens_nothing():
    closed = Round(number=2, participants=(), restart_count=0, reason="", opened_at=0.0, closed="succeeded")
    d = decide(View(nodes=nodes(node("a"), node("b")), round=closed), SETTINGS, now=0.0)
    assert d.round is None and d.reason == "job succeeded"
