"""`elasticrun status`: the job and its nodes as a table (or JSON), once or live."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path

from elasticrun.errors import StoreUnavailableError
from elasticrun.launcher import ended_here
from elasticrun.launcher.control import JobTarget, JobView, add_job_flags, job_target, job_view, read_records
from elasticrun.launcher.printable import shown
from elasticrun.rendezvous.job_records import JobRecords
from elasticrun.rendezvous.records import NodeStatus, StepReport, Straggler
from elasticrun.rendezvous.rounds import Round
from elasticrun.rendezvous.stack_summary import one_line
from elasticrun.store.interface import EventType, WatchEvent

#: a live view redraws at most this often
_WATCH_INTERVAL = 0.5
EVENTS_SHOWN = 10
#: the latest stacks' summary is cut to this many characters (elasticrun stacks has it all)
STACKS_SHOWN = 200


def age(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def _restarts(r: Round | None) -> str:
    """Restarts spent of the budget, and the forgiven ones (--forgive-progress)."""
    if r is None:
        return "0"
    spent = r.restart_count - r.forgiven
    return f"{spent} (+{r.forgiven} forgiven)" if r.forgiven else str(spent)


def seconds(value: float) -> str:
    """A step's time: `210ms`, `1.40s`."""
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.2f}s"


def _steps(view: JobView) -> dict[str, StepReport]:
    """The nodes' step reports of the current round (an earlier round's are stale)."""
    r = view.round
    return {n: s for n, s in view.steps.items() if r is not None and s.round == r.number}


def _stragglers(view: JobView) -> dict[str, Straggler]:
    """The stragglers the leader named in the current round."""
    r, report = view.round, view.stragglers
    if r is None or report is None or report.round != r.number:
        return {}
    return {s.node_id: s for s in report.nodes}


def _step_cell(report: StepReport | None, now: float) -> str:
    """`210ms`, and where every worker of the node has waited long: `, in all_reduce 5m02s`."""
    if report is None:
        return "-"
    waiting = f", in {report.waiting} {age(now - report.waiting_since)}" if report.waiting else ""
    return seconds(report.compute) + waiting


def render(view: JobView, now: float, *, timing: bool = True) -> str:
    """The status page: the job, its nodes, its latest events.

    With `timing`, each node's step compute time too, which changes with every report."""
    r = view.round
    low, high = view.min_max
    created = view.launch.created_at if view.launch else None
    world, nodes = (r.world_size, f"{len(r.participants)} ({low}:{high})") if r else (0, f"0 ({low}:{high})")
    if r is not None and r.closed:  # its members and spec are gone: what its nodes last reported
        placed = [s for s in view.statuses.values() if s.node_rank >= 0]
        world, nodes = max((s.world_size for s in placed), default=0), str(len(placed))
    job = [
        ["JOB", "STATE", "ROUND", "WORLD", "NODES", "RESTARTS", "DURATION"],
        [
            view.run_id,
            view.phase,
            str(r.number) if r else "-",
            str(world),
            nodes,
            _restarts(r),
            age(now - created) if created else "-",
        ],
    ]
    lines = [table(job)]
    if view.state is not None:
        lines.append(f"leader {view.state.leader}: {view.state.reason}")
    if r is not None and r.closed and r.detail:
        lines.append(f"{r.closed}: {r.detail.splitlines()[0] if r.detail else ''}")
    steps, slow = _steps(view), _stragglers(view)
    stalled = [s for s in steps.values() if s.stalled_since]
    if stalled and r is not None and not r.closed:
        stalled_at = min(s.stalled_since for s in stalled)
        usual = max(s.wall for s in stalled)
        lines.append(
            f"stalled: no step for {age(now - stalled_at)} on {len(stalled)} of {len(r.participants)} nodes "
            f"(usually {seconds(usual)} a step); nothing is stopped without --progress-timeout"
        )
    if view.stacks is not None and view.stacks.done:
        lines.append(_stacks_line(view))
    ranked = r.node_ranks() if r else {}
    ranks = _global_ranks(r)
    held = view.quarantine.active(now)
    order = sorted(view.nodes, key=lambda n: (ranked.get(n, len(ranked)), n))
    if r is not None and r.closed:  # the nodes are gone; their last reports stay for closed_ttl
        lines += _ended_nodes(view, now)
    elif order:
        rows = [[
            "NODE", "STATE", "AGE", "NODE RANK", "RANKS", "RESTARTS", "STANDBY", "COMMIT/COPIED", "STEP COMPUTE",
            "HOST", "GPUS",
        ]]
        for node_id in order:
            info, status = view.nodes[node_id], view.statuses.get(node_id)
            state = status.state if status else "registering"
            if status is not None and r is not None and node_id in ranked and status.round != r.number:
                state += f" (round {status.round})"  # it has not taken its place in this one yet
            if node_id in view.drains:
                state += " (draining)"
            rank = ranked.get(node_id)
            if node_id in held:
                state = "quarantined" if rank is None else state + " (quarantined)"
            if node_id in slow and rank is not None:
                state += " (straggler)"
            report = steps.get(node_id)
            if report is not None and report.stalled_since and rank is not None and state.startswith("healthy"):
                state = "stalled" + state[len("healthy"):]
            rows.append([
                node_id,
                state if rank is not None or state != "init" else "spare" if view.running else "waiting",
                age(now - info.started_at),
                str(rank) if rank is not None else "-",
                ranks.get(node_id, "-"),  # from the round, as the node rank: one round per row
                str(status.restarts) if status else "0",
                status.standby if status else "off",
                _commit_cell(status),
                _step_cell(steps.get(node_id) if rank is not None and timing else None, now),
                info.addr if info.addr == info.host else f"{info.host} ({info.addr})",
                f"{len(info.gpus)}x {info.gpus[0]}" if info.gpus else "-",
            ])
        lines += ["", table(rows)]
    if held:
        rows = [["QUARANTINED", "UNTIL", "LEFT", "TIMES", "REASON"]]
        for node_id, e in sorted(held.items(), key=lambda kv: kv[1].until):
            name = node_id if node_id in view.nodes else f"{node_id} (gone)"
            until = time.strftime("%H:%M:%S", time.localtime(e.until))
            rows.append([name, until, age(e.until - now), str(e.times), e.reason])
        lines += ["", table(rows)]
    if slow:
        assert view.stragglers is not None
        rows = [["STRAGGLER", "SINCE", "RELATIVE", "INDIVIDUAL", "REASON"]]
        for st in sorted(slow.values(), key=lambda st: -st.relative):
            since = time.strftime("%H:%M:%S", time.localtime(st.since))
            rows.append([st.node_id, since, f"{st.relative:.1f}x", f"{st.individual:.1f}x", st.reason])
        lines += ["", f"job median compute per step: {seconds(view.stragglers.median)}", table(rows)]
    if view.events:
        lines += ["", f"EVENTS (last {min(EVENTS_SHOWN, len(view.events))})"]
        for event in view.events[-EVENTS_SHOWN:]:
            at = time.strftime("%H:%M:%S", time.localtime(event.at))
            lines.append(f"{at}  {event.kind:<10} {event.node}  {event.detail}")
    return "\n".join(lines)


def _commit_cell(status: NodeStatus | None) -> str:
    """The last commit of the node's workers' state it holds, and of that what its buddy holds: `12/12`, `12/-`."""
    if status is None or status.state_held < 0:
        return "-"
    copied = str(status.state_replicated) if status.state_replicated >= 0 else "-"
    return f"{status.state_held}/{copied}"


def _global_ranks(r: Round | None) -> dict[str, str]:
    """Each member's global ranks (`4-7`) as the round places them.

    First the ranks of the members before it, in node-rank order."""
    ranks, first = {}, 0
    for p in r.participants if r else ():
        ranks[p.node_id] = f"{first}-{first + p.nproc - 1}"
        first += p.nproc
    return ranks


def _ended_nodes(view: JobView, now: float) -> list[str]:
    """The rows of an ended job: each node's last report (`Reporter.keep`)."""
    if not view.statuses:
        return []
    rows = [["NODE", "STATE", "AGE", "NODE RANK", "RANKS", "RESTARTS", "HOST", "GPUS"]]
    for s in sorted(view.statuses.values(), key=lambda s: (s.node_rank < 0, s.node_rank, s.node_id)):
        rows.append([
            s.node_id, s.state, age(now - s.started_at), str(s.node_rank) if s.node_rank >= 0 else "-",
            s.ranks or "-", str(s.restarts), s.addr if s.addr == s.host else f"{s.host} ({s.addr})",
            f"{len(s.gpus)}x {s.gpus[0]}" if s.gpus else "-",
        ])
    return ["", table(rows)]


def _stacks_line(view: JobView) -> str:
    """The latest stacks' summary, short: `stacks 03:12:07 (<why>): rank 3 on node n7: ...`."""
    s = view.stacks
    assert s is not None
    at = time.strftime("%H:%M:%S", time.localtime(s.at))
    text = one_line(s.summary) or "no node answered"
    if len(text) > STACKS_SHOWN:
        text = text[: STACKS_SHOWN - 3] + "..."
    return f"stacks {at} ({s.reason}; {s.answered} of {s.nodes} nodes): {text}"


def as_json(view: JobView, now: float | None = None) -> dict[str, object]:
    """The status as plain data for scripts."""
    now = time.time() if now is None else now
    held = view.quarantine.active(now)
    r = view.round
    ranked = r.node_ranks() if r else {}
    low, high = view.min_max
    steps, slow = _steps(view), _stragglers(view)
    return {
        "job": {
            "id": view.run_id,
            "state": view.phase,
            "round": r.number if r else 0,
            "world_size": r.world_size if r else 0,
            "nodes": [p.node_id for p in r.participants] if r else [],
            "min_nodes": low,
            "max_nodes": high,
            "restarts": r.restart_count if r else 0,
            "forgiven_restarts": r.forgiven if r else 0,
            "created_at": view.launch.created_at if view.launch else None,
            "leader": view.state.leader if view.state else view.leader or None,
            "reason": view.state.reason if view.state else (r.reason if r else ""),
            "detail": r.detail if r else "",
            "spec": asdict(view.spec) if view.spec else {},
        },
        "nodes": [
            {
                **asdict(info),
                "status": asdict(view.statuses[n]) if n in view.statuses else None,
                "node_rank": ranked.get(n),
                "draining": n in view.drains,
                "quarantined": n in held,
                # registered, outside a running round: steps in when a participant goes
                "spare": view.running and n not in held and n not in ranked,
                # its step timing this round, and the leader's verdict when it named it a straggler
                "steps": asdict(steps[n]) if n in steps and n in ranked else None,
                "straggler": asdict(slow[n]) if n in slow and n in ranked else None,
            }
            for n, info in sorted(view.nodes.items())
        ],
        # every node with a failure record; `quarantined` while it is kept out
        "quarantine": [
            {
                **asdict(e),
                "quarantined": e.active(now),
                "left_s": round(max(e.until - now, 0.0), 1),
                "registered": e.node_id in view.nodes,
            }
            for e in view.quarantine.entries
        ],
        "events": [asdict(e) for e in view.events],
        # an ended job's nodes are gone: their last reports stay for closed_ttl
        "ended_nodes": [asdict(s) for s in view.statuses.values()] if r is not None and r.closed else [],
        # the latest request for every node's stacks, with its summary once done
        "stacks": asdict(view.stacks) if view.stacks else None,
    }


async def show(target: JobTarget, *, as_data: bool, watch: bool) -> int:
    """Print the status once, or (`watch`) on every change.

    The job's watch is folded into the records read first; the last page is drawn even
    when the store goes away with the job (an agent that hosted it exits once every node
    has left)."""
    async with target.open() as store:
        records, revision = await read_records(store, target)
        page = _Page(as_data, in_place=watch and sys.stdout.isatty(), watching=watch)
        page.draw(job_view(records, revision))
        if not watch:
            return 0
        changes: asyncio.Queue[WatchEvent | StoreUnavailableError] = asyncio.Queue()
        pump = asyncio.ensure_future(_pump(store.watch(target.keys.prefix, start_revision=revision + 1, prefix=True),
                                           changes))
        try:
            while True:
                gone = await _fold(changes, records)
                page.draw(job_view(records, revision))
                if gone is not None:
                    head = records.head
                    if head is None or not head.closed:
                        raise gone
                    print(f"elasticrun: the store went away with the job ({gone.endpoint})", file=sys.stderr,
                          flush=True)
                    return 0
        finally:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)


async def _pump(events: AsyncIterator[WatchEvent], into: asyncio.Queue[WatchEvent | StoreUnavailableError]) -> None:
    """The job's watch, event by event, into a queue; its end (a store gone) last."""
    try:
        async for event in events:
            into.put_nowait(event)
    except StoreUnavailableError as e:
        into.put_nowait(e)


async def _fold(changes: asyncio.Queue[WatchEvent | StoreUnavailableError], records: JobRecords) -> (
    StoreUnavailableError | None
):
    """Wait for a change, then take in what comes within _WATCH_INTERVAL.

    A live page redraws at most that often. Returns the store's going away, if it did."""
    deadline: float | None = None
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                change = await changes.get()
        except TimeoutError:
            return None
        if isinstance(change, StoreUnavailableError):
            return change
        records.apply(change.key, change.value if change.type is EventType.PUT else None, change.revision)
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + _WATCH_INTERVAL


@dataclass
class _Page:
    """What has been printed.

    A page is printed again only when it changed (piped, a `--- time` line before each),
    or redrawn in place on a terminal."""

    as_data: bool
    in_place: bool
    watching: bool
    shown: str = ""

    def draw(self, view: JobView) -> None:
        key = "" if self.in_place else _page_key(view, self.as_data)
        if self.as_data and key != self.shown:
            print(json.dumps(as_json(view), indent=None if self.watching else 2), flush=True)
        elif key != self.shown or self.in_place:
            if self.in_place:
                print("\033[2J\033[H", end="")  # redraw in place; piped, one page after another
            elif self.watching:
                print(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S%z')}")
            print(shown(render(view, time.time())), flush=True)
        self.shown = key


def _page_key(view: JobView, as_data: bool) -> str:
    """The page without what only the clock changes, and without the step times.

    Ages and time left change with the clock, and every node reports its step times anew
    every few seconds: a piped watch prints a page when this changes, not whenever a
    worker's output or step moves the store."""
    if not as_data:
        return render(view, 0.0, timing=False)
    data = as_json(view, now=0.0)
    for node in data["nodes"]:  # type: ignore[attr-defined] # as_json's values are typed `object`
        node.pop("steps")
    return json.dumps(data, sort_keys=True)


def _run(args: argparse.Namespace) -> int:
    target = job_target(args)
    try:
        return asyncio.run(show(target, as_data=args.json, watch=args.watch))
    except KeyboardInterrupt:
        return 0
    except StoreUnavailableError:
        # The store an agent hosted ends with it: what this machine recorded shows how
        # the job ended, before the error says the store is gone.
        events = ended_here.last_events(target.run_id, args.log_dir)
        if events and not args.json:
            print(ended_here.render(target.run_id, events), flush=True)
        raise


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("status", help="show a job: its state, nodes and latest events")
    add_job_flags(p)
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument("--watch", action="store_true", help="redraw whenever the job changes (Ctrl-C ends)")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="where this machine's agents of the job wrote their logs (their --log-dir): when the store "
                        "is gone, their last events there say how the job ended (default: the temporary folders "
                        "agents without --log-dir make)")
    p.set_defaults(run=_run)
