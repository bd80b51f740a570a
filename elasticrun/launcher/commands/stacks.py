"""`elasticrun stacks`: where every rank of a job is, from any host.

With the admin credential it asks every node of the running round for its workers'
stacks (a fresh capture: rendezvous/stacks.py), waits for their answers, and prints the
summary, then every distinct main-thread stack once with the ranks that share it
(`--rank` prints one rank's stacks, every thread). A reader credential may not write the
request: it shows the latest stacks the nodes published, and says that a fresh capture
needs the admin token.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict

from elasticrun.errors import ElasticrunError, StorePermissionError, UsageError
from elasticrun.launcher.control import JobTarget, JobView, add_job_flags, job_target, read_job, timeout_seconds
from elasticrun.launcher.printable import shown
from elasticrun.rendezvous.records import NodeStacks, RankStacks
from elasticrun.rendezvous.stack_summary import render_groups, render_rank, summarise
from elasticrun.rendezvous.stacks import ask, conclude, gather, latest, left_out, new_request
from elasticrun.store.interface import Store

#: how often `stacks` writes its request again when another request won the race
_TRIES = 3


class NoStacksError(ElasticrunError):
    """A reader asked for stacks that no node has published."""


async def _capture(store: Store, target: JobTarget, view: JobView, timeout: float) -> tuple[list[NodeStacks], str]:
    """Ask the round's nodes for their stacks; their answers and the header line."""
    r = view.round
    if r is None or r.closed or not r.participants:
        raise UsageError(f"job '{target.run_id}' is not running ({view.phase}): no workers to capture")
    keys, members = target.keys, [p.node_id for p in r.participants]
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    for _ in range(_TRIES):
        request = new_request(who, "on demand (elasticrun stacks)", r.number, len(members))
        kv = await store.get(keys.stacks)
        revision = await ask(store, keys, request, kv.mod_revision if kv else 0)
        if revision is not None:
            break
    else:
        raise UsageError(f"other requests for the stacks of job '{target.run_id}' kept coming first: try again")
    started = time.monotonic()
    answers = await gather(store, keys, request.id, revision, len(members), timeout)
    done = await conclude(store, keys, request, revision, list(answers.values()))
    took = time.monotonic() - started
    header = f"job '{target.run_id}', round {r.number}: {done.answered} of {len(members)} nodes answered in {took:.2f}s"
    silent = [m for m in members if m not in answers]
    if silent:
        shown = ", ".join(silent[:10]) + (f" and {len(silent) - 10} more" if len(silent) > 10 else "")
        header += f"; no answer within {timeout:g}s from {shown}"
    return list(answers.values()), header


def _latest_header(target: JobTarget, answers: Sequence[NodeStacks]) -> str:
    first, last = min(a.at for a in answers), max(a.at for a in answers)
    at = time.strftime("%H:%M:%S", time.localtime(first))
    if int(last) != int(first):
        at += time.strftime("-%H:%M:%S", time.localtime(last))
    return f"job '{target.run_id}': the latest stacks of {len(answers)} nodes, captured {at}"


async def show(target: JobTarget, *, rank: int | None, as_data: bool, timeout: float) -> int:
    async with target.open() as store:
        view = await read_job(store, target)
        fresh = True
        try:
            answers, header = await _capture(store, target, view, timeout)
        except StorePermissionError:
            fresh = False
            print(
                "elasticrun: this credential may only read: showing the latest stacks the nodes published; "
                "a fresh capture needs the admin token",
                file=sys.stderr,
                flush=True,
            )
            answers = await latest(store, target.keys)
            if not answers:
                raise NoStacksError(
                    f"no node of job '{target.run_id}' has published stacks yet; a fresh capture needs the admin token"
                ) from None
            header = _latest_header(target, answers)
    ranks = sorted((r for node in answers for r in node.ranks), key=lambda r: r.rank)
    if rank is not None:
        ranks = [r for r in ranks if r.rank == rank]
        if not ranks:
            raise UsageError(f"no rank {rank} among the stacks of job '{target.run_id}' (see elasticrun status)")
    lines = summarise(ranks) + (left_out(answers) if rank is None else [])
    if as_data:
        data = {
            "job": target.run_id,
            "fresh": fresh,
            "header": header,
            "summary": lines,
            "nodes": [{k: v for k, v in asdict(a).items() if k != "ranks"} for a in answers],
            "ranks": [asdict(r) for r in ranks],
        }
        print(json.dumps(data, indent=2), flush=True)
        return 0
    print(shown("\n".join(_page(header, lines, ranks, rank is not None))), flush=True)
    return 0


def _page(header: str, lines: Sequence[str], ranks: Sequence[RankStacks], one: bool) -> list[str]:
    page = [header, *(f"  {line}" for line in lines), ""]
    body = render_rank(ranks[0]) if one else render_groups(ranks)
    while body and not body[-1]:
        body.pop()
    return page + body


def _run(args: argparse.Namespace) -> int:
    timeout = timeout_seconds(args.timeout)
    return asyncio.run(show(job_target(args), rank=args.rank, as_data=args.json, timeout=timeout))


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "stacks",
        help="where every rank of a job is: its workers' Python stacks, captured now (admin) "
        "or the latest ones (reader)",
    )
    add_job_flags(p)
    p.add_argument("--rank", type=int, default=None, help="only this global rank, every thread of it")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="wait at most this many seconds for the nodes' answers (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(run=_run)
