"""Prometheus metrics of one agent (`--metrics-port`), in a registry of its own.

The agent calls these hooks at the points of its loop where the facts are known; the
HTTP server that exposes the registry (`prometheus_client`'s, in a thread of its own)
reads them when scraped, so a scrape never waits on the agent's event loop. Imported
only when metrics are asked for: the library costs the launch nothing otherwise.

Every metric is listed, with its meaning, in docs/deployment.md ("Metrics").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector

from elasticrun import __version__
from elasticrun.agent.health_check import CheckResult
from elasticrun.agent.spec import WorkerState
from elasticrun.rendezvous.handler import Assignment
from elasticrun.rendezvous.records import StepReport

#: seconds from a change to running again: a membership change in place takes well
#: under a second, a restart of big workers minutes
RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

#: why a round ended and this node's workers were restarted (or re-formed in place)
RESTART_CAUSES = ("worker_failure", "hang", "peer_failure")
#: how the membership changed between two rounds this node ran
MEMBERSHIP_CAUSES = ("scale_up", "scale_down", "replace")


class AgentMetrics:
    """What one agent exports; `registry` is what its HTTP server serves."""

    def __init__(self, run_id: str, node_id: str, *, health_check: bool = False) -> None:
        """`health_check`: this agent runs a --health-check (its metrics exist only then)."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        # elasticrun_info: what to join other series on (`* on(instance) group_left(job_id, node_id)`)
        Info("elasticrun", "This agent: the id of its job (--rdzv-id), its node id, the elasticrun version",
             registry=r).info({"job_id": run_id, "node_id": node_id, "version": __version__})
        self.rounds = Counter("elasticrun_rounds", "Rounds of the job this node took part in", registry=r)
        self.round = Gauge("elasticrun_round", "The number of the round this node is in (0: none yet)", registry=r)
        self.world_size = Gauge("elasticrun_world_size", "Workers in the job in this node's round", registry=r)
        self.nodes = Gauge("elasticrun_nodes", "Nodes in this node's round", registry=r)
        self.membership_changes = Counter(
            "elasticrun_membership_changes",
            "Rounds that changed the job's nodes, by cause: scale_up (more nodes), scale_down (fewer), "
            "replace (as many, not the same)",
            ["cause"], registry=r,
        )
        self.restarts = Counter(
            "elasticrun_restarts",
            "Restarts of this node's workers after a failure, by cause: worker_failure (a worker of this "
            "node failed), hang (the progress watchdog), peer_failure (a worker on another node failed)",
            ["cause"], registry=r,
        )
        self.recovery = Histogram(
            "elasticrun_change_to_running_seconds",
            "Seconds from the moment this node saw its round end (a membership change or a failure) to its "
            "workers started in the next round (their imports and joining the collective come after: see "
            "elasticrun_change_to_first_step_seconds)",
            buckets=RECOVERY_BUCKETS, registry=r,
        )
        self.first_step = Histogram(
            "elasticrun_change_to_first_step_seconds",
            "Seconds from the moment this node saw its round end (a membership change or a failure) to its "
            "workers' first step in the next round, read within a second (workers whose steps are timed only)",
            buckets=RECOVERY_BUCKETS, registry=r,
        )
        self.worker_state = Gauge(
            "elasticrun_worker_state", "1 for the state this node's worker group is in, 0 for the others",
            ["state"], registry=r,
        )
        self.quarantined = Gauge(
            "elasticrun_quarantined_nodes", "Nodes of the job kept out by a quarantine now", registry=r
        )
        self.step_compute = Gauge(
            "elasticrun_step_compute_seconds",
            "This node's compute time per step: the step's wall time less its waits for peers, median of the "
            "recent steps of its slowest worker (0: no steps timed yet)", registry=r,
        )
        self.step_wall = Gauge(
            "elasticrun_step_seconds", "The wall time per step of this node's slowest worker, median of its recent "
            "steps (0: no steps timed yet)", registry=r,
        )
        self.stalled = Gauge(
            "elasticrun_stalled", "1 while this node's workers make no step for many of their usual steps (and at "
            "least a minute), else 0", registry=r,
        )
        self.stragglers = Gauge(
            "elasticrun_stragglers", "On the leader's agent: nodes of the job named stragglers now", registry=r
        )
        self._health: tuple[Counter, Gauge, Info] | None = None
        if health_check:
            self._health = (
                Counter("elasticrun_health_checks", "Runs of --health-check, by result: passed, failed, timed_out",
                        ["result"], registry=r),
                Gauge("elasticrun_health_check_seconds", "Seconds the latest run of --health-check took", registry=r),
                Info("elasticrun_health_check", "The latest run of --health-check: its result and, when it failed, "
                     "why (its last line)", registry=r),
            )
        for cause in MEMBERSHIP_CAUSES:
            self.membership_changes.labels(cause)  # every series exists from the start, at 0
        for cause in RESTART_CAUSES:
            self.restarts.labels(cause)
        self._ran: Assignment | None = None
        self._ended_at: float | None = None  # when the last round ended, until running again
        self._failed_here = False
        #: when the change the workers have not made a step since began (the first of
        #: several, should rounds end before a step)
        self._step_since: float | None = None

    def quarantine_from(self, count: Callable[[], int]) -> None:
        """Read the job's quarantined nodes from `count` at each scrape (a thread-safe read)."""
        self.quarantined.set_function(lambda: float(count()))

    def stragglers_from(self, scores: Callable[[], Mapping[str, tuple[float, float, bool]]]) -> None:
        """Read the leader's straggler scores from `scores` at each scrape.

        Node id -> relative, individual, named; empty on an agent that does not lead."""
        self.stragglers.set_function(lambda: float(sum(named for *_, named in scores().values())))
        self.registry.register(_StragglerScores(scores))

    def steps(self, report: StepReport) -> None:
        """This node's step timing changed."""
        self.step_compute.set(report.compute)
        self.step_wall.set(report.wall)
        self.stalled.set(1.0 if report.stalled_since else 0.0)
        ran, since = self._ran, self._step_since
        if since is not None and report.steps > 0 and ran is not None and report.round == ran.round:
            self.first_step.observe(time.monotonic() - since)
            self._step_since = None

    def health_checked(self, result: CheckResult) -> None:
        """One run of --health-check ended."""
        assert self._health is not None, "made without health_check"
        runs, seconds, latest = self._health
        runs.labels(result.verdict.value).inc()
        seconds.set(result.seconds)
        latest.info({"result": result.verdict.value, "reason": "" if result.ok else result.reason})

    def state(self, state: WorkerState) -> None:
        for each in WorkerState:
            self.worker_state.labels(each.value).set(1.0 if each is state else 0.0)

    def round_over(self, *, failure: str = "") -> None:
        """This node's round ended.

        By a change elsewhere, or (`failure`: its cause) by a failure of its own
        workers, which it restarts."""
        self._ended_at = time.monotonic()
        if failure:
            self.restarts.labels(failure).inc()
            self._failed_here = True

    def round_started(self, assignment: Assignment) -> None:
        """This node has a place in a new round."""
        self.rounds.inc()
        self.round.set(assignment.round)
        self.world_size.set(assignment.world_size)
        self.nodes.set(assignment.node_count)
        before, self._ran = self._ran, assignment
        failed_here, self._failed_here = self._failed_here, False
        if before is None or failed_here:
            return
        if assignment.restart_count > before.restart_count:
            self.restarts.labels("peer_failure").inc()
        elif assignment.node_count > before.node_count:
            self.membership_changes.labels("scale_up").inc()
        elif assignment.node_count < before.node_count:
            self.membership_changes.labels("scale_down").inc()
        else:
            self.membership_changes.labels("replace").inc()

    def running(self) -> None:
        """This node's workers run in the round it started last."""
        if self._ended_at is not None:
            self.recovery.observe(time.monotonic() - self._ended_at)
            if self._step_since is None:
                self._step_since = self._ended_at
            self._ended_at = None


class _StragglerScores:
    """`elasticrun_straggler_score{node_id, score}`.

    One series per scored node and score, on the leader's agent, made at each scrape
    from the leader's latest verdict."""

    def __init__(self, scores: Callable[[], Mapping[str, tuple[float, float, bool]]]) -> None:
        self._scores = scores

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield self._family()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        for node_id, (relative, individual, _) in sorted(self._scores().items()):
            family.add_metric([node_id, "relative"], relative)
            family.add_metric([node_id, "individual"], individual)
        yield family

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "elasticrun_straggler_score",
            "On the leader's agent: each node's straggler scores, its compute time per step over the other nodes' "
            "median (relative) and over its own best of the round (individual)",
            labels=["node_id", "score"],
        )
