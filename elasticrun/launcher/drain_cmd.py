"""`elasticrun drain`: scale a job in gracefully, by count (newest first) or by name.

Drained nodes leave at once (the others restart at the smaller size), stop their
workers with the grace period, and their agents exit 0. The job never goes below its
minimum. The command waits until the drained agents are done: each deletes its drain
request last, once its workers have stopped (`--no-wait`: only ask).
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import socket
import time

from elasticrun.errors import ElasticrunError, UsageError
from elasticrun.launcher.control import JobTarget, add_job_flags, job_target, read_job, timeout_seconds, wait_keys_gone
from elasticrun.rendezvous.state import DrainRequest, Event, encode


class DrainTimeoutError(ElasticrunError):
    """Drained nodes did not leave in time."""


async def drain(
    target: JobTarget, *, count: int | None, names: list[str], timeout: float, as_data: bool = False,
    wait: bool = True,
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
        if not wait:
            _say(f"drain requested: {', '.join(chosen)}", {"job": target.run_id, "requested": chosen}, as_data)
            return 0
        # a node is done when its registration and its drain request are both gone
        done = {keys.node(n): n for n in chosen} | {keys.drain(n): n for n in chosen}
        still = await wait_keys_gone(store, keys.prefix, set(done), timeout)
    if still:
        late = sorted({done[key] for key in still})
        raise DrainTimeoutError(f"{', '.join(late)} did not leave and stop within {timeout:g}s")
    took = time.time() - now
    said = f"drained {', '.join(chosen)} in {took:.1f}s (left the job, workers stopped)"
    _say(said, {"job": target.run_id, "drained": chosen, "seconds": round(took, 3)}, as_data)
    return 0


def _say(text: str, data: dict[str, object], as_data: bool) -> None:
    print(json.dumps(data) if as_data else text, flush=True)


def _run(args: argparse.Namespace) -> int:
    if (args.count is None) == (not args.node):
        raise UsageError("give either --count N or --node NAME (repeatable)")
    if args.count is not None and args.count < 1:
        raise UsageError(f"--count must be at least 1, got {args.count}")
    timeout = timeout_seconds(args.timeout)
    return asyncio.run(
        drain(
            job_target(args), count=args.count, names=args.node or [], timeout=timeout, as_data=args.json,
            wait=not args.no_wait,
        )
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("drain", help="scale a job in: the newest N nodes (or named ones) leave gracefully")
    add_job_flags(p)
    p.add_argument("--count", type=int, default=None, help="drain the N newest nodes")
    p.add_argument("--node", action="append", default=None, help="drain this node (repeatable)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="fail if they have not left and stopped their workers within this many seconds (default 300)")
    p.add_argument("--no-wait", action="store_true",
                   help="only ask them to leave: return at once, without waiting until they are done")
    p.add_argument("--json", action="store_true", help="print the result as JSON for scripts")
    p.set_defaults(run=_run)
