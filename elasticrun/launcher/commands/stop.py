"""`elasticrun stop`: end a job everywhere; workers get SIGTERM and the grace period."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import socket
from collections.abc import Mapping

from elasticrun.errors import ElasticrunError, StoreUnavailableError
from elasticrun.launcher.control import JobTarget, add_job_flags, job_target, read_job, timeout_seconds, wait_nodes_gone
from elasticrun.launcher.flag_values import MAX_SECONDS
from elasticrun.rendezvous.leader import clear_job_records, close_round

#: how long a stopped job stays closed to late agents when its spec does not say
_DEFAULT_CLOSED_TTL = 60.0


class StopTimeoutError(ElasticrunError):
    """Agents did not exit in time after the job was stopped."""


async def stop(target: JobTarget, *, timeout: float, as_data: bool = False) -> int:
    """Stop the job; 0 when it stopped, had ended already, or nothing listens at its c10d store."""
    try:
        return await _stop(target, timeout=timeout, as_data=as_data)
    except StoreUnavailableError as e:
        if target.backend != "c10d" or "connection refused" not in e.cause:
            raise
        # Nothing listens there: no job runs on a store at that address (a store an
        # agent hosted ended with its job, and the agents with it). Retrying cannot
        # change that, so a scheduler's clean-up step must not be told to.
        _say(
            f"nothing listens at {e.endpoint}: no job runs on a store there (a store an agent hosted ends with "
            "its job); nothing to stop. Check --rdzv-endpoint if the job should be running",
            {"job": target.run_id, "stopped": False, "store_gone": True, "endpoint": e.endpoint},
            as_data,
        )
        return 0


async def _stop(target: JobTarget, *, timeout: float, as_data: bool) -> int:
    keys = target.keys
    async with target.open() as store:
        view = await read_job(store, target)
        if view.round is not None and view.round.closed:
            return _ended(target.run_id, view.round.closed, view.round.detail, as_data)
        ttl = _closed_ttl(view.spec.rdzv_conf if view.spec else {})
        who = f"{getpass.getuser()}@{socket.gethostname()}"
        if not await close_round(store, keys, "stopped", f"stopped by {who}", ttl):
            ended = (await read_job(store, target)).round
            return _ended(target.run_id, ended.closed if ended else "", ended.detail if ended else "", as_data)
        try:
            await clear_job_records(store, keys)
            still = await wait_nodes_gone(store, keys, set(view.nodes), timeout)
        except StoreUnavailableError as e:
            # An agent that hosts the store serves it until the other nodes have left,
            # then exits with the job: its store going away is the job's end, not an
            # error (a node still running finds the job closed, or no store, and ends).
            said = f"job '{target.run_id}' stopped; its store went away with the job ({e.endpoint})"
            _say(said, {"job": target.run_id, "stopped": True, "nodes": len(view.nodes), "store_gone": True}, as_data)
            return 0
    if still:
        raise StopTimeoutError(f"job stopped, but {', '.join(sorted(still))} did not exit within {timeout:g}s")
    said = f"job '{target.run_id}' stopped; {len(view.nodes)} node(s) exited"
    _say(said, {"job": target.run_id, "stopped": True, "nodes": len(view.nodes), "store_gone": False}, as_data)
    return 0


def _ended(run_id: str, outcome: str, detail: str, as_data: bool) -> int:
    """`stop` of a job that has ended already.

    Done, as asked (a scheduler's clean-up step that stops every job it started must not
    fail on one that finished)."""
    how = f"{outcome}: {detail}" if detail else outcome or "ended"
    _say(
        f"job '{run_id}' had already ended ({how}): nothing to stop",
        {"job": run_id, "stopped": False, "already_ended": outcome or "ended", "detail": detail},
        as_data,
    )
    return 0


def _closed_ttl(conf: Mapping[str, str]) -> float:
    """The job's closed_ttl as its stored spec says, or the default where it says no valid timing.

    The store's records are input, not the checked flags they came from."""
    try:
        ttl = float(conf.get("closed_ttl", _DEFAULT_CLOSED_TTL))
    except (TypeError, ValueError):
        return _DEFAULT_CLOSED_TTL
    return ttl if 0 < ttl <= MAX_SECONDS else _DEFAULT_CLOSED_TTL


def _say(text: str, data: dict[str, object], as_data: bool) -> None:
    print(json.dumps(data) if as_data else text, flush=True)


def _run(args: argparse.Namespace) -> int:
    return asyncio.run(stop(job_target(args), timeout=timeout_seconds(args.timeout), as_data=args.json))


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("stop", help="end a job everywhere: workers stop gracefully, agents exit 0")
    add_job_flags(p)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the agents to exit (default 120)")
    p.add_argument("--json", action="store_true", help="print the result as JSON for scripts")
    p.set_defaults(run=_run)
