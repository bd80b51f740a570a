"""`elasticrun list`: the jobs on a store (or under an etcd endpoint's prefix), one row each."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from elasticrun.launcher.commands.status import age, table
from elasticrun.launcher.control import JobTarget, JobView, add_store_flags, read_jobs, store_target


def job_row(view: JobView, now: float) -> dict[str, object]:
    """One job as plain data: what the table shows, with times as numbers."""
    r = view.round
    low, high = view.min_max
    created = view.launch.created_at if view.launch else None
    return {
        "id": view.run_id,
        "state": view.phase,
        "round": r.number if r else 0,
        "world_size": r.world_size if r else 0,
        "nodes": len(r.participants) if r else 0,
        "registered": len(view.nodes),
        "min_nodes": low,
        "max_nodes": high,
        "created_at": created,
        "age_s": round(now - created, 1) if created else None,
    }


def render(rows: list[dict[str, object]]) -> str:
    if not rows:
        return "no jobs"
    lines = [["JOB", "STATE", "ROUND", "WORLD", "NODES", "AGE"]]
    for row in rows:
        lines.append([
            str(row["id"]),
            str(row["state"]),
            str(row["round"]) if row["round"] else "-",
            str(row["world_size"]),
            f"{row['nodes']} ({row['min_nodes']}:{row['max_nodes']})",
            age(float(row["age_s"])) if isinstance(row["age_s"], float) else "-",
        ])
    return table(lines)


async def show(target: JobTarget, *, as_data: bool) -> int:
    async with target.open() as store:
        views = await read_jobs(store)
    now = time.time()
    rows = [job_row(v, now) for v in views]
    print(json.dumps({"jobs": rows}, indent=2) if as_data else render(rows), flush=True)
    return 0


def _run(args: argparse.Namespace) -> int:
    return asyncio.run(show(store_target(args), as_data=args.json))


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("list", help="list the jobs on a store: id, state, round, world size, nodes, age")
    add_store_flags(p)
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(run=_run)
