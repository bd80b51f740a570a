"""`elasticrun logs`: the latest output of every rank, from any host.

Agents keep a bounded window of each rank's latest lines in the store; this prints it
as the console shows it (`[3]<stdout>: ...`). The full logs stay in each node's
`--log-dir`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from elasticrun.launcher.control import JobTarget, add_job_flags, job_target, read_job
from elasticrun.rendezvous.state import LogWindow, decode
from elasticrun.store.api import EventType


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
        await read_job(store, target)  # a clear error for an unknown job
        snapshot = await store.get_prefix(keys.logs)
        seen: dict[int, int] = {}
        for kv in snapshot.kvs:
            window = decode(LogWindow, kv.value)
            if rank is not None and window.rank != rank:
                continue
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
