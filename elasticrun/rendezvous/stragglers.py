"""The straggler verdict: a pure function of the nodes' step reports, the round and now.

Each node reports its workers' compute time per step (`StepReport`: the step's wall
time less the time spent waiting for peers, of its slowest worker, as a median of its
recent steps). Every `straggler_interval` the leader calls `judge()`, which scores each
node of the round two ways:

- **relative**: its compute time over the median of the *other* nodes' (leaving the
  node out, so that in a job of two nodes the slow one is still 3x, not 1.5x);
- **individual**: its compute time over its own best of the round.

A node is slow at an evaluation when its relative score is at least
`straggler_relative`, and named a straggler after `straggler_after` such evaluations in
a row; it is no longer one after as many evaluations in a row that find it not slow.
Only an evaluation with new steps from the node counts either way: a node whose steps
stopped (a hang, a long checkpoint) is neither named nor cleared by a stale report. Nor
is a node whose report says `warming`: its standbys (warm restarts) import beside its
workers, once a round, for a few seconds, and under a CPU quota (a container's limit)
they take from the workers' share whatever their priority, so its times are not its
own; it is no measure for the others either. Its times still count for its own best:
they are never lower than its own.

The individual score names nothing by itself: when every node slows alike (a harder
part of the data, a shared file system), every individual score rises and no node is
to blame, while the relative scores stay near 1. It says whether a straggler slowed
down (a throttling GPU) or was slow since the round began, and is exported for alerts.

A report is checked before it is believed: a node's workers write it, and a worker may
lie (report its compute as waiting, to have an honest node named). One whose compute
exceeds its own wall time, whose steps went back, or whose wall time is far from the
other nodes' (ranks of one synchronous job step together) is doubted: it is neither
judged nor a measure for the others. And a node is replaced (`worst_first`) on the word
of one other node alone (a job of two) only when it also slowed against its own best:
a liar can make its honest peer look slow, not make it slow down.

A new round starts the scores afresh: its membership and so its step times differ.
No I/O, no clock of its own, like `decide_round()`: tested without sleeping.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from elasticrun.rendezvous.records import StepReport, Straggler, StragglerReport
from elasticrun.rendezvous.rounds import Round
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.rendezvous.wording import step_time

#: steps a node's workers must have made in the round before the node is scored: the
#: first steps of a round carry its start (compilation, warm-up)
MIN_STEPS = 5
#: how far a node's compute may exceed its wall time (both medians of its recent steps,
#: taken apart, so they need not fit exactly) before its report is doubted
WALL_SLACK = 0.1
#: how many times longer or shorter than the other nodes' median a node's wall time
#: may be before its report is doubted: every rank of a synchronous job waits for the
#: others, so their steps take as long
WALL_SPREAD = 3.0


@dataclass(frozen=True, slots=True)
class NodeScore:
    """One node's standing at the latest evaluation."""

    compute: float
    #: compute over the other nodes' median (0: no other node to compare with)
    relative: float
    #: compute over its own best of the round
    individual: float
    #: its lowest compute time of the round
    best: float
    #: the step count of its report at the latest evaluation with new steps
    steps: int
    #: evaluations in a row that found it slow, and not slow
    slow_for: int = 0
    fine_for: int = 0
    #: whether it may be replaced when named: compared with two other nodes or more, or
    #: slower than its own best by `straggler_relative` (not one other node's word alone)
    replaceable: bool = True


@dataclass(frozen=True, slots=True)
class Judgement:
    """What the leader knows of the round's step times after an evaluation."""

    round: int = 0
    #: the median compute time of the scored nodes (0: none scored)
    median: float = 0.0
    scores: Mapping[str, NodeScore] = field(default_factory=dict)
    #: the stragglers, by node id
    named: Mapping[str, Straggler] = field(default_factory=dict)
    #: the nodes whose latest report was not believed, and why
    doubted: Mapping[str, str] = field(default_factory=dict)

    def report(self, at: float) -> StragglerReport:
        """The record for `elasticrun status` (c/stragglers)."""
        nodes = tuple(sorted(self.named.values(), key=lambda s: (-s.relative, s.node_id)))
        return StragglerReport(round=self.round, median=self.median, nodes=nodes, at=at)

    def scored(self) -> dict[str, NodeScore]:
        """The scores of the nodes evaluated at least once.

        A node whose every report so far came while its standbys imported holds a score
        for its best alone (`_best_while_warming`): its relative score is no measure yet,
        and a metric of 0 would read as the fastest node of the job."""
        return {n: s for n, s in self.scores.items() if s.steps > 0}

    def worst_first(self) -> tuple[tuple[str, str], ...]:
        """The stragglers as (node id, why), the slowest first.

        What `--straggler=replace` takes out, one at a time: only the replaceable ones
        (`NodeScore.replaceable`)."""
        return tuple(
            (s.node_id, s.reason) for s in self.report(0.0).nodes
            if (score := self.scores.get(s.node_id)) is None or score.replaceable
        )


def judge(before: Judgement, current: Round | None, reports: Mapping[str, StepReport],
          settings: RendezvousSettings, now: float) -> Judgement:
    """Score the round's nodes from their latest reports.

    `now` is the wall clock (it dates a newly named straggler)."""
    if current is None or current.closed or not current.participants:
        return Judgement()
    if before.round != current.number:
        before = Judgement(round=current.number)
    members = [p.node_id for p in current.participants]
    scored = {
        n: r for n in members
        if (r := reports.get(n)) is not None and r.round == current.number and r.steps >= MIN_STEPS and r.compute > 0
    }
    reported = {n: r for n, r in scored.items() if not r.warming}
    if warming := {n: _best_while_warming(before.scores.get(n), r) for n, r in scored.items() if r.warming}:
        before = replace(before, scores={**before.scores, **warming})
    walls = sorted(r.wall for r in reported.values())
    doubted = {
        n: why for n, r in reported.items()
        if (why := _doubt(r, before.scores.get(n), _median_without(walls, r.wall))) is not None
    }
    usable = {n: r for n, r in reported.items() if n not in doubted}
    if not usable:
        return replace(before, doubted=doubted)
    ordered = sorted(r.compute for r in usable.values())
    scores = dict(before.scores)
    named = dict(before.named)
    for node_id, report in usable.items():
        old = before.scores.get(node_id)
        if old is not None and report.steps <= old.steps:
            continue  # nothing new from this node since the last evaluation
        others = _median_without(ordered, report.compute)
        relative = report.compute / others if others else 0.0
        best = min(old.best, report.compute) if old is not None else report.compute
        slow = others > 0 and relative >= settings.straggler_relative
        individual = report.compute / best
        score = NodeScore(
            compute=report.compute,
            relative=relative,
            individual=individual,
            best=best,
            steps=report.steps,
            slow_for=(old.slow_for if old else 0) + 1 if slow else 0,
            fine_for=0 if slow else (old.fine_for if old else 0) + 1,
            replaceable=len(ordered) > 2 or individual >= settings.straggler_relative,
        )
        scores[node_id] = score
        if score.slow_for >= settings.straggler_after:
            since = named[node_id].since if node_id in named else now
            named[node_id] = Straggler(
                node_id=node_id, relative=relative, individual=score.individual, compute=report.compute,
                since=since, reason=_reason(report, score, others),
            )
        elif score.fine_for >= settings.straggler_after:
            named.pop(node_id, None)
    kept = set(members)
    return Judgement(
        round=current.number,
        median=statistics.median(ordered),
        scores={n: s for n, s in scores.items() if n in kept},
        named={n: s for n, s in named.items() if n in kept},
        doubted=doubted,
    )


def _best_while_warming(old: NodeScore | None, report: StepReport) -> NodeScore:
    """`old` (or a new score) with a warming `report`'s compute for its best, where lower.

    Its standbys only ever add to its times, so its best stays a true one: a node that
    slows down while they import is still seen to have slowed (`individual`)."""
    if old is None:
        return NodeScore(compute=report.compute, relative=0.0, individual=1.0, best=report.compute, steps=0)
    return replace(old, best=min(old.best, report.compute))


def _doubt(report: StepReport, old: NodeScore | None, others_wall: float) -> str | None:
    """Why `report` is not believed, or None.

    `others_wall`: the median wall time of the other nodes' reports (0: none)."""
    if report.wall <= 0 or report.compute > report.wall * (1 + WALL_SLACK):
        return f"compute {step_time(report.compute)} a step, more than its wall time {step_time(report.wall)}"
    if old is not None and report.steps < old.steps:
        return f"{report.steps} steps, fewer than the {old.steps} it reported before in this round"
    if others_wall > 0 and not others_wall / WALL_SPREAD <= report.wall <= others_wall * WALL_SPREAD:
        return (
            f"wall time {step_time(report.wall)} a step, against the other nodes' {step_time(others_wall)}: "
            "the ranks of a job step together"
        )
    return None


def _median_without(ordered: list[float], value: float) -> float:
    """The median of `ordered` (sorted) with one `value` taken out; 0 when none is left.

    By index, not by a copy: at 1,000 nodes a copy and a median per node cost the
    leader a million steps every evaluation."""
    n = len(ordered) - 1
    if n < 1:
        return 0.0
    gone = bisect.bisect_left(ordered, value)

    def at(k: int) -> float:
        return ordered[k if k < gone else k + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def _reason(report: StepReport, score: NodeScore, others: float) -> str:
    """Why a node is named a straggler, in one line.

    `compute 0.61s a step, 3.0x the other nodes' median (0.20s); 2.9x its own best: it
    slowed down (worker rank 5)`."""
    trend = (
        f"{score.individual:.1f}x its own best: it slowed down" if score.individual >= 1.1
        else "as slow since the round began"
    )
    kept = "" if score.replaceable else "; not replaced on one other node's word without a slowdown of its own"
    return (
        f"compute {step_time(report.compute)} a step, {score.relative:.1f}x the other nodes' median "
        f"({step_time(others)}); {trend} (slowest: worker rank {report.rank}){kept}"
    )
