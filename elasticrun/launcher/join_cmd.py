"""`elasticrun join`: scale a job out by starting an agent here with its stored spec.

The job's spec (command, nproc, min:max, restarts, elastic mode, progress timeout, rendezvous timings) is what its
first node stored, and so are that node's own settings (`--shutdown-timeout`, `--gpus`,
`--isolate-gpus`, `--tee`, `--redirects`, `--signals-to-handle`, `--local-ranks-filter`,
`--health-interval`, `--log-dir`); joining repeats none of it on the command line. A node that is not
admitted within `--timeout` leaves and exits non-zero (Arena's rollback).
"""

from __future__ import annotations

import argparse
import asyncio
import os

from elasticrun.errors import UsageError
from elasticrun.launcher import log_format
from elasticrun.launcher.control import JobTarget, add_job_flags, job_target, read_job, timeout_seconds


async def _job_argv(
    target: JobTarget, timeout: float, local_addr: str | None, log_dir: str | None
) -> tuple[list[str], str]:
    """The launcher command line that joins the job, and the folder to run it in."""
    async with target.open() as store:
        view = await read_job(store, target)
    spec = view.spec
    if spec is None or (view.round is not None and view.round.closed):
        raise UsageError(f"job '{target.run_id}' has ended; nothing to join")
    conf = {**spec.rdzv_conf, **target.conf, "join_timeout": f"{timeout:g}"}
    # the first node's own settings first: the job's, and then this command's, win
    argv = [
        *(view.launch.flags if view.launch else ()),
        f"--nnodes={spec.nnodes}",
        f"--nproc-per-node={spec.nproc_per_node}",
        f"--node-unit={spec.node_unit}",
        f"--max-restarts={spec.max_restarts}",
        f"--role={spec.role}",
        f"--elastic-mode={spec.elastic_mode}",
        f"--rdzv-backend={target.backend}",
        f"--rdzv-endpoint={target.endpoint}",
        f"--rdzv-id={target.run_id}",
        "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()),
    ]
    if spec.forgive_progress:
        argv.append(f"--forgive-progress={spec.forgive_progress}")
    if spec.progress_timeout is not None:
        argv.append(f"--progress-timeout={spec.progress_timeout}")
    if local_addr:
        argv.append(f"--local-addr={local_addr}")
    if log_dir:
        argv.append(f"--log-dir={log_dir}")
    command = list(spec.command)
    if spec.no_python:
        argv.append("--no-python")
    elif command[:1] == ["-m"]:
        argv.append("--module")
        command = command[1:]
    cwd = view.launch.cwd if view.launch and os.path.isdir(view.launch.cwd) else os.getcwd()
    return [*argv, *command], cwd


def _run(args: argparse.Namespace) -> int:
    target = job_target(args)
    argv, cwd = asyncio.run(_job_argv(target, timeout_seconds(args.timeout), args.local_addr, args.log_dir))
    from elasticrun.launcher.config import build_config
    from elasticrun.launcher.flags import launch_parser
    from elasticrun.launcher.launch import run_launch

    if args.json:
        log_format.use("json")
    os.chdir(cwd)
    if args.metrics_port is not None:
        argv = ["--metrics-port", args.metrics_port, *argv]
    return run_launch(build_config(launch_parser().parse_args(argv), os.environ))


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("join", help="scale a job out: run an agent here with the job's stored spec")
    add_job_flags(p)
    p.add_argument("--timeout", type=float, default=600.0,
                   help="leave and fail if not admitted within this many seconds (default 600)")
    p.add_argument("--local-addr", default=None, help="this node's address as the others reach it")
    p.add_argument("--log-dir", default=None, help="folder for this node's worker logs")
    p.add_argument("--json", action="store_true", help="the agent's own lines as JSON, one object a line")
    p.add_argument("--metrics-port", metavar="[HOST:]PORT", default=None,
                   help="serve this agent's Prometheus metrics on this port at /metrics; off by default")
    p.set_defaults(run=_run)
