"""`elasticrun join`: scale a job out by starting an agent here for a job the store holds.

A joining host executes only what its own operator gave it. The workers' command
comes from join's command line (`elasticrun join [flags] [--] SCRIPT [ARGS...]`, with
`--no-python`, `--module` and `--run-path` as the launcher has them) and must equal the
job's stored command exactly; without one, join shows the job's command and asks for
it. Why the operator repeats it rather than join trusting the store, or a signed spec:

- it holds whatever protects the store, or fails to: no token on a loopback store, a
  worker holding the job's credential, a leaked token, an etcd user with write access;
  the store's records are input, and a host does not run its input;
- it needs no interaction: joins are scripted (Slurm, Kubernetes), and the script that
  starts a node already knows the command, since it started the first node the same way;
- a signed spec would still let anyone who can write the store replay an older signed
  command (another script, other arguments) under the job's id.

From the store, join takes only what can neither run code nor name a file on this host,
and the launcher's flag parser checks it as it checks a command line:
- the job spec's numbers and names (`--nnodes`, `--nproc-per-node`, `--node-unit`,
  `--max-restarts`, `--forgive-progress`, `--elastic-mode`, `--progress-timeout`,
  `--progress-start-timeout`, `--role`);
- the shared rendezvous timings (`SHARED_RDZV_CONF`); a stored spec with any other
  `--rdzv-conf` key is refused, since no node of ours stores one;
- the first node's own settings among `CARRIED_FLAGS` (`--shutdown-timeout`, `--gpus`,
  `--tee`, ...); any other stored flag is ignored with a warning.

The working folder is the operator's (this process's); the first node's, which the store
also holds, is only shown. A node not admitted within `--timeout` leaves and exits
non-zero (Arena's rollback).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import re
import shlex
from collections.abc import Mapping

from elasticrun.errors import UsageError
from elasticrun.launcher import log_format
from elasticrun.launcher.control import JobTarget, JobView, add_job_flags, job_target, read_job, timeout_seconds
from elasticrun.launcher.parsing import CARRIED_FLAGS, RUN_PATH_MODULE, worker_argv
from elasticrun.launcher.rdzv_conf import SHARED_RDZV_CONF
from elasticrun.rendezvous.records import JobSpec, by_name

log = logging.getLogger("elasticrun")

#: a stored timing's value: a plain number, nothing that could end the pair it is in
_NUMBER = re.compile(r"[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?")

#: the stored first-node flags join repeats: `--name` or `--name=value`, by name
_CARRIED = frozenset("--" + dest.replace("_", "-") for dest in CARRIED_FLAGS)


def clipped(text: str, limit: int = 400) -> str:
    """Text read from the store, cut for a message: whoever wrote it chose its length."""
    return text if len(text) <= limit else text[:limit] + "..."


def shown_command(command: tuple[str, ...], no_python: bool) -> str:
    """A job's command as join (and the launcher) takes it on its command line."""
    if no_python:
        words = ["--no-python", *command]
    elif command[:2] == ("-m", RUN_PATH_MODULE):
        words = ["--run-path", *command[2:]]
    elif command[:1] == ("-m",):
        words = ["--module", *command[1:]]
    else:
        words = list(command)
    return shlex.join(words)


def own_command(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[tuple[str, ...], bool] | None:
    """The command join's own command line gives, as a JobSpec stores it (None: none)."""
    if args.training_script is None:
        return None
    argv = worker_argv(args, environ)
    no_python = bool(args.no_python and not args.run_path)
    return (argv if no_python else argv[2:]), no_python


def check_command(view: JobView, spec: JobSpec, mine: tuple[tuple[str, ...], bool] | None) -> None:
    """That join runs the job's command, given by its operator: one line naming both if not."""
    theirs = clipped(shown_command(spec.command, spec.no_python))
    if mine is None:
        where = f" (its first node ran it in {clipped(view.launch.cwd)})" if view.launch else ""
        raise UsageError(
            f"join runs only the command given to it: job '{view.run_id}' runs `{theirs}`{where}; "
            f"repeat it after join's flags: elasticrun join [flags] -- {theirs}"
        )
    if (by_name(mine[0]), mine[1]) != (by_name(spec.command), spec.no_python):
        raise UsageError(
            f"this join runs `{shown_command(*mine)}`, but job '{view.run_id}' runs `{theirs}`: "
            "give the job's command exactly"
        )


def shared_conf(view: JobView, spec: JobSpec) -> dict[str, str]:
    """The job's shared rendezvous timings, each checked to be only a number."""
    for key, value in spec.rdzv_conf.items():
        if key not in SHARED_RDZV_CONF or not _NUMBER.fullmatch(str(value)):
            raise UsageError(
                f"job '{view.run_id}' has --rdzv-conf {clipped(f'{key}={value!r}')} in its stored spec, which join "
                "does not take "
                f"from the store (only the timings {', '.join(SHARED_RDZV_CONF)}, as numbers); "
                "start this node with the launcher and the job's full command line"
            )
    return dict(spec.rdzv_conf)


def carried(view: JobView) -> list[str]:
    """The first node's own settings that join repeats: those of CARRIED_FLAGS."""
    kept = []
    for flag in view.launch.flags if view.launch else ():
        if str(flag).partition("=")[0] in _CARRIED:
            kept.append(str(flag))
        else:
            log.warning(
                "join does not repeat the job's first node's %r: give it to join itself if wanted", clipped(str(flag))
            )
    return kept


def join_conf(view: JobView, spec: JobSpec, target: JobTarget, timeout: float | None) -> dict[str, str]:
    """The --rdzv-conf of the joining agent.

    The job's timings, then this command's own settings (store access, or a timing,
    which the spec check then holds to the job's), then the join timeout. One merge,
    each key once."""
    conf = {**shared_conf(view, spec), **target.conf}
    if timeout is not None:
        if "join_timeout" in target.conf:
            raise UsageError("give --timeout or --rdzv-conf join_timeout, not both")
        conf["join_timeout"] = f"{timeout:g}"
    return conf


async def job_argv(target: JobTarget, args: argparse.Namespace, environ: Mapping[str, str]) -> list[str]:
    """The launcher command line that joins the job.

    Made from join's own flags and command, and what of the stored job may come from the
    store."""
    timeout = timeout_seconds(args.timeout) if args.timeout is not None else None
    mine = own_command(args, environ)
    async with target.open() as store:
        view = await read_job(store, target)
    spec = view.spec
    if spec is None or (view.round is not None and view.round.closed):
        raise UsageError(f"job '{target.run_id}' has ended; nothing to join")
    check_command(view, spec, mine)
    conf = join_conf(view, spec, target, timeout)
    argv = [
        *carried(view),
        f"--nnodes={spec.nnodes}",
        f"--nproc-per-node={spec.nproc_per_node}",
        f"--node-unit={spec.node_unit}",
        f"--max-restarts={spec.max_restarts}",
        f"--role={spec.role}",
        f"--elastic-mode={spec.elastic_mode}",
        f"--straggler={spec.straggler}",
        f"--rdzv-backend={target.backend}",
        f"--rdzv-endpoint={target.endpoint}",
        f"--rdzv-id={target.run_id}",
        "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()),
    ]
    if spec.forgive_progress:
        argv.append(f"--forgive-progress={spec.forgive_progress}")
    if spec.progress_timeout is not None:
        argv.append(f"--progress-timeout={spec.progress_timeout}")
    if spec.progress_start_timeout is not None:
        argv.append(f"--progress-start-timeout={spec.progress_start_timeout}")
    for flag in ("local_addr", "log_dir", "metrics_port", "health_check", "health_check_timeout"):
        if getattr(args, flag):
            argv.append(f"--{flag.replace('_', '-')}={getattr(args, flag)}")
    for flag in ("no_python", "module", "run_path"):
        if getattr(args, flag):
            argv.append(f"--{flag.replace('_', '-')}")
    if any("\0" in arg for arg in argv):  # no command line holds one; the store's records might
        raise UsageError(f"job '{target.run_id}' has a NUL character in its stored spec; start this node with "
                         "the launcher and the job's full command line")
    return [*argv, "--", args.training_script, *args.training_script_args]


def _run(args: argparse.Namespace) -> int:
    target = job_target(args)
    argv = asyncio.run(job_argv(target, args, os.environ))
    from elasticrun.launcher.assemble import build_config
    from elasticrun.launcher.flags import launch_parser
    from elasticrun.launcher.launch import run_launch

    if args.json:
        log_format.use("json")
        argv = ["--log-format=json", *argv]
    config = build_config(launch_parser().parse_args(argv), os.environ)
    if args.timeout is not None:  # the operator bounds the wait for a place, a spare's too
        settings = dataclasses.replace(config.rdzv.settings, spares_wait=False)
        config = dataclasses.replace(config, rdzv=dataclasses.replace(config.rdzv, settings=settings))
    return run_launch(config)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "join",
        help="scale a job out: run an agent here for the job, with the job's command given again",
        usage="elasticrun join [flags] [--] SCRIPT [ARGS...]",
    )
    add_job_flags(p)
    p.add_argument("--timeout", type=float, default=None,
                   help="leave and fail if not admitted within this many seconds, as a spare too (default: wait "
                        "as long as the job runs, or join_timeout, 600, while it does not)")
    p.add_argument("--local-addr", default=None, help="this node's address as the others reach it")
    p.add_argument("--log-dir", default=None, help="folder for this node's worker logs")
    p.add_argument("--json", action="store_true", help="the agent's own lines as JSON, one object a line")
    p.add_argument("--metrics-port", metavar="[HOST:]PORT", default=None,
                   help="serve this agent's Prometheus metrics on this port at /metrics; off by default")
    p.add_argument("--health-check", metavar="CMD", default=None,
                   help="this node's health check, as the launcher's --health-check (never taken from the store)")
    p.add_argument("--health-check-timeout", type=float, default=None,
                   help="seconds one run of --health-check may take (default 30)")
    p.add_argument("--no-python", action="store_true", help="the command is an executable, run without python")
    p.add_argument("--module", "-m", action="store_true", help="the command is a Python module, as python -m")
    p.add_argument("--run-path", action="store_true", help="run the script with runpy.run_path, as the launcher")
    p.add_argument("training_script", nargs="?", default=None, metavar="SCRIPT",
                   help="the job's command, exactly as its first node was given it (join shows it when missing)")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments")
    p.set_defaults(run=_run)
