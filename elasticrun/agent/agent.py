"""The per-node agent: join a round, run the workers, and act on how the round ends.

One loop over a `RendezvousHandler`: `next_round()`, start the worker group, wait for
the first of (a worker failed or all succeeded, the round ended elsewhere, a signal to
the agent, an extra watch), stop the workers, then act. What to do is decided by one
small pure function, `next_action()`, which holds the whole restart policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import json
import logging
import os
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from elasticrun.agent.env import constant_env, round_env, worker_env
from elasticrun.agent.failures import (
    FailureReport,
    describe_exit,
    make_failure,
    make_report,
    read_error_file,
)
from elasticrun.agent.filetimer import TIMER_FILE_ENV, FileTimerServer
from elasticrun.agent.group_stacks import GroupStacks
from elasticrun.agent.output import Duplicates, StreamPlan, WorkerOutput, plan_streams, worker_stdio
from elasticrun.agent.processes import Warden, WorkerGroup
from elasticrun.agent.replica_wire import job_key
from elasticrun.agent.runfolder import DEFAULT_ROOT_PREFIX, create_new, make_private_folder, open_log
from elasticrun.agent.spec import Std, WorkerSpec, WorkerState
from elasticrun.agent.stacks import StackCapture, prepare_file, stacks_env
from elasticrun.agent.standby import Standbys, Taken, cold_reason
from elasticrun.agent.state_files import StateFiles
from elasticrun.agent.state_replicas import StateReplicas
from elasticrun.agent.step_reports import READ_INTERVAL, StepTimes, stall_reason
from elasticrun.agent.watchdog import Hang, ProgressWatchdog, hang_failure
from elasticrun.agent.worker_link import BrokenReport, WorkerChannel
from elasticrun.errors import (
    EXIT_INFRASTRUCTURE,
    EXIT_TRAINING_FAILED,
    JobEndedError,
    RendezvousClosedError,
    UsageError,
    WorkerStartError,
    exit_for_signal,
)
from elasticrun.first_of import first_of
from elasticrun.loglines import HEADLINE
from elasticrun.rendezvous.handler import AgentStatus, Assignment, RendezvousHandler
from elasticrun.rendezvous.records import ROUND_STREAM
from elasticrun.state_layout import STATE_FILE_VAR
from elasticrun.store.credentials import worker_credential

if TYPE_CHECKING:  # imported by the launcher only when metrics are asked for
    from elasticrun.agent.metrics import AgentMetrics

logger = logging.getLogger("elasticrun.agent")

#: the exit code of an agent that finds the job already closed, by outcome
_CLOSED_EXIT_CODES = {"succeeded": 0, "failed": EXIT_TRAINING_FAILED, "stopped": 0}
#: how long output still in the pipes may take to arrive once the workers are reaped
_DRAIN_TIMEOUT = 5.0

#: An extra reason to stop: a coroutine that returns (with the reason) when this node
#: must stop its workers and leave the job, e.g. a GPU health watch. Called once per
#: round, and once per wait for a round.
Watch = Callable[[], Awaitable[str]]

#: Before workers start again on this node's GPUs: wait, bounded, until the processes of
#: the stopped workers (these pids) hold no GPU memory; returns "" once free, else why
#: the GPU counts as sick (the node leaves, as when a watch fires).
Reclaim = Callable[[Set[int]], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class StatusEvent:
    """A worker's or the agent's status change, in torchrun's terms (its event log).

    `state` START, SUCCEEDED, FAILED or TERMINATED for a worker; RENDEZVOUS and
    ASSIGN_WORKER_RANKS (a round came), SUCCEEDED or FAILED for the agent, whose
    `global_rank` is None."""

    state: str
    global_rank: int | None = None
    local_rank: int | None = None
    pid: int | None = None
    exit_code: int | None = None
    group_rank: int | None = None
    group_world_size: int | None = None
    world_size: int | None = None
    restarts: int = 0


#: Where status events go (torchrun's --event-log-handler, see launcher/event_log.py)
EventSink = Callable[[StatusEvent], None]

#: torchrun's --logs-specs (launcher/torchrun_logs_specs.py): given one attempt's worker
#: environments (each may be updated, with TORCHELASTIC_ERROR_FILE), each local rank's
#: stream plans and error file, in place of the agent's own layout
LogLayout = Callable[[dict[int, dict[str, str]]], dict[int, tuple[dict[Std, StreamPlan], Path]]]


class Outcome(enum.Enum):
    """How one attempt of the worker group ended."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    ROUND_ENDED = "round ended"
    SIGNALLED = "signalled"
    WATCH = "watch fired"
    DRAINED = "drained"
    #: in-process mode: a worker's training failed, the worker waits for a new round
    BROKEN = "broken"
    #: the job ended elsewhere (stopped, or failed on another node): no round follows
    CLOSED = "closed"


class Action(enum.Enum):
    """What the agent does next."""

    FINISH = "finish"
    RESTART = "restart"
    FAIL = "fail"
    NEXT_ROUND = "next round"
    LEAVE = "leave"
    END = "end"


def next_action(outcome: Outcome, budget_spent: int, max_restarts: int, progressed: bool = False) -> Action:
    """The restart policy, whole.

    Only worker failures spend the budget; a round ended by others (a node joined or
    left) never does, nor (with --forgive-progress) a failure after the workers made
    progress since the previous one. A signal or a watch makes this node leave, and
    the others go on. A job that ended elsewhere ends here too.
    """
    match outcome:
        case Outcome.SUCCEEDED:
            return Action.FINISH
        case Outcome.FAILED | Outcome.BROKEN:
            return Action.RESTART if progressed or budget_spent < max_restarts else Action.FAIL
        case Outcome.ROUND_ENDED:
            return Action.NEXT_ROUND
        case Outcome.SIGNALLED | Outcome.WATCH | Outcome.DRAINED:
            return Action.LEAVE
        case Outcome.CLOSED:
            return Action.END


@dataclass(frozen=True, slots=True)
class AgentResult:
    """How the agent ended, for the launcher: exit with `exit_code`."""

    state: WorkerState
    exit_code: int
    message: str
    #: the failure report when workers failed beyond the budget (already logged)
    report: FailureReport | None = None
    #: the global ranks of this node's workers in the last round it ran
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class _Attempt:
    outcome: Outcome
    reason: str
    report: FailureReport | None
    #: what the rendezvous is told when this failure ends the job
    text: str = ""
    #: in-process mode: the workers go on into the next round (nothing stopped)
    kept: bool = False


#: why a worker in in-process mode may never have connected to its agent
_NOT_CONNECTED = (
    "with --elastic-mode=in-process the script must run its training through "
    "elasticrun.worker.elastic.run, which gets RANK, WORLD_SIZE and MASTER_ADDR from the agent"
)

#: in-process mode: how long a worker may take to import elasticrun.worker.elastic (and
#: so connect to its agent) before its node gives up without joining
_CONNECT_LIMIT = 60.0

#: when no step or heartbeat says the workers made progress: how long they run before
#: the next round's standbys start (elasticrun.agent.standby)
_STANDBY_AFTER = 10.0

#: outcomes after which this node leaves the job while the others go on
_LEAVING = (Outcome.SIGNALLED, Outcome.WATCH, Outcome.DRAINED)


@dataclass(slots=True)
class _Group:
    """A running worker group and what belongs to it, for as long as it lives."""

    workers: WorkerGroup
    outputs: dict[int, WorkerOutput]
    error_files: dict[int, Path]
    #: its workers' stacks (elasticrun.agent.group_stacks)
    stacks: GroupStacks
    duplicates: Duplicates | None = None
    #: the workers' step timing files (spec.step_timing)
    steps: StepTimes | None = None
    #: it has run a round (in-process mode starts it before the first)
    ran: bool = False
    #: its workers were standbys: the pipes of their streams, closed once drained
    taken: Taken | None = None


class Agent:
    """Runs this node's workers round after round until the job ends for this node.

    In restart mode (torchrun's) every round gets fresh workers. In in-process mode
    (`spec.in_process`) the workers outlive rounds: when a round ends because nodes
    joined or left, they are told over a `WorkerChannel` and given their place in the
    next round, and only a failure of this node's own workers, a signal or a drain
    stops them.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        handler: RendezvousHandler,
        *,
        watches: Sequence[Watch] = (),
        reclaim: Reclaim | None = None,
        metrics: AgentMetrics | None = None,
        events: EventSink | None = None,
        log_layout: LogLayout | None = None,
    ) -> None:
        self.spec = spec
        self.handler = handler
        self.watches = tuple(watches)
        self._reclaim = reclaim
        #: the processes of the last workers stopped, until the next start (with `reclaim`)
        self._stopped: set[int] = set()
        self.metrics = metrics
        self._events = events
        self._log_layout = log_layout
        self._signal: signal.Signals | None = None
        self._signalled = asyncio.Event()
        #: a second signal: the workers' grace period is cut short
        self._hurry = asyncio.Event()
        self._attempts = 0
        self._state: WorkerState | None = None  # None: before the first round
        self._reason = ""  # why it is in that state
        self._assignment: Assignment | None = None
        self._group: _Group | None = None
        #: kills what the workers spawned should the agent die; started by run()
        self._warden: Warden | None = None
        self._channel = WorkerChannel() if spec.in_process else None
        #: the next round's workers, started ahead (restart mode, --warm-imports)
        self._standbys: Standbys | None = None
        self._pids: tuple[int, ...] = ()
        #: in-process mode: the traceback of the last broken report
        self._broken_text = ""
        #: the hang the progress watchdog found in the current attempt
        self._hang: Hang | None = None
        #: where the ranks were when it was found: the summary, and the file with it all
        self._hang_stacks: tuple[list[str], Path | None] = ([], None)
        self._stacks = StackCapture(spec.node_id)
        #: this node's failure beyond the budget: (message, report, the report's or the
        #: in-process worker's traceback text, "" without one)
        self._failure: tuple[str, FailureReport | None, str] | None = None
        #: how the job ended elsewhere, as the round's end said
        self._closure: RendezvousClosedError | None = None
        #: this node's last attempt, when its workers failed and no round has run since
        self._failed_attempt: _Attempt | None = None
        #: progress since this node's previous worker failure (--forgive-progress):
        #: seconds the workers ran, and whether every worker called heartbeat()
        self._ran_since_failure = 0.0
        self._heartbeat_since_failure = False
        root = spec.options.log_dir or Path(tempfile.mkdtemp(prefix=DEFAULT_ROOT_PREFIX))
        #: per attempt: <log root>/<run id>_<node id>/attempt_<n>/<local rank>/; absolute,
        #: since the paths in it reach the workers (the token file), which may chdir
        self.run_dir = root.absolute() / f"{spec.run_id}_{spec.node_id}"
        #: the store's token for the workers, while the agent runs (see `_write_token_file`),
        #: and the run of the job it names
        self._token_file: Path | None = None
        self._token_run: str | None = None
        #: restart mode: each local rank's committed state, in host memory this agent
        #: owns (--state-memory; elasticrun.agent.state_files); made by run()
        self._state_files: StateFiles | None = None
        #: and their copies on a buddy node (elasticrun.agent.state_replicas); made by run()
        self._replicas: StateReplicas | None = None
        #: the run folder's events.jsonl, open while the agent runs (see `_write_event`)
        self._event_log: int | None = None
        #: torchrun's file timer, when asked for (spec.options.file_timer)
        self._timers: FileTimerServer | None = None
        if spec.options.file_timer is not None:
            path = Path(spec.options.file_timer) if spec.options.file_timer else self.run_dir / "timer_fifo"
            self._timers = FileTimerServer(path, lambda: self._pids)

    async def run(self) -> AgentResult:
        """Run until the job ends for this node; signals to the agent are handled here."""
        loop = asyncio.get_running_loop()
        self._warden = await Warden.start(self.spec.withheld_env)
        if not self.spec.in_process and self.spec.options.state_memory:
            self._state_files = StateFiles(self.run_dir, self.spec.options.state_memory, self._warden.remove_on_death)
            if self.handler.control.addr:  # a store to find the buddies through
                self._replicas = await self._start_replicas(self._state_files)
        for sig in self.spec.options.signals_to_handle:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            self._make_run_folder()
            if self._timers is not None:
                self._warden.remove_on_death(self._timers.path, self._timers.start())
            if self._channel is not None:
                await self._channel.start()
            self._standbys = self._make_standbys()
            return await self._run()
        finally:
            if self._timers is not None:
                self._timers.close()
            try:
                await self._stop_group()
                if self._standbys is not None:
                    await self._standbys.close()
            finally:
                await self._warden.close()  # the sessions are empty: it just exits
                if self._replicas is not None:
                    await self._replicas.close()
                if self._state_files is not None:
                    self._state_files.close()
                if self._token_file is not None:
                    self._token_file.unlink(missing_ok=True)
                if self._event_log is not None:
                    os.close(self._event_log)
                    self._event_log = None
            if self._channel is not None:
                await self._channel.close()
            for sig in self.spec.options.signals_to_handle:
                loop.remove_signal_handler(sig)

    async def _start_replicas(self, files: StateFiles) -> StateReplicas | None:
        assert self._warden is not None  # run() started it
        replicas = StateFiles(self.run_dir, files.size, self._warden.remove_on_death, kind="replica")
        key = job_key(self.spec.run_id, self.spec.store_token)
        made = StateReplicas(files, replicas, self.handler.control, self.spec.node_id, key, self._report_status)
        return made if await made.start() else None

    def _make_standbys(self) -> Standbys | None:
        """The standbys, where workers can start warm; else why not, said once at DEBUG."""
        spec = self.spec
        why = "in-process mode" if spec.in_process else cold_reason(spec.entrypoint)
        if not spec.options.warm_imports:
            why = why or "--warm-imports=off, or --no-python"
        if why:
            logger.debug("workers start cold: %s", why)
            return None
        assert self._warden is not None  # run() started it
        return Standbys(
            spec, self._warden, lambda r: constant_env(spec, r, os.environ, self._token_file), self._report_status
        )

    def _make_run_folder(self) -> None:
        """Make the run folder, private, and open its event log.

        A folder of someone else's, or a link where a file goes, is refused
        (elasticrun.agent.runfolder)."""
        try:
            self.run_dir.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(
                f"cannot create the log folder {self.run_dir.parent}: {e.strerror} (check --log-dir)"
            ) from e
        make_private_folder(self.run_dir)
        self._event_log = open_log(self.run_dir / "events.jsonl", truncate=False)

    def _write_token_file(self, run: str) -> Path | None:
        """Write the workers' store credential for run `run` of the job, readable by this user only.

        It is written again when the run changed, for the workers' store clients; None
        when the store has no token.

        The credential is a worker's of this run of this job (`worker_credential`),
        never the store's token: it reaches the c10d operations on this job's worker
        keys only, not the job's records, its spec or another job, and only while this
        run lasts. A file rather than a variable: a worker's environment ends up in
        logs, crash reports and experiment trackers, a file in the agent's run folder
        does not.
        """
        if self.spec.store_token is None:
            return None
        path = self.run_dir / "store_token"
        if self._token_run == run and self._token_file is not None:
            return path
        self._token_run = run
        token = worker_credential(self.spec.store_token, self.spec.run_id, run)
        with contextlib.suppress(OSError):
            path.unlink()  # one a killed agent left (or a link): never written into
        with os.fdopen(create_new(path, "store token file"), "w") as f:
            f.write(token)
            made = os.fstat(f.fileno())
        assert self._warden is not None  # run() started it
        self._warden.remove_on_death(path, made)  # should the agent be killed
        return path

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._signal is None:
            logger.warning(
                "agent received %s: stopping workers (they have %gs to exit, --shutdown-timeout; a second "
                "signal kills them at once), leaving the job", sig.name, self.spec.options.stop_grace,
            )
            self._signal = sig
            self._signalled.set()
        elif not self._hurry.is_set():
            logger.warning("agent received %s again: killing the workers now", sig.name)
            self._hurry.set()

    async def _wait_signal(self) -> None:
        await self._signalled.wait()

    async def _run(self) -> AgentResult:
        logger.info("worker logs and error files go under %s", self.run_dir)
        if self._channel is not None:
            await self._warm_up(self._channel)
        while True:
            waiting = self.handler.waiting_status
            if waiting is not None:  # else the job is over for this node: no wait to log
                self._set_state(WorkerState.INIT, waiting)
            try:
                # the watches too: a spare that turns unfit must not step in
                assignment = await first_of(
                    self.handler.next_round(), self._wait_signal(), self.handler.drained(),
                    *(self._watched(watch) for watch in self.watches),
                )
            except RendezvousClosedError as e:
                return await self._closed(e)
            if isinstance(assignment, tuple):  # a watch fired: leave, kept out
                _, reason = assignment
                await self.handler.leave(reason, keep_out=True)
                return self._end(WorkerState.STOPPED, self._leaving_code(Outcome.WATCH), reason)
            if not isinstance(assignment, Assignment):
                reason = assignment or f"the agent received {self._signal_name()}"
                await self.handler.leave(reason)
                code = exit_for_signal(self._signal) if self._signal is not None else 0
                return self._end(WorkerState.STOPPED, code, reason)
            before = self._assignment
            if before is not None and assignment.restart_count > before.restart_count:
                # a worker failure, here or on another node: progress counts from it
                self._ran_since_failure, self._heartbeat_since_failure = 0.0, False
            self._assignment = assignment
            self._failed_attempt = None
            if self.metrics is not None:
                self.metrics.round_started(assignment)
            if self._events is not None:
                for step in ("RENDEZVOUS", "ASSIGN_WORKER_RANKS"):  # torchrun's, once a round came
                    self._events(self._status_event(step, None, None))
            try:
                attempt = await self._run_attempt(assignment)
            except WorkerStartError as e:
                await self.handler.leave(str(e))
                raise
            forgiven = ""
            if attempt.outcome in (Outcome.FAILED, Outcome.BROKEN):
                self._failed_attempt = attempt
                if self.handler.closed_by_success(assignment.round):
                    return await self._failed_after_success(attempt)
                forgiven = self._forgiveness()
            spent, budget = assignment.budget_spent, self.spec.max_restarts
            action = next_action(attempt.outcome, spent, budget, bool(forgiven))
            if self.metrics is not None and action in (Action.RESTART, Action.FAIL, Action.NEXT_ROUND):
                cause = "hang" if self._hang is not None else "worker_failure"
                self.metrics.round_over(failure=cause if action is Action.RESTART else "")
            match action:
                case Action.FINISH:
                    result = self._end(WorkerState.SUCCEEDED, 0, "all workers succeeded")
                    await self.handler.finish()  # after the state: the job's end keeps the last report
                    return result
                case Action.RESTART:
                    count = f"forgiven: {forgiven}; {spent}/{budget} spent" if forgiven else f"{spent + 1}/{budget}"
                    doing = f"restarting ({count})"
                    if assignment.node_count > 1 and not forgiven:
                        # A peer that died breaks our collectives too: then the leader
                        # opens a round without it, and no restart is spent. Not yet
                        # known here: the next round's line says which it was.
                        doing = f"asking the leader to restart (it spends {count} unless a node was lost meanwhile)"
                    self._set_state(WorkerState.STOPPED, f"{attempt.reason}; {doing}")
                    if attempt.text:  # in-process: the worker said one line; the rest is here
                        logger.info("worker traceback:\n%s", attempt.text)
                    await self.handler.request_restart(attempt.reason, forgiven=bool(forgiven))
                case Action.FAIL:
                    report = attempt.report
                    text = report.text if report is not None else attempt.text or attempt.reason
                    # Not a warning yet: if a node died meanwhile, its death broke our
                    # workers, and the leader's verdict (a new round) is what to show.
                    logger.info(
                        "%s; no restarts left (--max-restarts=%d): asking the leader to end the job, "
                        "unless it finds a node was lost",
                        attempt.reason, self.spec.max_restarts,
                    )
                    self._failure = (
                        f"{attempt.reason}; no restarts left "
                        f"(--max-restarts={self.spec.max_restarts})",
                        report,
                        report.text if report is not None else attempt.text,
                    )
                    # The job ends for every node (next_round says so), unless the
                    # rendezvous finds a node died meanwhile and breaking the workers'
                    # collectives is its doing: then a new round follows, for free.
                    await self.handler.fail(text)
                case Action.NEXT_ROUND if attempt.kept:
                    # the same workers go on: no stop to report, only why the group re-forms
                    logger.info("%s: re-forming in place, the workers kept", attempt.reason, extra=HEADLINE)
                case Action.NEXT_ROUND:
                    self._set_state(WorkerState.STOPPED, attempt.reason)
                case Action.LEAVE:
                    return self._end(WorkerState.STOPPED, self._leaving_code(attempt.outcome), attempt.reason)
                case Action.END:
                    assert self._closure is not None  # set with Outcome.CLOSED
                    return await self._closed(self._closure)

    async def _run_attempt(self, assignment: Assignment) -> _Attempt:
        """Run the workers in `assignment`'s round until it ends; stop them unless kept.

        A leaving node leaves the rendezvous before it stops its workers: the others
        must see it go before their collectives with it break, or they would take the
        break for a worker failure (and spend a restart on it).
        """
        spec = self.spec
        # A fresh watchdog each round: its clock starts now (kept workers waited idle).
        self._hang, self._hang_stacks = None, ([], None)
        dog = self._watchdog()
        started = time.monotonic()
        in_place = self._group is not None and self._group.ran  # in-process: kept from a round
        if self._group is None:
            sick = await self._reclaimed()
            if sick:  # as a watch that fired: the node leaves, kept out
                await self.handler.leave(sick, keep_out=True)
                return _Attempt(Outcome.WATCH, sick, None)
            self._group = await self._start_group(assignment, dog)
        group = self._group
        group.ran = True
        if self._channel is not None:
            self._channel.assign(
                assignment.round,
                {r: round_env(assignment, r) for r in range(spec.nproc_per_node)},
            )
            for local_rank, output in group.outputs.items():
                output.global_rank = assignment.rank_offset + local_rank
        self._pids = tuple(proc.pid for proc in group.workers.procs.values())
        last_rank = assignment.rank_offset + spec.nproc_per_node - 1
        self._set_state(
            WorkerState.HEALTHY,
            f"round {assignment.round}{', re-formed in place' if in_place else ''}: node rank {assignment.node_rank}/"
            f"{assignment.node_count}, ranks {assignment.rank_offset}-{last_rank} of "
            f"{assignment.world_size}, restart {assignment.budget_spent}/"
            f"{spec.max_restarts}{f' (+{assignment.forgiven} forgiven)' if assignment.forgiven else ''}, "
            f"master {assignment.master_addr}:"
            f"{assignment.master_port}",
        )
        for local_rank in range(spec.nproc_per_node):
            rank = assignment.rank_offset + local_rank
            self.handler.control.report_output(rank, ROUND_STREAM, [
                f"--- round {assignment.round}{' (re-formed in place)' if in_place else ''}: rank {rank} of "
                f"{assignment.world_size} on node {spec.node_id}, restart {assignment.restart_count} ---"
            ])
        if self.metrics is not None:
            self.metrics.running()
        broken = () if self._channel is None else (self._broken(assignment),)
        hung = () if dog is None or spec.progress_timeout is None else (self._hung(dog, group.steps),)
        timed = () if group.steps is None else (self._time_steps(group.steps, group.stacks, assignment),)
        warm = () if self._standbys is None else (self._stand_by_after_progress(group, dog),)
        try:
            # The round's end goes first: workers that failed because the round ended
            # elsewhere (peers gone, this node's lease lost) are no failure of theirs.
            outcome, reason = await first_of(
                self._round_ended(),
                self._workers_done(group.workers),
                *hung,
                self._signalled_outcome(),
                self._drained_outcome(),
                *(self._watched(watch) for watch in self.watches),
                *broken,
                group.stacks.answer(assignment),
                *timed,
                *warm,
            )
        except BaseException:
            await self._stop_group()
            raise
        self._ran_since_failure += time.monotonic() - started
        self._heartbeat_since_failure |= dog is not None and spec.forgive_heartbeat and dog.progressed()
        if outcome is Outcome.BROKEN:  # the workers wait for the next round
            return _Attempt(outcome, reason, None, self._broken_text)
        if outcome is Outcome.ROUND_ENDED and self._keeps_workers():
            assert self._channel is not None
            self._channel.change(assignment.round, interrupt=self.handler.peers_lost())
            broke = self._channel.broken_in(assignment.round)
            if broke is not None:  # a peer's re-formation, not a failure: said in the same line
                reason += (
                    f" (worker rank {self._global_rank(broke)}'s collective broke as its peers re-formed: "
                    f"{broke.last_line()})"
                )
            return _Attempt(outcome, reason, None, kept=True)
        if self._hang is not None:  # before the workers stop: where are they stuck?
            self._hang_stacks = await group.stacks.of_hang(assignment, self._hang)
        elif outcome is Outcome.ROUND_ENDED and self.handler.peers_lost():
            await group.stacks.at_round_end(assignment, reason)
        if outcome in _LEAVING:
            # a watch that fired found this node unfit (a sick GPU, a failed health
            # check): the job keeps it out (quarantined), whatever comes of its agent
            await self.handler.leave(reason, keep_out=outcome is Outcome.WATCH)
        await self._stop_group()
        self._worker_events(group, assignment, outcome)
        if outcome is not Outcome.FAILED:
            return _Attempt(outcome, reason, None)
        report = self._failure_report(group, assignment)
        root = report.root_cause
        timer = self._timers.reaped.pop(root.pid, None) if self._timers is not None else None
        if self._hang is not None:
            reason = self._hang.reason(root.global_rank)
        elif timer is not None:
            reason = (
                f"worker rank {root.global_rank}: its file timer {timer.scope!r} expired: sent {timer.signal_name()}"
            )
        else:
            reason = f"worker rank {root.global_rank} failed with {describe_exit(root.returncode)}"
        return _Attempt(outcome, reason, report)

    async def _reclaimed(self) -> str:
        """Wait until the last workers' GPU memory is free ("": it is, or no wait)."""
        stopped, self._stopped = self._stopped, set()
        if self._reclaim is None or not stopped:
            return ""
        return await self._reclaim(stopped)

    def _forgiveness(self) -> str:
        """Why this worker failure spends no restart ("": it does), by the progress made since the last one.

        That is --forgive-progress; the count starts again."""
        spec, why = self.spec, ""
        if spec.forgive_heartbeat and self._heartbeat_since_failure:
            why = "every worker made progress (heartbeat) since the previous failure"
        elif spec.forgive_after is not None and self._ran_since_failure >= spec.forgive_after:
            why = f"the workers ran {self._ran_since_failure:.0f}s since the previous failure"
        self._ran_since_failure, self._heartbeat_since_failure = 0.0, False
        return why

    def _watchdog(self) -> ProgressWatchdog | None:
        """A progress watchdog whose clock starts now.

        With --progress-timeout it watches; for --forgive-progress heartbeat alone it
        only keeps the progress files."""
        if self.spec.progress_timeout is None and not self.spec.forgive_heartbeat:
            return None
        make_private_folder(self.run_dir / "progress")
        return ProgressWatchdog(
            self.spec.progress_timeout, self.run_dir / "progress", range(self.spec.nproc_per_node),
            start_timeout=self.spec.progress_start_timeout,
        )

    async def _hung(self, dog: ProgressWatchdog, steps: StepTimes | None) -> tuple[Outcome, str]:
        hang = await dog.hang()
        waiting = steps.waiting_in(hang.local_rank) if steps is not None else ""
        if waiting:
            # It waits in a collective for a peer. A worker of this node that has been
            # silent half as long outside any collective is what it waits for: that
            # one is the hang (its last step came a moment after the other's).
            silences = dog.silences()
            assert steps is not None and dog.timeout is not None
            stuck = [r for r, silent in silences.items() if silent >= dog.timeout / 2 and not steps.waiting_in(r)]
            if stuck:
                rank = max(stuck, key=lambda r: (silences[r], -r))
                hang = Hang(local_rank=rank, silent_for=silences[rank], never=dog.never_progressed(rank))
            else:
                hang = dataclasses.replace(hang, waiting=waiting)
        self._hang = hang
        return Outcome.FAILED, "a worker hung"

    async def _time_steps(self, steps: StepTimes, stacks: GroupStacks, assignment: Assignment) -> tuple[Outcome, str]:
        """Report this node's step timing while the round runs (it never ends an attempt).

        A node that stalls (no step for many of its usual steps) says so once, with where
        the job's ranks are: no flag is needed to be told, and nothing is killed."""
        last, stalled = None, 0.0
        while True:
            await asyncio.sleep(READ_INTERVAL)
            importing = self._standbys is not None and self._standbys.importing()
            report = steps.report(self.spec.node_id, assignment, importing=importing)
            if report is None or dataclasses.replace(report, at=0.0) == last:
                continue
            last = dataclasses.replace(report, at=0.0)
            self.handler.control.report_steps(report)
            if self.metrics is not None:
                self.metrics.steps(report)
            if report.stalled_since and not stalled:
                await stacks.of_stall(assignment, stall_reason(report))
            elif stalled and not report.stalled_since:
                logger.warning(
                    "the workers step again, after %.0fs without a step", report.last_step - stalled, extra=HEADLINE
                )
            stalled = report.stalled_since

    async def _stand_by_after_progress(self, group: _Group, dog: ProgressWatchdog | None) -> tuple[Outcome, str]:
        """Start the next round's standbys once every worker made its first step; never returns.

        Not before: a standby's imports would compete with the workers' own start. A
        script whose steps nothing sees (no optimizer, no heartbeat) gets them after
        _STANDBY_AFTER seconds of running."""
        assert self._standbys is not None
        waited = 0.0
        while waited < _STANDBY_AFTER:
            steps = group.steps.read() if group.steps is not None else {}
            if len(steps) == self.spec.nproc_per_node and all(w.steps > 0 for w in steps.values()):
                break
            if dog is not None and dog.progressed():
                break
            await asyncio.sleep(READ_INTERVAL)
            waited += READ_INTERVAL
        self._standbys.start()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def _warm_up(self, channel: WorkerChannel) -> None:
        """In-process mode: start the workers before joining.

        So the job does not wait for their imports, model building and data loading when
        the round forms.

        The worker API connects when the script imports it, so a script that does not
        use it is found here, before this node joins: it exits (it finds no RANK) or
        stays silent for _CONNECT_LIMIT seconds, and the node does not join.
        """
        self._set_state(WorkerState.INIT, "starting workers before joining (in-process mode)")
        group = self._group = await self._start_group(None, self._watchdog())
        ranks = list(range(self.spec.nproc_per_node))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_CONNECT_LIMIT):
                await first_of(
                    channel.wait_connected(ranks), group.workers.wait(), self._wait_signal()
                )
        if self._signal is not None:
            return  # the loop leaves at once
        if channel.connected(ranks):
            # Join once the script asks for its first round: a running job keeps
            # training meanwhile instead of waiting in the new round for this node's
            # model building and data loading. A worker that fails first is judged
            # in the round, like any worker failure.
            await first_of(channel.wait_ready(ranks), group.workers.wait(), self._wait_signal())
            return
        exits = sorted(group.workers.exits.values(), key=lambda e: (not e.failed, e.time))
        local_rank = exits[0].local_rank if exits else next(r for r in ranks if not channel.connected([r]))
        what = (
            f"exited with {describe_exit(exits[0].returncode)}"
            if exits
            else f"did not connect within {_CONNECT_LIMIT:g}s"
        )
        await self._stop_group()
        raise WorkerStartError(
            f"worker local rank {local_rank} {what} before it connected to its agent ({_NOT_CONNECTED})"
        )

    def _keeps_workers(self) -> bool:
        """In-process mode, with every worker on the line (using the worker API)."""
        if self._channel is None:
            return False
        ranks = list(range(self.spec.nproc_per_node))
        if self._channel.connected(ranks):
            return True
        logger.warning(
            "a worker never connected to its agent (%s): restarting this node's workers for "
            "the new round instead",
            _NOT_CONNECTED,
        )
        return False

    async def _start_group(
        self, assignment: Assignment | None, dog: ProgressWatchdog | None
    ) -> _Group:
        """Start this node's workers (in in-process mode before any round: no assignment)."""
        spec = self.spec
        attempt_dir = self.run_dir / f"attempt_{self._attempts}"
        self._attempts += 1
        socket_path = self._channel.path if self._channel is not None else None
        self._token_file = self._write_token_file(assignment.run if assignment is not None else "")
        envs, error_files, plans, stack_files = {}, {}, {}, {}
        buddy_env = {}
        if self._replicas is not None and assignment is not None:
            buddy_env = await self._replicas.round_starts(assignment, spec.nproc_per_node)
        make_private_folder(attempt_dir)
        steps = None
        if spec.step_timing:
            make_private_folder(self.run_dir / "steps")
            steps = StepTimes(self.run_dir / "steps", range(spec.nproc_per_node))
        for local_rank in range(spec.nproc_per_node):
            worker_dir = attempt_dir / str(local_rank)
            make_private_folder(worker_dir)
            error_files[local_rank] = worker_dir / "error.json"
            error_files[local_rank].unlink(missing_ok=True)
            envs[local_rank] = worker_env(
                spec, assignment, local_rank, os.environ, error_files[local_rank], socket_path, self._token_file
            )
            if dog is not None:
                envs[local_rank].update(dog.env(local_rank))
            if steps is not None:
                envs[local_rank].update(steps.env(local_rank))
            stack_files[local_rank] = worker_dir / "stacks"
            prepare_file(stack_files[local_rank])
            envs[local_rank].update(stacks_env(stack_files[local_rank]))
            if self._timers is not None:
                envs[local_rank][TIMER_FILE_ENV] = str(self._timers.path)
            if self._state_files is not None:
                envs[local_rank][STATE_FILE_VAR] = str(self._state_files.path(local_rank))
                envs[local_rank].update(buddy_env.get(local_rank, {}))
            plans[local_rank] = plan_streams(spec, local_rank, worker_dir)
        if self._log_layout is not None:
            for local_rank, (plan, error_file) in self._log_layout(envs).items():
                plans[local_rank], error_files[local_rank] = plan, error_file
        with worker_stdio(plans) as stdio:
            assert self._warden is not None  # run() started it
            taken = None
            if self._standbys is not None and assignment is not None:
                taken = await self._standbys.take(envs, stdio)
            if taken is not None:
                workers = taken.workers
            else:
                workers = await WorkerGroup.start(spec.entrypoint, envs, self._warden, stdio, spec.cpu_affinity)
        duplicates = Duplicates(attempt_dir, spec.options.duplicate_filters) if spec.options.duplicate_filters else None
        stacks = GroupStacks(self._stacks, self.handler.control, workers, stack_files, attempt_dir)
        group = _Group(workers, {}, error_files, stacks, duplicates, steps, taken=taken)
        try:
            for local_rank, proc in workers.procs.items():
                group.outputs[local_rank] = WorkerOutput(
                    taken.streams[local_rank] if taken is not None else (proc.stdout, proc.stderr),
                    (assignment.rank_offset if assignment else 0) + local_rank,
                    plans[local_rank],
                    publish=self.handler.control.report_output,
                    prefix_template=spec.options.log_line_prefix_template,
                    local_rank=local_rank,
                    role=spec.role,
                    duplicates=duplicates,
                    json_node=spec.node_id if spec.options.console_json else None,
                )
        except BaseException:
            self._group = group
            await self._stop_group()
            raise
        if self._events is not None:
            for local_rank, proc in workers.procs.items():
                self._events(self._status_event("START", local_rank, assignment, pid=proc.pid))
        return group

    def _status_event(
        self, state: str, local_rank: int | None, assignment: Assignment | None, **facts: int | None
    ) -> StatusEvent:
        offset = assignment.rank_offset if assignment else 0
        return StatusEvent(
            state,
            global_rank=None if local_rank is None else offset + local_rank,
            local_rank=local_rank,
            group_rank=assignment.node_rank if assignment else None,
            group_world_size=assignment.node_count if assignment else None,
            world_size=assignment.world_size if assignment else None,
            restarts=assignment.restart_count if assignment else 0,
            **facts,
        )

    def _worker_events(self, group: _Group, assignment: Assignment, outcome: Outcome) -> None:
        """Each worker's end, as torchrun records it: its own failure, else the group's.

        When the group failed, torchrun books every worker that ended with a non-zero
        status as FAILED, those it stopped itself included (its `_poll` captures their
        SIGTERM exits "for bookkeeping"); a worker that exited 0 is TERMINATED."""
        if self._events is None:
            return
        for local_rank, proc in group.workers.procs.items():
            end = group.workers.exits.get(local_rank)
            if end is not None and (end.failed or (outcome is Outcome.FAILED and end.returncode != 0)):
                state, code = "FAILED", end.returncode
            elif outcome is Outcome.SUCCEEDED:
                state, code = "SUCCEEDED", None
            else:
                state, code = "TERMINATED", None
            self._events(self._status_event(state, local_rank, assignment, pid=proc.pid, exit_code=code))

    async def _stop_group(self) -> None:
        """Stop the workers (if any run) and collect their remaining output."""
        group, self._group = self._group, None
        if group is None:
            return
        if self._channel is not None:
            self._channel.disconnect()
        if self._reclaim is not None:
            # who may hold GPU memory, found while they live; on the loop (as the stop's
            # own first scan), since an await here could lose the stop to a cancellation
            self._stopped = group.workers.tree()
        await group.workers.stop(self._signal or signal.SIGTERM, grace=self.spec.options.stop_grace, hurry=self._hurry)
        await asyncio.gather(*(o.drain(_DRAIN_TIMEOUT) for o in group.outputs.values()))
        if group.taken is not None:
            group.taken.close()
        if group.duplicates is not None:
            group.duplicates.close()

    def _failure_report(self, group: _Group, assignment: Assignment) -> FailureReport:
        """The root cause first: the hung worker when the watchdog ended the attempt."""
        spec = self.spec
        hang = self._hang
        if hang is not None:
            failures = [
                hang_failure(
                    hang,
                    node_id=spec.node_id,
                    node_rank=assignment.node_rank,
                    rank_offset=assignment.rank_offset,
                    pid=group.workers.procs[hang.local_rank].pid,
                    returncode=group.workers.exits[hang.local_rank].returncode,
                    timeout=spec.progress_timeout or 0.0,
                    stderr_tail=list(group.outputs[hang.local_rank].stderr_tail),
                )
            ]
            lines, path = self._hang_stacks
            return make_report(
                failures, title=self._report_title(), stacks=lines, stacks_file=str(path) if path else ""
            )
        failures = [
            make_failure(
                e,
                node_id=spec.node_id,
                node_rank=assignment.node_rank,
                rank_offset=assignment.rank_offset,
                error_file=group.error_files[e.local_rank],
                error=read_error_file(group.error_files[e.local_rank]),
                stderr_tail=list(group.outputs[e.local_rank].stderr_tail),
            )
            for e in group.workers.exits.values()
            if e.failed
        ]
        return make_report(failures, title=self._report_title())

    def _report_title(self) -> str:
        return f"job '{self.spec.run_id}' failed: {self.spec.title or ' '.join(self.spec.entrypoint)}"

    async def _workers_done(self, group: WorkerGroup) -> tuple[Outcome, str]:
        exits = await group.wait()
        if any(e.failed for e in exits):
            return Outcome.FAILED, "a worker failed"
        return Outcome.SUCCEEDED, "all workers succeeded"

    async def _round_ended(self) -> tuple[Outcome, str]:
        try:
            return Outcome.ROUND_ENDED, await self.handler.round_ended()
        except RendezvousClosedError as e:
            self._closure = e
            return Outcome.CLOSED, str(e)

    async def _signalled_outcome(self) -> tuple[Outcome, str]:
        await self._signalled.wait()
        return Outcome.SIGNALLED, f"the agent received {self._signal_name()}"

    async def _drained_outcome(self) -> tuple[Outcome, str]:
        return Outcome.DRAINED, await self.handler.drained()

    async def _watched(self, watch: Watch) -> tuple[Outcome, str]:
        return Outcome.WATCH, await watch()

    async def _broken(self, assignment: Assignment) -> tuple[Outcome, str]:
        """A worker's failure in `assignment`'s round, once it is known to be one.

        A collective that broke may be a peer's re-formation (its agent heard of a new
        round, or lost its lease, a moment before this one): it counts as a failure
        only if the round has not ended within `assignment.settle`. The round's end
        wins the race (`_run_attempt`), and the workers re-form in place, no restart
        spent."""
        assert self._channel is not None
        report = await self._channel.broken(assignment.round)
        if report.by_peer and assignment.node_count > 1:
            await asyncio.sleep(assignment.settle)
        self._broken_text = report.error
        return Outcome.BROKEN, f"worker rank {self._global_rank(report)}: training failed: {report.last_line()}"

    def _global_rank(self, report: BrokenReport) -> int:
        return (self._assignment.rank_offset if self._assignment else 0) + report.local_rank

    def _leaving_code(self, outcome: Outcome) -> int:
        """Drained: done (0). Signalled: 128+N. A watch (a sick GPU): the infrastructure."""
        if outcome is Outcome.SIGNALLED and self._signal is not None:
            return exit_for_signal(self._signal)
        return 0 if outcome is Outcome.DRAINED else EXIT_INFRASTRUCTURE

    def _signal_name(self) -> str:
        return self._signal.name if self._signal is not None else "a signal"

    async def _closed(self, e: RendezvousClosedError) -> AgentResult:
        failed, assignment = self._failed_attempt, self._assignment
        if failed is not None and assignment is not None and self.handler.closed_by_success(assignment.round):
            # it closed while this node asked for a restart (or the job's end) in that round;
            # a failure the leader answered with a round without this node (a quarantine) is over
            return await self._failed_after_success(failed)
        if e.outcome == "failed" and self._failure is not None:
            message, report, text = self._failure
            if text:
                logger.error("%s", text)
            return self._end(WorkerState.FAILED, EXIT_TRAINING_FAILED, message, report)
        code = _CLOSED_EXIT_CODES.get(e.outcome, EXIT_TRAINING_FAILED)
        if isinstance(e, JobEndedError):  # nothing of this node took part: no outcome of its own
            return self._end(WorkerState.STOPPED, code, str(e), level=logging.WARNING)
        state = {
            "succeeded": WorkerState.SUCCEEDED,
            "failed": WorkerState.FAILED,
        }.get(e.outcome, WorkerState.STOPPED)
        return self._end(state, code, str(e))

    async def _failed_after_success(self, attempt: _Attempt) -> AgentResult:
        """This node's workers failed after another node's succeeded and closed the job.

        No round can follow (the nodes that succeeded have finished), and a failure is
        never covered by a success: the job failed, and this node exits as torchrun's
        node of a failed rank does (1), whatever the others' exit codes."""
        report = attempt.report
        text = report.text if report is not None else attempt.text
        message = (
            f"{attempt.reason}, after another node's workers succeeded and closed the job: "
            "no restart can follow, the job failed"
        )
        detail = f"{attempt.reason} on node {self.spec.node_id}, after another node's workers succeeded"
        await self.handler.fail(f"{detail}\n{text}" if text else detail)
        if text:
            logger.error("%s", text)
        return self._end(WorkerState.FAILED, EXIT_TRAINING_FAILED, message, report)

    def _end(
        self,
        state: WorkerState,
        exit_code: int,
        message: str,
        report: FailureReport | None = None,
        level: int | None = None,
    ) -> AgentResult:
        self._set_state(state, message, level)
        if self._events is not None and state in (WorkerState.SUCCEEDED, WorkerState.FAILED):
            self._events(self._status_event(state.name, None, self._assignment))
        ranks: tuple[int, ...] = ()
        if self._assignment is not None:
            first = self._assignment.rank_offset
            ranks = tuple(range(first, first + self.spec.nproc_per_node))
        return AgentResult(state, exit_code, message, report, ranks)

    def _set_state(self, state: WorkerState, reason: str, level: int | None = None) -> None:
        """One log line, one event, one status report per state change.

        Shown by default (a headline): the workers started, stopped and why, ended. A
        wait for a round is the rendezvous' to show, once it lasts.
        """
        if level is None:
            level = logging.WARNING if state is WorkerState.FAILED else logging.INFO
        before = self._state.value if self._state is not None else "start"
        extra = None if state is WorkerState.INIT else HEADLINE
        logger.log(level, "workers %s -> %s: %s", before, state.value, reason, extra=extra)
        self._state = state
        if self.metrics is not None:
            self.metrics.state(state)
        if state is not WorkerState.HEALTHY:
            self._pids = ()
        self._write_event(state.value, reason)
        if state is not WorkerState.INIT:
            # A wait ("round 3 opened: reading this node's place in it") is every node's
            # at every round: in the job's events it would push the causes out of sight.
            self.handler.control.report_event(state.value, reason)
        self._reason = reason
        self._report_status()

    def _report_status(self) -> None:
        """This node's status for `elasticrun status`: on each state change, and when its standbys change."""
        if self._state is None:
            return
        standby = self._standbys.state().value if self._standbys is not None else "off"
        held, replicated = (self._replicas.held, self._replicas.replicated) if self._replicas else (-1, -1)
        self.handler.control.report_status(
            AgentStatus(
                self._state.value, self._reason, self._assignment, self._pids, self._attempts, standby,
                state_held=held, state_replicated=replicated,
            )
        )

    def _write_event(self, kind: str, detail: str) -> None:
        """Append to this node's event log (JSON lines) beside its worker logs."""
        if self._event_log is None:
            return
        event = {"at": time.time(), "node": self.spec.node_id, "kind": kind, "detail": detail}
        try:
            os.write(self._event_log, (json.dumps(event) + "\n").encode())
        except OSError as e:
            logger.warning("cannot write the event log in %s: %s", self.run_dir, e.strerror)

