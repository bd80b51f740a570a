"""`elasticrun logs`: the latest output of every rank, from any host.

Agents keep a bounded window of each rank's latest lines in the store; this prints it
as the console shows it (`[3]<stdout>: ...`), with a line where each round began
(`[3]<round>: --- round 4: ...`), so that an old round's traceback never reads as the
latest output. The full logs stay in each node's `--log-dir`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from elasticrun.errors import UsageError
from elasticrun.launcher.control import JobTarget, JobView, add_job_flags, job_target, read_job
from elasticrun.rendezvous.codec import decode
from elasticrun.rendezvous.records import ROUND_STREAM, LogWindow
from elasticrun.store.interface import EventType


def _lines(window: LogWindow, after: int, as_data: bool = False) -> list[str]:
    if as_data:  # one JSON object a line, for log pipelines
        return [
            json.dumps({"rank": window.rank, "stream": line.stream, "seq": line.seq, "text": line.text})
            for line in window.lines if line.seq > after
        ]
    return [f"[{window.rank}]<{line.stream}>: {line.text}" for line in window.lines if line.seq > after]


async def show(target: JobTarget, *, tail: int, follow: bool, rank: int | None, as_data: bool = False) -> int:
    keys = target.keys
    async with target.open() as store:
        view = await read_job(store, target)  # a clear error for an unknown job
        snapshot = await store.get_prefix(keys.logs)
        seen: dict[int, int] = {}
        windows = [decode(LogWindow, kv.value) for kv in snapshot.kvs]
        if rank is not None:
            windows = [w for w in windows if w.rank == rank]
            printed = any(line.stream != ROUND_STREAM for w in windows for line in w.lines)
            _check_rank(view, rank, printed=printed, follow=follow)
        for window in windows:
            for text in _lines(window, 0, as_data)[-tail:] if tail else []:
                print(text)
            seen[window.rank] = window.lines[-1].seq if window.lines else 0
        sys.stdout.flush()
        if not follow:
            return 0
        async for event in store.watch(keys.logs, start_revision=snapshot.revision + 1, prefix=True):
            if event.type is not EventType.PUT:
                continue
            window = decode(LogWindow, event.value)
            if rank is not None and window.rank != rank:
                continue
            # A rank restarted by a new agent numbers its lines from 1 again.
            after = seen.get(window.rank, 0)
            if window.lines and window.lines[-1].seq < after:
                after = 0
            for text in _lines(window, after, as_data):
                print(text, flush=True)
            seen[window.rank] = window.lines[-1].seq if window.lines else after
    return 0


def _check_rank(view: JobView, rank: int, *, printed: bool, follow: bool) -> None:
    """A rank that is not in the job is a usage error.

    One in it that has printed nothing yet is said on stderr, so that an empty answer is
    never a silent one."""
    world = view.round.world_size if view.round is not None else 0
    if not printed and not 0 <= rank < world:
        ranks = f"its ranks are 0-{world - 1}" if world else "it has no ranks now"
        raise UsageError(f"no rank {rank} in job '{view.run_id}': {ranks} (see elasticrun status)")
    if not printed:
        more = "; waiting for its first line" if follow else ""
        print(f"elasticrun: rank {rank} of job '{view.run_id}' has printed nothing yet{more}", file=sys.stderr,
              flush=True)


def _run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(
            show(job_target(args), tail=args.tail, follow=args.follow, rank=args.rank, as_data=args.json)
        )
    except KeyboardInterrupt:
        return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("logs", help="print the latest output of every rank of a job")
    add_job_flags(p)
    p.add_argument("--tail", type=int, default=20, help="lines per rank to show first (default 20; 0: none)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines (Ctrl-C ends)")
    p.add_argument("--rank", type=int, default=None, help="only this global rank")
    p.add_argument("--json", action="store_true", help="one JSON object a line: rank, stream, seq, text")
    p.set_defaults(run=_run)
