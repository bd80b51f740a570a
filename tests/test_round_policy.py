"""The leader's round decision, tested as the pure function it is: no store, no sleeping."""

from __future__ import annotations

from dataclasses import replace

from elasticrun.rendezvous.records import (
    NodeInfo,
    QuarantineEntry,
    QuarantineTable,
    RestartRequest,
    Successor,
    Successors,
)
from elasticrun.rendezvous.round_policy import decide_round
from elasticrun.rendezvous.rounds import Participant, Round
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.rendezvous.view import Decision, SeenNode, View

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
    d = decide_round(View(nodes=nodes(node("a")), round=None), SETTINGS, now=10.0)
    assert d.round is None
    assert d.reason == "waiting for nodes: 1 of min 2 registered (max 3): a"
    assert d.recheck_at is None


def test_last_call_after_min_then_forms_in_arrival_order():
    view = View(nodes=nodes(node("b", 5.0), node("a", 5.5)), round=None)
    early = decide_round(view, SETTINGS, now=6.0)
    assert early.round is None and early.recheck_at == 6.5
    assert "last call" in early.reason
    formed = decide_round(view, SETTINGS, now=6.5)
    assert members(formed) == ["b", "a"]
    assert formed.round is not None and formed.round.number == 1


def test_forms_at_once_when_max_is_reached():
    view = View(nodes=nodes(node("a", 5.0), node("b", 5.0), node("c", 5.0), node("d", 5.0)), round=None)
    d = decide_round(view, SETTINGS, now=5.0)
    assert members(d) == ["a", "b", "c"]


def test_running_round_with_nothing_new_waits():
    d = decide_round(View(nodes=nodes(node("a"), node("b")), round=running("a", "b")), SETTINGS, now=100.0)
    assert d.round is None and d.reason == "round 1 running with 2 nodes"


def test_scale_up_after_last_call_keeps_survivor_ranks():
    roomy = RendezvousSettings(run_id="job", min_nodes=2, max_nodes=4, last_call=1.0)
    view = View(nodes=nodes(node("b"), node("a"), node("c", 50.0)), round=running("b", "a", number=4))
    assert decide_round(view, roomy, now=50.5).round is None
    d = decide_round(view, roomy, now=51.0)
    assert members(d) == ["b", "a", "c"]
    assert d.round is not None and d.round.number == 5 and d.round.restart_count == 0


def test_full_job_leaves_newcomers_waiting():
    view = View(nodes=nodes(node("a"), node("b"), node("c"), node("d", 9.0)), round=running("a", "b", "c"))
    d = decide_round(view, SETTINGS, now=100.0)
    assert d.round is None and "1 spare, max 3 reached" in d.reason


#: why a member whose registration vanished is lost
LAPSED = "its lease lapsed, no heartbeat: dead, frozen or cut off from the store"


def test_lost_node_ends_round_at_once_and_admits_waiting():
    view = View(nodes=nodes(node("a"), node("c"), node("d", 99.9)), round=running("a", "b", "c", number=2, restarts=1))
    d = decide_round(view, SETTINGS, now=100.0)
    assert members(d) == ["a", "d", "c"]  # d takes b's node rank: c keeps its own
    assert d.round is not None and d.round.restart_count == 1  # membership never uses the budget
    assert d.reason.startswith(f"lost b ({LAPSED})")  # and why: a bare "lost" names no cause


def test_too_few_after_loss_writes_an_empty_round():
    view = View(nodes=nodes(node("a")), round=running("a", "b"))
    d = decide_round(view, SETTINGS, now=100.0)
    assert members(d) == []
    assert "lost b" in d.reason and "1 of min 2" in d.reason


def test_replacement_reforms_fixed_size_job():
    fixed = RendezvousSettings(run_id="job", min_nodes=2, max_nodes=2, last_call=1.0)
    empty = Round(number=3, participants=(), restart_count=2, reason="lost b", opened_at=0.0)
    view = View(nodes=nodes(node("a", 1.0), node("x", 100.0)), round=empty)
    d = decide_round(view, fixed, now=100.0)
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
    d = decide_round(view, SETTINGS, now=10.1)
    assert members(d) == ["a", "b"]
    assert d.round is not None and d.round.restart_count == 3
    assert "worker failure on b" in d.reason
    stale = View(nodes=view.nodes, round=view.round, restart=RestartRequest(6, "b", "old"), acks=view.acks)
    assert decide_round(stale, SETTINGS, now=10.1).round is None


def test_restart_waits_for_every_node_to_show_it_is_alive():
    ttl = SETTINGS.heartbeat_ttl
    view = View(
        nodes=nodes(node("a"), node("b")),
        round=running("a", "b", number=7, restarts=2),
        restart=RestartRequest(round=7, node_id="b", reason="collective failed"),
        restart_seen_at=10.0,
        acks=frozenset({"b"}),
    )
    d = decide_round(view, SETTINGS, now=10.1)
    assert d.round is None and d.ping == 7 and d.recheck_at == 10.0 + ttl
    assert "no answer yet from a" in d.reason
    # silent for a whole lease TTL and still registered (etcd expires leases late): dead,
    # so the round goes on without it, for free
    late = decide_round(view, SETTINGS, now=10.0 + ttl)
    assert late.round is not None and "a" not in members(late)
    assert late.round.restart_count == 2 and late.reason.startswith("lost a")
    assert late.dead == ("a",)  # the leader ends its registration, or it would be back
    # once every member has answered, it is a worker failure: the budget pays
    answered = decide_round(replace(view, acks=frozenset({"a", "b"})), SETTINGS, now=10.1)
    assert answered.round is not None and answered.round.restart_count == 3 and answered.dead == ()


def test_a_peer_that_died_makes_the_failure_free():
    view = View(
        nodes=nodes(node("b")),  # a's lease expired while the leader waited for its answer
        round=running("a", "b", number=7, restarts=2),
        restart=RestartRequest(round=7, node_id="b", reason="collective failed"),
        restart_seen_at=10.0,
        acks=frozenset({"b"}),
    )
    d = decide_round(view, RendezvousSettings(run_id="job", min_nodes=1, max_nodes=3), now=11.0)
    assert members(d) == ["b"]
    assert d.round is not None and d.round.restart_count == 2 and d.reason.startswith("lost a")


def ran(seen: SeenNode, number: int, restarts: int = 0) -> SeenNode:
    """`seen` registered again after running round `number`."""
    return replace(seen, info=replace(seen.info, ran_round=number, ran_restarts=restarts))


def test_members_that_registered_again_get_a_new_round_for_free():
    # The store stalled past the lease TTL: every member lost its membership, stopped
    # its workers and registered again under the same id. Round 4 lists them all, but
    # nobody runs it any more: a new round follows, at once and without the budget.
    view = View(nodes=nodes(ran(node("a"), 4, 1), ran(node("b"), 4, 1)), round=running("a", "b", number=4, restarts=1))
    d = decide_round(view, SETTINGS, now=10.0)
    assert members(d) == ["a", "b"]
    assert d.round is not None and d.round.number == 5 and d.round.restart_count == 1
    assert d.reason.startswith("a, b registered again")
    # one member back, one gone: the one back rejoins at once, the lost one is named
    one = View(nodes=nodes(node("c", 1.0), ran(node("a"), 4)), round=running("a", "b", "c", number=4))
    d = decide_round(one, SETTINGS, now=10.0)
    assert sorted(members(d)) == ["a", "c"] and d.reason.startswith(f"lost b ({LAPSED}); a registered again")
    # a member still registered from before the round (it has not run it yet) stays
    waiting = View(nodes=nodes(ran(node("a"), 3), node("b")), round=running("a", "b", number=4))
    assert decide_round(waiting, SETTINGS, now=10.0).round is None


def test_an_empty_store_numbers_rounds_above_what_the_nodes_ran():
    # The store restarted empty: no round record, but the nodes say where they were.
    view = View(nodes=nodes(ran(node("a"), 7, 2), ran(node("b"), 6, 2), node("c")), round=None)
    d = decide_round(view, SETTINGS, now=10.0)
    assert d.round is not None and d.round.number == 8 and d.round.restart_count == 2


def test_closed_job_opens_nothing():
    closed = Round(number=2, participants=(), restart_count=0, reason="", opened_at=0.0, closed="succeeded")
    d = decide_round(View(nodes=nodes(node("a"), node("b")), round=closed), SETTINGS, now=0.0)
    assert d.round is None and d.reason == "job succeeded" and d.ended


# --- quarantine of flapping nodes --------------------------------------------------------

Q = RendezvousSettings(
    run_id="job", min_nodes=2, max_nodes=3, last_call=1.0,
    quarantine_after=3, quarantine_cooldown=60.0, quarantine_cooldown_max=1000.0,
)


def fail_on(node_id: str, view: View, at: float) -> View:
    """`view` with a restart request from `node_id` for the current round, every member alive."""
    assert view.round is not None
    return replace(
        view,
        restart=RestartRequest(
            round=view.round.number, node_id=node_id, reason="worker rank 2 failed with exit code 1"
        ),
        restart_seen_at=at,
        acks=frozenset(p.node_id for p in view.round.participants),
    )


def apply(view: View, d: Decision) -> View:
    """What the leader does with a decision: store the table, write the round."""
    return replace(
        view,
        round=d.round or view.round,
        quarantine=d.quarantine if d.quarantine is not None else view.quarantine,
    )


def crash(view: View, node_id: str, at: float, settings: RendezvousSettings = Q) -> tuple[View, Decision]:
    d = decide_round(fail_on(node_id, view, at), settings, now=at)
    assert d.round is not None, d.reason
    return apply(view, d), d


def three_nodes() -> View:
    return View(nodes=nodes(node("a"), node("b"), node("c")), round=running("a", "b", "c"))


def test_worker_failures_are_counted_per_node_and_once_per_round():
    view, d = crash(three_nodes(), "c", at=10.0)
    assert members(d) == ["a", "b", "c"] and d.round.restart_count == 1
    entry = view.quarantine.get("c")
    assert entry is not None and entry.failures == 1 and entry.times == 0 and not entry.active(10.0)
    assert entry.reason == "worker failure: worker rank 2 failed with exit code 1"
    assert view.quarantine.counted_round == 1
    # the same request seen again (a new leader, a failed write) does not count twice
    again = decide_round(fail_on("c", replace(view, round=running("a", "b", "c")), 11.0), Q, now=11.0)
    assert again.quarantine is None
    view, _ = crash(view, "c", at=20.0)
    assert view.quarantine.get("c").failures == 2


def test_third_failure_quarantines_the_node_and_the_job_goes_on_without_it():
    view = three_nodes()
    for at in (10.0, 20.0):
        view, _ = crash(view, "c", at)
    view, d = crash(view, "c", at=30.0)
    assert members(d) == ["a", "b"]  # survivors keep their order
    assert d.round.restart_count == 3  # the failure itself still spends the budget
    assert "restart after a worker failure on c" in d.reason
    assert "quarantined c for 60s (3 failures, the latest: worker failure: worker rank 2" in d.reason
    entry = view.quarantine.get("c")
    assert (entry.times, entry.failures, entry.until) == (1, 0, 90.0)
    assert entry.reason.startswith("3 failures, the latest: worker failure:")

    # c stays registered and waits: not admitted, said so, looked at again when it ends
    waiting = decide_round(view, Q, now=40.0)
    assert waiting.round is None
    assert waiting.reason == "round 4 running with 2 nodes; quarantined: c"
    assert waiting.recheck_at == 90.0


def test_quarantine_ends_and_the_node_is_admitted_after_the_last_call():
    view = three_nodes()
    for at in (10.0, 20.0, 30.0):
        view, d = crash(view, "c", at)
    assert decide_round(view, Q, now=89.9).round is None
    back = decide_round(view, Q, now=90.0)  # released; it fills the job to max: at once
    assert members(back) == ["a", "b", "c"] and back.reason == "scale up to 3 nodes; joined: c"
    assert back.round.restart_count == 3  # admission is free
    roomy = replace(Q, max_nodes=4)  # room for more: released, it arrives now (the last call)
    last_call = decide_round(view, roomy, now=90.0)
    assert last_call.round is None and last_call.recheck_at == 91.0 and "last call" in last_call.reason
    assert members(decide_round(view, roomy, now=91.0)) == ["a", "b", "c"]


def test_cooldown_doubles_on_probation_and_is_capped():
    view = three_nodes()
    for at in (10.0, 20.0, 30.0):
        view, _ = crash(view, "c", at)
    cooldowns, at = [60.0], 90.0
    for _ in range(5):  # each time: released, admitted, fails once, out again
        view = apply(view, decide_round(view, Q, now=at + 1.0))
        assert "c" in [p.node_id for p in view.round.participants]
        at += 2.0
        view, d = crash(view, "c", at)
        assert "c" not in members(d) and "again after its release" in d.reason
        entry = view.quarantine.get("c")
        cooldowns.append(entry.until - at)
        at = entry.until
    assert cooldowns == [60.0, 120.0, 240.0, 480.0, 960.0, 1000.0]  # capped at quarantine_cooldown_max
    assert view.quarantine.get("c").times == 6


def test_a_quiet_node_is_forgiven():
    view, _ = crash(three_nodes(), "c", at=10.0)
    assert view.quarantine.get("c") is not None
    later = decide_round(view, Q, now=10.0 + Q.quarantine_cooldown_max + 1)
    assert later.quarantine is not None and later.quarantine.get("c") is None


def test_old_failures_do_not_add_up():
    view = three_nodes()
    view, _ = crash(view, "c", at=10.0)
    view, _ = crash(view, "c", at=20.0)
    # the record is kept (quarantine_cooldown_max after the last failure), but the
    # next failure comes later than that after the last one: it starts a new count
    entry = replace(view.quarantine.get("c"), last_failure_at=-2000.0)
    view = replace(view, quarantine=replace(view.quarantine, entries=(entry,)))
    view, d = crash(view, "c", at=30.0)
    assert members(d) == ["a", "b", "c"] and view.quarantine.get("c").failures == 1


def test_disabled_counts_nothing():
    off = replace(Q, quarantine_after=0)
    view = three_nodes()
    for at in (10.0, 20.0, 30.0, 40.0):
        view, d = crash(view, "c", at, settings=off)
        assert members(d) == ["a", "b", "c"] and d.quarantine is None


def test_a_quarantine_never_stops_the_job_below_min():
    two = View(nodes=nodes(node("a"), node("c")), round=running("a", "c"))
    for at in (10.0, 20.0):
        two, _ = crash(two, "c", at)
    two, d = crash(two, "c", at=30.0)
    assert members(d) == ["a", "c"]  # without c only 1 of min 2: kept, and said so
    assert "quarantined c for 60s" in d.reason
    assert "kept c despite the quarantine: without it only 1 of min 2 nodes" in d.reason
    assert two.quarantine.get("c").active(30.0)
    assert decide_round(two, Q, now=31.0).round is None  # nothing else changes: it runs on
    # a standby arrives: the quarantined node goes, the newcomer takes its place
    two = replace(two, nodes=nodes(node("a"), node("c"), node("d", 40.0)))
    assert decide_round(two, Q, now=40.5).round is None  # the last call
    d = decide_round(two, Q, now=41.0)
    assert members(d) == ["a", "d"] and d.reason.startswith("quarantined c; joined: d")
    assert d.round.restart_count == 3


def test_dropping_out_of_rounds_counts_but_a_drain_does_not():
    view = three_nodes()
    for number, at in ((1, 10.0), (3, 20.0)):
        gone = replace(view, nodes=nodes(node("a"), node("b")), round=running("a", "b", "c", number=number))
        d = decide_round(gone, Q, now=at)
        assert members(d) == ["a", "b"] and d.reason.startswith("lost c")
        view = replace(view, quarantine=d.quarantine)
    entry = view.quarantine.get("c")
    assert entry.failures == 2 and entry.reason == "dropped out of round 3"
    drained = replace(
        view, nodes=nodes(node("a"), node("b")), round=running("a", "b", "c", number=5), draining=frozenset({"c"})
    )
    d = decide_round(drained, Q, now=30.0)
    assert members(d) == ["a", "b"] and d.quarantine.get("c").failures == 2
    assert d.reason == "drained c"  # not "lost": an operator asked it to go
    left = replace(drained, draining=frozenset(), departed=frozenset({"c"}))
    d = decide_round(left, Q, now=30.0)  # preempted (SIGTERM): it said it leaves
    assert d.reason == "c left" and d.quarantine.get("c").failures == 2
    third = replace(view, nodes=nodes(node("a"), node("b")), round=running("a", "b", "c", number=7))
    d = decide_round(third, Q, now=40.0)
    assert d.quarantine.get("c").active(40.0) and "quarantined c for 60s" in d.reason
    # it registers again meanwhile: it waits
    back = replace(apply(third, d), nodes=nodes(node("a"), node("b"), node("c", 45.0)))
    assert decide_round(back, Q, now=50.0).reason == "round 8 running with 2 nodes; quarantined: c"


SICK = "health check failed (exit 1): eth0 is down"


def test_a_member_that_leaves_asking_to_be_kept_out_is_quarantined_with_its_reason():
    view = three_nodes()
    # it wrote its departure and still holds its registration: nothing to do yet
    leaving = replace(view, departed=frozenset({"c"}), keep_out={"c": SICK})
    d = decide_round(leaving, Q, now=10.0)
    assert d.round is None and d.quarantine is None and d.settled == ()
    # its registration is gone: the round that lets it go holds it, at once (no count)
    gone = replace(leaving, nodes=nodes(node("a"), node("b")))
    d = decide_round(gone, Q, now=11.0)
    assert members(d) == ["a", "b"] and d.round.restart_count == 0  # free: it left
    assert d.reason == f"c left; quarantined c for 60s ({SICK})"
    entry = d.quarantine.get("c")
    assert (entry.times, entry.failures, entry.until, entry.reason) == (1, 0, 71.0, SICK)
    assert d.settled == ("c",)
    # a new leader finds the record again before the round is seen: no second hold
    again = decide_round(replace(apply(gone, d), round=gone.round), Q, now=12.0)
    assert again.quarantine is None and again.settled == ("c",)
    # it comes back (a new agent of the same id) while held: kept out, then admitted
    back = replace(apply(gone, d), nodes=nodes(node("a"), node("b"), node("c", 20.0)), keep_out={})
    assert decide_round(back, Q, now=30.0).reason == "round 2 running with 2 nodes; quarantined: c"
    assert members(decide_round(back, Q, now=71.0)) == ["a", "b", "c"]


def test_a_spare_that_leaves_asking_to_be_kept_out_is_held_and_its_record_settled():
    view = replace(three_nodes(), round=running("a", "b"), keep_out={"c": SICK}, departed=frozenset({"c"}))
    gone = replace(view, nodes=nodes(node("a"), node("b")))
    d = decide_round(gone, Q, now=10.0)
    assert d.round is None and d.settled == ("c",)
    assert d.quarantine.get("c").active(10.0) and d.quarantine.get("c").reason == SICK
    # held again only after another departure that asks for it, for twice as long
    later = replace(apply(gone, d), keep_out={"c": "health check timed out after 30s"})
    d = decide_round(later, Q, now=100.0)
    entry = d.quarantine.get("c")
    assert (entry.times, entry.until - 100.0) == (2, 120.0)


def test_keep_out_holds_even_where_failures_are_not_counted():
    off = replace(Q, quarantine_after=0)
    view = View(nodes=nodes(node("a"), node("b")), round=running("a", "b", "c"), keep_out={"c": SICK},
                departed=frozenset({"c"}))
    d = decide_round(view, off, now=10.0)
    assert members(d) == ["a", "b"] and d.quarantine.get("c").active(10.0)


def test_a_departure_without_keep_out_holds_nobody():
    view = View(nodes=nodes(node("a"), node("b")), round=running("a", "b", "c"), departed=frozenset({"c"}))
    d = decide_round(view, Q, now=10.0)
    assert d.reason == "c left" and not d.quarantine.entries and d.settled == ()


def test_every_member_going_at_once_counts_against_nobody():
    # A store stall lets every lease lapse together: the new leader finds each member
    # gone or registered again. That is the store's fault, not a flapping node's.
    view = three_nodes()
    for number in (1, 3, 5, 7):
        stalled = replace(view, nodes=nodes(ran(node("a"), number)), round=running("a", "b", "c", number=number))
        d = decide_round(stalled, Q, now=10.0 * number)
        assert d.quarantine is None or not d.quarantine.entries, d.quarantine
        assert d.reason.startswith(f"lost b, c ({LAPSED}); a registered again")


def test_a_new_leader_takes_a_quarantined_member_out_of_the_round():
    view, _ = crash(three_nodes(), "c", at=10.0)
    table = replace(view.quarantine, entries=(replace(view.quarantine.get("c"), times=1, until=100.0),))
    inherited = View(nodes=view.nodes, round=running("a", "b", "c", number=4, restarts=1), quarantine=table)
    d = decide_round(inherited, Q, now=50.0)
    assert members(d) == ["a", "b"] and d.reason == "quarantined c"
    assert d.round.restart_count == 1 and d.quarantine is None


def test_forming_leaves_quarantined_nodes_out_unless_needed():
    table = QuarantineTable(entries=(QuarantineEntry("c", times=1, until=100.0, reason="why"),))
    view = View(nodes=nodes(node("a", 1.0), node("b", 1.0), node("c", 1.0)), round=None, quarantine=table)
    d = decide_round(view, Q, now=5.0)
    assert members(d) == ["a", "b"]
    lone = View(nodes=nodes(node("a", 1.0), node("c", 1.0)), round=None, quarantine=table)
    d = decide_round(lone, Q, now=5.0)
    assert members(d) == ["a", "c"] and "kept c despite the quarantine" in d.reason


# --- spares and node units ------------------------------------------------------

UNITS = RendezvousSettings(run_id="job", min_nodes=2, max_nodes=6, last_call=1.0, node_unit=2)


def test_a_spare_takes_a_lost_members_place_before_a_newcomer_and_spends_nothing():
    fixed = RendezvousSettings(run_id="job", min_nodes=3, max_nodes=3, last_call=1.0)
    view = View(
        nodes=nodes(node("a"), node("c"), node("spare", 5.0), node("late", 99.0)),
        round=running("a", "b", "c", number=4, restarts=1),
    )
    d = decide_round(view, fixed, now=100.0)
    assert members(d) == ["a", "spare", "c"]  # in b's place: every node rank stays
    assert d.round is not None and d.round.restart_count == 1 and d.round.number == 5


def test_newcomers_fill_the_places_members_left_then_go_last():
    roomy = RendezvousSettings(run_id="job", min_nodes=1, max_nodes=5, last_call=1.0)
    view = View(
        nodes=nodes(node("a"), node("d"), node("x", 5.0), node("y", 6.0)),
        round=running("a", "b", "c", "d", number=2),
    )
    assert members(decide_round(view, roomy, now=100.0)) == ["a", "x", "y", "d"]
    one = View(nodes=nodes(node("a"), node("d"), node("x", 5.0)), round=view.round)
    assert members(decide_round(one, roomy, now=100.0)) == ["a", "x", "d"]  # fewer: the rest close up
    three = View(nodes={**view.nodes, **nodes(node("z", 7.0))}, round=running("a", "b", "d", number=2))
    assert members(decide_round(three, roomy, now=100.0)) == ["a", "x", "d", "y", "z"]


def test_units_form_the_largest_multiple_and_leave_the_rest_as_spares():
    view = View(nodes=nodes(*(node(n, float(i)) for i, n in enumerate("abcde"))), round=None)
    assert decide_round(view, UNITS, now=1.5).round is None  # the last call after the min-th arrival
    d = decide_round(view, UNITS, now=10.0)
    assert members(d) == ["a", "b", "c", "d"]
    assert decide_round(View(nodes=view.nodes, round=running(*"abcd")), UNITS, now=11.0).reason == (
        "round 1 running with 4 nodes (1 spare, node unit 2)"
    )


def test_units_a_spare_steps_into_the_lost_nodes_rank():
    view = View(nodes=nodes(node("a"), node("c"), node("d"), node("e", 5.0)), round=running(*"abcd"))
    d = decide_round(view, UNITS, now=20.0)
    assert members(d) == ["a", "e", "c", "d"]  # b's unit stays at node ranks 0-1


def test_units_a_loss_with_no_spare_shrinks_to_the_lower_multiple_keeping_whole_units():
    view = View(nodes=nodes(*(node(n) for n in "abdef")), round=running(*"abcdef"))
    d = decide_round(view, UNITS, now=20.0)
    assert members(d) == ["a", "b", "e", "f"]  # c's partner d waits as a spare
    two_more = View(nodes=nodes(node("a"), node("e"), node("d")), round=running("a", "b", "e", "f", number=2))
    assert members(decide_round(two_more, UNITS, now=21.0)) == ["a", "d"]  # d fills b's place


def test_units_scale_up_waits_for_a_whole_unit_then_the_last_call():
    roomy = replace(UNITS, max_nodes=8)
    view = View(nodes=nodes(*(node(n) for n in "abcd"), node("e", 50.0)), round=running(*"abcd"))
    assert decide_round(view, roomy, now=60.0).round is None
    more = View(nodes={**view.nodes, **nodes(node("f", 60.0))}, round=view.round)
    assert decide_round(more, roomy, now=60.5).round is None  # the last call runs from f's arrival
    d = decide_round(more, roomy, now=61.0)
    assert members(d) == ["a", "b", "c", "d", "e", "f"]
    assert members(decide_round(more, UNITS, now=60.0)) == members(d)  # max reached: at once


def test_units_fixed_size_waits_for_a_spare_rather_than_run_a_broken_unit():
    fixed = RendezvousSettings(run_id="job", min_nodes=4, max_nodes=4, last_call=1.0, node_unit=2)
    view = View(nodes=nodes(node("a"), node("b"), node("d")), round=running(*"abcd"))
    d = decide_round(view, fixed, now=20.0)
    assert members(d) == [] and "waiting for nodes" in d.reason
    back = View(nodes={**view.nodes, **nodes(node("x", 30.0))}, round=d.round and replace(d.round, number=2))
    assert members(decide_round(back, fixed, now=31.0)) == ["a", "b", "d", "x"]


def test_units_restart_after_a_worker_failure_keeps_whole_units():
    request = RestartRequest(round=1, node_id="a", reason="exit code 1")
    view = View(
        nodes=nodes(*(node(n) for n in "abcd")), round=running(*"abcd"), restart=request,
        restart_seen_at=10.0, acks=frozenset("abc"),
    )
    d = decide_round(view, UNITS, now=15.0)  # d never answered the ping within the TTL: dead
    assert members(d) == ["a", "b"] and d.dead == ("d",)


# --- a restart budget that forgives progress --------------------------------------


def test_a_forgiven_restart_counts_as_a_restart_but_not_against_the_budget():
    request = RestartRequest(round=7, node_id="b", reason="exit code 1", forgiven=True)
    base = replace(running("a", "b", number=7, restarts=2), forgiven=1)
    view = View(
        nodes=nodes(node("a"), node("b")), round=base, restart=request, restart_seen_at=10.0,
        acks=frozenset({"a", "b"}),
    )
    d = decide_round(view, SETTINGS, now=10.1)
    assert d.round is not None and (d.round.restart_count, d.round.forgiven) == (3, 2)
    assert "(forgiven: the workers had made progress)" in d.reason
    charged = decide_round(replace(view, restart=replace(request, forgiven=False)), SETTINGS, now=10.1)
    assert charged.round is not None and (charged.round.restart_count, charged.round.forgiven) == (3, 1)


def test_forgiven_restarts_survive_a_store_that_restarted_empty():
    ran = NodeInfo(node_id="a", host="h", addr="x", nproc=1, pid=1, started_at=0.0, ran_round=9, ran_restarts=4,
                   ran_forgiven=3)
    view = View(nodes={"a": SeenNode(ran, 0.0), **nodes(node("b"))}, round=None)
    d = decide_round(view, SETTINGS, now=10.0)
    assert d.round is not None and (d.round.restart_count, d.round.forgiven) == (4, 3)


# --- a death noticed in about a second ----------------------------------------------


def test_a_member_whose_liveness_port_refused_is_dead_at_once_the_others_wait_for_the_ttl():
    request = RestartRequest(round=4, node_id="a", reason="exit code 1")
    view = View(
        nodes=nodes(node("a"), node("b"), node("c")), round=running("a", "b", "c", number=4, restarts=1),
        restart=request, restart_seen_at=10.0, acks=frozenset({"a"}), refused=frozenset({"c"}),
    )
    d = decide_round(view, SETTINGS, now=10.2)  # b is silent but not refused: still within the TTL
    assert members(d) == ["a", "b"] and d.dead == ("c",)
    assert d.round is not None and d.round.restart_count == 1  # a death is free
    assert "lost c (agent gone: c refused the liveness check)" in d.reason
    stopped = replace(view, refused=frozenset())
    assert decide_round(stopped, SETTINGS, now=10.2).round is None  # a stopped node: the TTL judges


# --- stragglers taken out (--straggler=replace) -------------------------------------

SLOW = (("b", "compute 600ms a step, 3.0x the other nodes' median (200ms)"),)


def test_a_straggler_is_replaced_by_a_waiting_spare_and_kept_out():
    fixed = RendezvousSettings(run_id="job", min_nodes=2, max_nodes=2)
    view = View(nodes=nodes(node("a"), node("b"), node("s", 5.0)), round=running("a", "b", number=3), slow=SLOW)
    d = decide_round(view, fixed, now=100.0)
    assert members(d) == ["a", "s"]  # the spare takes the straggler's place, at once
    assert d.round is not None and d.round.restart_count == 0  # a membership change: free
    assert d.reason.startswith("quarantined b; joined: s; quarantined b for 60s (straggler: compute 600ms")
    entry = d.quarantine.get("b") if d.quarantine else None
    assert entry is not None and entry.active(100.0) and entry.reason.startswith("straggler: compute 600ms")
    # it does not come straight back: while quarantined it is no spare either
    after = View(nodes=view.nodes, round=d.round, quarantine=d.quarantine)
    assert decide_round(after, fixed, now=110.0).round is None


def test_a_straggler_goes_without_a_spare_when_the_elastic_range_allows():
    view = View(nodes=nodes(node("a"), node("b"), node("c")), round=running("a", "b", "c", number=3), slow=SLOW)
    d = decide_round(view, SETTINGS, now=100.0)  # min 2: two nodes at full speed beat three at a third
    assert members(d) == ["a", "c"]


def test_a_straggler_is_only_reported_when_the_job_would_go_below_min():
    view = View(nodes=nodes(node("a"), node("b")), round=running("a", "b", number=3), slow=SLOW)
    d = decide_round(view, SETTINGS, now=100.0)
    assert d.round is None and d.quarantine is None  # no quarantine without the replacement
    assert d.reason == (
        "round 3 running with 2 nodes; straggler b kept: no spare, and the job runs at its minimum of 2 nodes"
    )


def test_stragglers_are_replaced_one_at_a_time_the_slowest_first():
    two_slow = (("c", "3.0x"), ("b", "2.0x"))
    roomy = RendezvousSettings(run_id="job", min_nodes=1, max_nodes=4)
    view = View(nodes=nodes(node("a"), node("b"), node("c")), round=running("a", "b", "c", number=3), slow=two_slow)
    d = decide_round(view, roomy, now=100.0)
    assert members(d) == ["a", "b"]
    assert d.quarantine is not None and d.quarantine.active(100.0).keys() == {"c"}
    # a straggler that is no longer in the round is skipped for the next one
    gone = View(nodes=nodes(node("a"), node("b")), round=running("a", "b", number=4), slow=two_slow)
    assert members(decide_round(gone, roomy, now=100.0)) == ["a"]


def test_a_straggler_waits_while_the_round_changes_for_another_reason():
    # a node was lost: that round comes first, the straggler is judged again in the next
    view = View(nodes=nodes(node("a"), node("b")), round=running("a", "b", "c", number=3), slow=SLOW)
    d = decide_round(view, SETTINGS, now=100.0)
    assert members(d) == ["a", "b"] and d.reason == f"lost c ({LAPSED})"
    assert d.quarantine is not None and not d.quarantine.active(100.0)  # c's drop-out counted, b kept


# --- never two jobs: a majority while a node that may serve the store elsewhere is unaccounted for


def _named(serving: str, *successors: str, round_number: int = 1, quorum: int = 2) -> Successors:
    return Successors(
        serving=serving, round=round_number, quorum=quorum,
        nodes=tuple(Successor(n, f"{n}:29400", n, 1) for n in successors),
    )


def test_the_minority_side_of_a_partition_stops_and_waits():
    """The store's host alone of three: its successors may serve the other side."""
    view = View(nodes=nodes(node("h")), round=running("h", "a", "b"), successors=_named("h", "a", "b"))
    d = decide_round(view, SETTINGS, now=100.0)
    assert d.round is not None and members(d) == []  # the host's workers stop
    assert "waiting for a majority of round 1's nodes (1 of 2 here): a, b may serve" in d.reason


def test_the_majority_side_goes_on_at_a_successors_store():
    """At the successor's store the old host is missing; the two who ran the round are back."""
    back = [replace(node(n), info=replace(node(n).info, ran_round=1)) for n in ("a", "b")]
    view = View(nodes=nodes(*back), round=running("h", "a", "b"), successors=_named("h", "a", "b"))
    d = decide_round(view, SETTINGS, now=100.0)
    assert members(d) == ["a", "b"], d.reason


def test_the_majority_counts_the_named_rounds_members_whichever_round_runs():
    """Round 2 opened as the host left and nobody ran it (ran_round=1); at the successor's
    store the first node back waits (an empty round), and the majority still counts round
    2's members, kept by the leader for that."""
    first = replace(node("a"), info=replace(node("a").info, ran_round=1))
    view = View(nodes=nodes(first), round=running("a", "b", "c", number=2),
                successors=_named("h", "a", "b", round_number=2), named_members=frozenset({"a", "b", "c"}))
    d = decide_round(view, SETTINGS, now=100.0)
    assert d.round is not None and members(d) == [] and "(1 of 2 here)" in d.reason, d
    late = replace(node("b"), info=replace(node("b").info, ran_round=1))
    d = decide_round(replace(view, nodes=nodes(first, late), round=d.round), SETTINGS, now=100.0)
    assert sorted(members(d)) == ["a", "b"], d.reason


def test_nodes_seen_to_go_need_no_majority():
    """Successors that left on purpose (or whose port refused) serve nowhere: shrinking is free."""
    view = View(nodes=nodes(node("h")), round=running("h", "a", "b"), successors=_named("h", "a", "b"),
                departed=frozenset({"a"}), refused=frozenset({"b"}))
    d = decide_round(view, replace(SETTINGS, min_nodes=1), now=100.0)
    assert members(d) == ["h"], d.reason
