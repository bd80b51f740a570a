"""elasticrun as a library: `elasticrun.launch(entrypoint, *args, **flags)`.

torchrun's `elastic_launch(LaunchConfig(...), entrypoint)(*args)` for code that embeds
the launcher (Ray, Lightning, Accelerate, notebooks). The flags are the launcher's own,
by their torchrun names (`nproc_per_node=2`, `rdzv_backend="c10d"`, `max_restarts=1`),
and go through the very parser and checks of the command line, so a launch here is
configured exactly as `elasticrun --nproc-per-node=2 ...` would be: every backend,
elastic rendezvous and restarts included. This module is the top of the package:
nothing in it is imported by the launcher or below (pyproject.toml's contracts).

The entrypoint is a script (a path, or a module with `module=True`, or a program with
`no_python=True`), run with `args` as its arguments; or a function, which each worker
calls with `args`. A function goes to the workers pickled, by name: it must be defined
at the top level of a module or of the launching script (as with multiprocessing's
spawn), and its arguments and return value must pickle. See docs/api.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from elasticrun.agent.agent import AgentResult
from elasticrun.agent.failures import FailureReport
from elasticrun.errors import ElasticrunError, UsageError
from elasticrun.launcher.assemble import build_config
from elasticrun.launcher.config import LaunchConfig
from elasticrun.launcher.flags import launch_parser
from elasticrun.worker.call import PAYLOAD_ENV, RESULTS_ENV

__all__ = ["LaunchFailed", "WorkersFailed", "launch"]

# A library prints nothing of its own unless its user asks: the agent's lines go where
# the application's logging sends them, and nowhere without any (Python's last-resort
# handler would print the warnings and the failure report, which is raised anyway).
logging.getLogger("elasticrun").addHandler(logging.NullHandler())

#: the worker module that calls a function entrypoint (elasticrun/worker/call.py)
_CALL_MODULE = "elasticrun.worker.call"


class LaunchFailed(ElasticrunError):
    """This node's part of the job did not finish.

    `exit_code` is what the CLI would have exited with (docs/cli.md#exit-codes),
    `message` why."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class WorkersFailed(LaunchFailed):
    """The workers failed beyond `max_restarts`.

    `report` names the root cause (the first failure: its rank, exit and traceback) and
    the others."""

    def __init__(self, message: str, exit_code: int, report: FailureReport | None) -> None:
        super().__init__(f"{message}\n{report.text}" if report is not None else message, exit_code)
        self.report = report


def launch(entrypoint: Callable[..., Any] | str, *args: Any, **flags: Any) -> dict[int, Any]:
    """Run `entrypoint` on this node's workers, as `elasticrun [flags] entrypoint args`.

    Returns the return value of each of this node's workers by global rank (None for a
    script), from the attempt that succeeded. Raises `UsageError` for a bad flag or
    entrypoint, `WorkersFailed` (with the failure report) when the workers failed beyond
    `max_restarts`, and `LaunchFailed` when this node stopped otherwise (a signal, the
    store unreachable, no round within join_timeout): its `exit_code` says which.
    """
    with _call_files(entrypoint, args) as call:
        config = build_config(launch_parser().parse_args(_argv(call.entrypoint, call.args, flags)), os.environ)
        if call.results is not None:
            if config.job_spec.elastic_mode != "restart":
                raise UsageError("a function entrypoint runs with elastic_mode='restart' only")
            env = {**config.worker.extra_env, PAYLOAD_ENV: str(call.payload), RESULTS_ENV: str(call.results)}
            config = replace(config, worker=replace(config.worker, extra_env=env, title=call.title))
        result = _run(config)
        if result.exit_code == 0:
            # a script returns nothing: None for each of this node's ranks, as torchrun's
            return _collect(call.results) if call.results is not None else dict.fromkeys(result.ranks)
        if result.report is not None:
            raise WorkersFailed(result.message, result.exit_code, result.report)
        raise LaunchFailed(result.message, result.exit_code)


class _Call:
    def __init__(
        self, entrypoint: str, args: tuple[str, ...], payload: Path | None, results: Path | None, title: str = ""
    ) -> None:
        self.entrypoint, self.args, self.payload, self.results = entrypoint, args, payload, results
        #: the function as its failure report names it, `module:function`
        self.title = title


@contextlib.contextmanager
def _call_files(entrypoint: Callable[..., Any] | str, args: tuple[Any, ...]) -> Iterator[_Call]:
    """A script as it is; a function pickled to a private folder, removed afterwards."""
    if isinstance(entrypoint, (str, os.PathLike)):
        yield _Call(os.fspath(entrypoint), tuple(map(str, args)), None, None)
        return
    if not callable(entrypoint):
        raise UsageError(f"the entrypoint must be a script path or a function, got {entrypoint!r}")
    folder = Path(tempfile.mkdtemp(prefix="elasticrun_call_"))  # mode 0700: this user only
    try:
        payload, results = folder / "payload.pkl", folder / "results"
        results.mkdir()
        main_path = _main_path(entrypoint)
        with open(payload, "wb") as f:
            pickle.dump(main_path, f)
            try:
                pickle.dump((entrypoint, args), f)
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                raise UsageError(
                    f"cannot send {getattr(entrypoint, '__qualname__', entrypoint)!r} and its arguments to the "
                    f"workers: {e} (a function entrypoint must be defined at the top level of a module or script)"
                ) from None
        yield _Call(_CALL_MODULE, (), payload, results, _title(entrypoint, main_path))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _title(function: Callable[..., Any], main_path: str | None) -> str:
    """`module:function` (`script.py:function` for one of the launching script)."""
    module = os.path.basename(main_path) if main_path else getattr(function, "__module__", "?")
    return f"{module}:{getattr(function, '__qualname__', repr(function))}"


def _main_path(function: Callable[..., Any]) -> str | None:
    """The launching script, when the function is defined in it (its `__main__`)."""
    if getattr(function, "__module__", None) != "__main__":
        return None
    path: str | None = getattr(sys.modules["__main__"], "__file__", None)
    if path is None:
        raise UsageError(
            f"{function.__qualname__} is defined in an interactive session (a notebook, the REPL): the workers "
            "cannot import it; define it in a module and import it from there"
        )
    return os.path.abspath(path)


def _argv(entrypoint: str, args: tuple[str, ...], flags: Mapping[str, Any]) -> list[str]:
    """The launcher's command line for these flags (by their torchrun names)."""
    known = {a.dest: a for a in launch_parser()._actions if a.option_strings and a.dest not in ("help", "version")}
    argv = []
    for name, value in flags.items():
        action = known.get(name)
        if action is None:
            raise UsageError(f"elasticrun.launch: unknown flag {name!r} (known: {', '.join(sorted(known))})")
        option = action.option_strings[0]
        if action.nargs == 0:  # a switch
            if value:
                argv.append(option)
        elif name == "rdzv_conf" and isinstance(value, Mapping):
            argv.append(f"{option}={','.join(f'{k}={v}' for k, v in value.items())}")
        elif value is not None:
            argv.append(f"{option}={value}")
    if entrypoint == _CALL_MODULE:
        argv.append("--module")
    return [*argv, entrypoint, *args]


def _run(config: LaunchConfig) -> AgentResult:
    """The node's run, on this thread when it may handle signals, else on a thread of its own.

    On its own thread it handles none: a notebook's running event loop, a caller's
    thread."""
    from elasticrun.launcher.launch import run_node

    try:
        asyncio.get_running_loop()
        busy = True
    except RuntimeError:
        busy = False
    if threading.current_thread() is threading.main_thread() and not busy:
        return asyncio.run(run_node(config))
    worker = config.worker
    config = replace(config, worker=replace(worker, options=replace(worker.options, signals_to_handle=())))
    outcome: list[AgentResult | BaseException] = []

    def run() -> None:
        try:
            outcome.append(asyncio.run(run_node(config)))
        except BaseException as e:  # handed to the caller's thread
            outcome.append(e)

    thread = threading.Thread(target=run, name="elasticrun-launch")
    thread.start()
    thread.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _collect(results: Path) -> dict[int, Any]:
    """Each rank's return value from the latest attempt that wrote any."""
    found: dict[tuple[int, int], dict[int, Any]] = {}
    for path in results.glob("*.pkl"):
        round_, restart, rank = (int(part) for part in path.stem.split("_"))
        with open(path, "rb") as f:
            found.setdefault((round_, restart), {})[rank] = pickle.load(f)
    return dict(sorted(found[max(found)].items())) if found else {}

