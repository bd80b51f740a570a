"""`elasticrun drain`: scale a job in gracefully, by count (newest first) or by name.

Drained nodes stop their workers with the grace period, leave, and their agents exit 0;
the others restart at the smaller size at once. The job never goes below its minimum.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import socket
import time

from elasticrun.errors import ElasticrunError, UsageError
from elasticrun.launcher.control import JobTarget, add_job_flags, job_target, read_job, timeout_seconds, wait_nodes_gone
from elasticrun.rendezvous.state import DrainRequest, Event, encode


class DrainTimeoutError(ElasticrunError):
    """Drained nodes did not leave in time."""


async def drain(
    target: JobTarget, *, count: int | None, names: list[str], timeout: float, as_data: bool = False
) -> int:
    keys = target.keys
    async with target.open() as store:
        view = await read_job(store, target)
        members = [p.node_id for p in view.round.participants] if view.round else []
        if view.round is None or view.round.closed or not members:
            raise UsageError(f"job '{target.run_id}' is not running ({view.phase}); nothing to drain")
        if names:
            unknown = [n for n in names if n not in view.nodes]
            if unknown:
                raise UsageError(f"no node {', '.join(unknown)} in job '{target.run_id}' (see elasticrun status)")
            chosen = names
        else:
            chosen = members[-count:] if count else []  # newcomers go last: newest first
        low, _ = view.min_max
        remaining = len([m for m in members if m not in chosen])
        if remaining < low:
            raise UsageError(
                f"draining {len(chosen)} of {len(members)} nodes would leave {remaining}, below the "
                f"job's minimum of {low} (--nnodes={low}:{view.min_max[1]}); drain fewer, or stop the job"
            )
        who = f"{getpass.getuser()}@{socket.gethostname()}"
        now = time.time()
        for node_id in chosen:
            await store.put(keys.drain(node_id), encode(DrainRequest(reason=f"requested by {who}", at=now)))
        event = Event(at=now, node=who, kind="drain", detail=f"drain requested: {', '.join(chosen)}")
        await store.put(keys.event(now, who), encode(event))
        still = await wait_nodes_gone(store, keys, set(chosen), timeout)
    if still:
        raise DrainTimeoutError(f"{', '.join(sorted(still))} did not leave within {timeout:g}s")
    took = time.time() - now
    if as_data:
        print(json.dumps({"job": target.run_id, "drained": chosen, "seconds": round(took, 3)}), flush=True)
    else:
        print(f"drained {', '.join(chosen)} in {took:.1f}s", flush=True)
    return 0


def _run(args: argparse.Namespace) -> int:
    if (args.count is None) == (not args.node):
        raise UsageError("give either --count N or --node NAME (repeatable)")
    if args.count is not None and args.count < 1:
        raise UsageError(f"--count must be at least 1, got {args.count}")
    timeout = timeout_seconds(args.timeout)
    return asyncio.run(
        drain(job_target(args), count=args.count, names=args.node or [], timeout=timeout, as_data=args.json)
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("drain", help="scale a job in: the newest N nodes (or named ones) leave gracefully")
    add_job_flags(p)
    p.add_argument("--count", type=int, default=None, help="drain the N newest nodes")
    p.add_argument("--node", action="append", default=None, help="drain this node (repeatable)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="fail if they have not left within this many seconds (default 300)")
    p.add_argument("--json", action="store_true", help="print the result as JSON for scripts")
    p.set_defaults(run=_run)
