"""The straggler verdict (elasticrun.rendezvous.stragglers), tested as the pure function
it is: step reports in, scores and names out, no store and no sleeping."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from elasticrun.rendezvous.codec import decode
from elasticrun.rendezvous.keys import Keys
from elasticrun.rendezvous.records import NodeInfo, StepReport
from elasticrun.rendezvous.reports import Reporter
from elasticrun.rendezvous.rounds import Participant, Round
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.rendezvous.stragglers import MIN_STEPS, Judgement, judge
from elasticrun.store.server.memory import MemoryStore

SETTINGS = RendezvousSettings(run_id="job", min_nodes=1, max_nodes=8, straggler_relative=1.25, straggler_after=3)


def a_round(*names: str, number: int = 1) -> Round:
    return Round(number=number, participants=tuple(Participant(n, "addr", 1) for n in names), restart_count=0,
                 reason="", opened_at=0.0)


def reports(compute: dict[str, float], steps: int, number: int = 1) -> dict[str, StepReport]:
    return {
        n: StepReport(node_id=n, round=number, steps=steps, compute=c, wall=max(compute.values()), rank=i,
                      source="optimizer")
        for i, (n, c) in enumerate(compute.items())
    }


def run(evaluations: list[dict[str, float]], current: Round, start: int = MIN_STEPS,
        before: Judgement | None = None) -> list[Judgement]:
    """One evaluation per entry, each with ten more steps from every node."""
    judged, out = before or Judgement(), []
    for i, compute in enumerate(evaluations):
        judged = judge(judged, current, reports(compute, start + 10 * i, current.number), SETTINGS, now=100.0 + i)
        out.append(judged)
    return out


def test_a_node_three_times_slower_is_named_after_enough_evaluations_in_a_row():
    current = a_round("a", "b", "c", "d")
    times = {"a": 0.2, "b": 0.21, "c": 0.6, "d": 0.19}
    first, second, third = run([times] * 3, current)
    assert not first.named and not second.named
    assert list(third.named) == ["c"]
    c = third.named["c"]
    assert round(c.relative, 2) == 3.0 and c.since == 102.0  # against the others' median, 0.2
    assert c.reason == (
        "compute 600ms a step, 3.0x the other nodes' median (200ms); as slow since the round began "
        "(slowest: worker rank 2)"
    )
    assert third.scores["a"].relative < 1.25 and round(third.median, 6) == 0.205


def test_a_node_one_and_a_half_times_slower_is_named_too():
    *_, last = run([{"a": 0.2, "b": 0.2, "c": 0.3}] * 3, a_round("a", "b", "c"))
    assert list(last.named) == ["c"]


def test_in_a_job_of_two_the_slow_node_is_compared_with_the_other_alone():
    *_, last = run([{"a": 0.2, "b": 0.3}] * 3, a_round("a", "b"))
    assert list(last.named) == ["b"] and round(last.named["b"].relative, 2) == 1.5
    assert round(last.scores["a"].relative, 2) == 0.67


def test_a_node_that_slows_down_says_so_against_its_own_best():
    *_, last = run([{"a": 0.2, "b": 0.2, "c": 0.2}] + [{"a": 0.2, "b": 0.2, "c": 0.5}] * 3, a_round("a", "b", "c"))
    assert round(last.named["c"].individual, 2) == 2.5
    assert "2.5x its own best: it slowed down" in last.named["c"].reason


def test_when_every_node_slows_alike_nobody_is_to_blame():
    fast, slow = {"a": 0.2, "b": 0.2, "c": 0.2}, {"a": 0.6, "b": 0.6, "c": 0.6}
    *_, last = run([fast, slow, slow, slow, slow], a_round("a", "b", "c"))
    assert not last.named
    assert all(round(s.individual, 1) == 3.0 for s in last.scores.values())  # what the individual score shows


def test_a_blip_is_not_a_straggler_and_a_straggler_is_cleared_only_after_as_many_good_evaluations():
    slow, fast = {"a": 0.2, "b": 0.2, "c": 0.6}, {"a": 0.2, "b": 0.2, "c": 0.2}
    blip = run([slow, slow, fast, slow], a_round("a", "b", "c"))
    assert not any(j.named for j in blip)
    named = run([slow, slow, slow, fast, fast, fast], a_round("a", "b", "c"))
    assert [bool(j.named) for j in named] == [False, False, True, True, True, False]


def test_stale_reports_neither_name_nor_clear():
    current = a_round("a", "b", "c")
    slow = {"a": 0.2, "b": 0.2, "c": 0.6}
    judged = Judgement()
    for _ in range(5):  # the same report again and again: one evaluation's worth of news
        judged = judge(judged, current, reports(slow, steps=20), SETTINGS, now=100.0)
    assert not judged.named and judged.scores["c"].slow_for == 1


def test_a_warming_node_is_neither_named_nor_cleared_nor_a_measure_for_the_others():
    """Its standbys import beside its workers: its times are not its own (StepReport.warming)."""
    current = a_round("a", "b", "c")
    judged = Judgement()
    for i in range(3):  # c: fast at first, then slow while its standbys import
        warming = reports({"a": 0.2, "b": 0.2, "c": 0.2 if i == 0 else 0.9}, MIN_STEPS + i)
        warming["c"] = replace(warming["c"], warming=True)
        judged = judge(judged, current, warming, SETTINGS, now=100.0 + i)
    assert not judged.named and judged.scores["c"].slow_for == 0
    assert set(judged.scored()) == {"a", "b"}  # c's score holds its best alone: no relative score to show
    assert round(judged.scores["a"].relative, 2) == 1.0  # against b alone (with c: 0.2 / 0.55)
    # its own times again: judged as any node, and its best of the warming steps kept
    *_, named = run([{"a": 0.2, "b": 0.2, "c": 0.6}] * 3, current, start=MIN_STEPS + 10, before=judged)
    assert list(named.named) == ["c"] and round(named.named["c"].individual, 2) == 3.0
    cleared = judge(named, current, {n: replace(r, warming=True) for n, r in
                                     reports({"a": 0.2, "b": 0.2, "c": 0.2}, 100).items()}, SETTINGS, now=200.0)
    assert list(cleared.named) == ["c"] and cleared.scores["c"].fine_for == 0  # not cleared by warming times


def test_too_few_steps_another_round_or_a_lone_node_are_not_scored():
    current = a_round("a", "b")
    assert not judge(Judgement(), current, reports({"a": 0.2, "b": 0.6}, MIN_STEPS - 1), SETTINGS, 1.0).scores
    assert not judge(Judgement(), current, reports({"a": 0.2, "b": 0.6}, 50, number=0), SETTINGS, 1.0).scores
    alone = judge(Judgement(), a_round("a"), reports({"a": 0.6}, 50), SETTINGS, 1.0)
    assert alone.scores["a"].relative == 0.0 and not alone.named


def test_a_new_round_starts_afresh_and_forgets_who_left():
    *_, last = run([{"a": 0.2, "b": 0.2, "c": 0.6}] * 3, a_round("a", "b", "c"))
    assert list(last.named) == ["c"]
    after = judge(last, a_round("a", "b", "d", number=2), reports({"a": 0.2, "b": 0.2, "d": 0.2}, 50, 2), SETTINGS, 9.0)
    assert after.round == 2 and not after.named and set(after.scores) == {"a", "b", "d"}
    assert all(s.slow_for == 0 and s.best == 0.2 for s in after.scores.values())


def test_replace_takes_the_slowest_first():
    times = {"a": 0.2, "b": 0.2, "c": 0.2, "d": 0.5, "e": 0.9}
    *_, last = run([times] * 3, a_round(*times))
    assert [n for n, _ in last.worst_first()] == ["e", "d"]
    report = last.report(at=5.0)
    assert [s.node_id for s in report.nodes] == ["e", "d"] and report.round == 1


def test_thresholds_are_the_settings():
    strict = replace(SETTINGS, straggler_relative=2.0, straggler_after=1)
    first = judge(Judgement(), a_round("a", "b", "c"), reports({"a": 0.2, "b": 0.2, "c": 0.3}, 50), strict, 1.0)
    assert not first.named
    first = judge(Judgement(), a_round("a", "b", "c"), reports({"a": 0.2, "b": 0.2, "c": 0.4}, 50), strict, 1.0)
    assert list(first.named) == ["c"]


def test_a_thousand_nodes_are_judged_with_the_others_median_by_index():
    names = [f"n{i:04d}" for i in range(1000)]
    times = {n: 0.2 + (i % 7) * 0.001 for i, n in enumerate(names)}
    times["n0500"] = 0.6
    *_, last = run([times] * 3, a_round(*names))
    assert list(last.named) == ["n0500"]
    assert abs(last.named["n0500"].relative - 0.6 / 0.203) < 1e-9


async def test_a_nodes_step_report_is_published_at_most_once_per_interval_the_latest_winning() -> None:
    keys = Keys("job")

    class Counting(MemoryStore):
        def __init__(self) -> None:
            super().__init__()
            self.step_puts: list[bytes] = []
            self.put_at: list[float] = []
            self.put_seen = asyncio.Event()

        async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
            if key == keys.step_report("n"):
                self.step_puts.append(value)
                self.put_at.append(time.monotonic())
                self.put_seen.set()
            return await super().put(key, value, lease=lease)

    async def next_put() -> None:
        async with asyncio.timeout(10):
            await store.put_seen.wait()
        store.put_seen.clear()

    store = Counting()
    me = NodeInfo(node_id="n", host="h", addr="a", nproc=1, pid=1, started_at=0.0)
    reporter = Reporter(store, keys, me, steps_interval=0.3)
    lease = await store.grant_lease(10)
    publishing = asyncio.ensure_future(reporter.publish(lease))
    try:
        first = reports({"n": 0.2}, steps=10)["n"]
        reporter.steps(first)
        await next_put()
        reporter.steps(replace(first, steps=20))
        reporter.steps(replace(first, steps=30))  # before the interval: only the latest goes
        await next_put()
        assert [decode(StepReport, v).steps for v in store.step_puts] == [10, 30]
        assert store.put_at[1] - store.put_at[0] >= 0.25  # not before the interval (a bound, not a timing)
        kv = await store.get(keys.step_report("n"))
        assert kv is not None and kv.lease == lease  # it goes with the node
    finally:
        publishing.cancel()
        await asyncio.gather(publishing, return_exceptions=True)
        await store.close()


def lying(reports_: dict[str, StepReport], node: str, **fields: float) -> dict[str, StepReport]:
    return {**reports_, node: replace(reports_[node], **fields)}


def test_a_lying_node_in_a_job_of_two_gets_its_honest_peer_named_but_not_replaced():
    """The attack: a worker reports its compute as waiting (1 ms of a 144 ms step)."""
    current, judged = a_round("liar", "honest"), Judgement()
    for i in range(3):
        judged = judge(judged, current, reports({"liar": 0.001, "honest": 0.144}, MIN_STEPS + 10 * i), SETTINGS,
                       now=100.0 + i)
    assert list(judged.named) == ["honest"] and not judged.scores["honest"].replaceable
    assert "not replaced on one other node's word" in judged.named["honest"].reason
    assert judged.worst_first() == ()


def test_in_a_job_of_two_a_node_that_slowed_down_itself_is_replaced():
    *_, last = run([{"a": 0.2, "b": 0.2}] + [{"a": 0.2, "b": 0.5}] * 3, a_round("a", "b"))
    assert [n for n, _ in last.worst_first()] == ["b"] and last.scores["b"].replaceable


def test_with_three_nodes_or_more_the_median_decides_alone():
    *_, last = run([{"a": 0.2, "b": 0.2, "c": 0.6}] * 3, a_round("a", "b", "c"))
    assert [n for n, _ in last.worst_first()] == ["c"]


def test_an_implausible_report_is_doubted_neither_judged_nor_a_measure():
    current = a_round("a", "b", "c")
    honest = {"a": 0.2, "b": 0.2, "c": 0.2}
    cases = {
        "more compute than wall": lambda r: lying(r, "c", compute=5.0, wall=0.2),
        "a wall far from the others'": lambda r: lying(r, "c", compute=0.001, wall=0.002),
    }
    for case, lie in cases.items():
        judged = Judgement()
        for i in range(3):
            judged = judge(judged, current, lie(reports(honest, MIN_STEPS + 10 * i)), SETTINGS, now=100.0 + i)
        assert list(judged.doubted) == ["c"], case
        assert "c" not in judged.scores and not judged.named, case


def test_steps_that_go_back_are_doubted():
    current = a_round("a", "b", "c")
    first = judge(Judgement(), current, reports({"a": 0.2, "b": 0.2, "c": 0.2}, MIN_STEPS + 20), SETTINGS, now=1.0)
    back = lying(reports({"a": 0.2, "b": 0.2, "c": 0.6}, MIN_STEPS + 30), "c", steps=MIN_STEPS + 1)
    second = judge(first, current, back, SETTINGS, now=2.0)
    assert "fewer than the" in second.doubted["c"] and second.scores["c"].compute == 0.2
