"""`elasticrun drain`: scale a job in gracefully, by count (newest first) or by name.

Drained nodes leave at once (the others restart at the smaller size), stop their
workers with the grace period, and their agents exit 0. The job never goes below its
minimum. The command waits until the drained agents are done: each deletes its drain
request last, once its workers have stopped (`--no-wait`: only ask). An agent killed
while it stopped its workers never does; `drain` sees that by its liveness port (as the
leader sees a dead agent), says so, and deletes the request for it.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import socket
import time
from collections.abc import Mapping
from typing import NoReturn

from elasticrun.errors import ElasticrunError, UsageError
from elasticrun.first_of import first_of
from elasticrun.launcher.control import JobTarget, add_job_flags, job_target, read_job, timeout_seconds, wait_keys_gone
from elasticrun.rendezvous.codec import encode
from elasticrun.rendezvous.keys import Keys
from elasticrun.rendezvous.liveness import Verdict, probe
from elasticrun.rendezvous.records import DrainRequest, Event, NodeInfo
from elasticrun.store.interface import Store

#: how often `drain` looks at a drained node that left the job but has not said it is done
LOOK_EVERY = 1.0


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
        ended: list[str] = []
        infos = {n: view.nodes[n] for n in chosen if n in view.nodes}
        still = await first_of(
            wait_keys_gone(store, keys.prefix, set(done), timeout), _reap_ended(store, keys, infos, ended)
        )
    if still:
        late = sorted({done[key] for key in still})
        raise DrainTimeoutError(f"{', '.join(late)} did not leave and stop within {timeout:g}s")
    took = time.time() - now
    stopped = [n for n in chosen if n not in ended]
    said = [f"drained {', '.join(stopped)} in {took:.1f}s (left the job, workers stopped)"] if stopped else []
    said += [
        f"{n} left the job, but its agent ended before it said its workers had stopped (killed?); "
        "its warden stops any that are left" for n in ended
    ]
    data = {"job": target.run_id, "drained": stopped, "agent_ended": ended, "seconds": round(took, 3)}
    _say("\n".join(said), data, as_data)
    return 0


async def _reap_ended(store: Store, keys: Keys, nodes: Mapping[str, NodeInfo], ended: list[str]) -> NoReturn:
    """Delete the drain request of each drained node whose agent ended first, and note it in `ended`.

    Such an agent left the job, so its registration is gone, yet it never deleted the
    request. Runs until cancelled (or a store error ends it, and the wait).

    Ended means its liveness port refused a connection twice, LOOK_EVERY apart: a live
    agent closes that port just before it deletes its request, and a port that cannot be
    reached (another network) proves nothing, so such a node is waited for."""
    refused: set[str] = set()
    while True:
        await asyncio.sleep(LOOK_EVERY)
        for node_id, info in nodes.items():
            if node_id in ended or not info.liveness_port:
                continue
            if await store.get(keys.drain(node_id)) is None or await store.get(keys.node(node_id)) is not None:
                refused.discard(node_id)
                continue
            if await probe(info.addr, info.liveness_port) is not Verdict.GONE:
                refused.discard(node_id)
            elif node_id not in refused:
                refused.add(node_id)
            else:
                ended.append(node_id)
                await store.delete(keys.drain(node_id))


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
