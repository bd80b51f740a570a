"""The launcher's flags: torchrun's, in both spellings, with PET_* defaults.

Apart from the CLI module so that `elasticrun join`, which builds a launch from a job's
stored spec, parses it exactly as a command line is parsed, without importing the CLI.
"""

from __future__ import annotations

import argparse
import os
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from elasticrun import __version__
from elasticrun.errors import UsageError
from elasticrun.launcher import log_format
from elasticrun.launcher.parsing import DEFAULT_RUN_ID
from elasticrun.launcher.rdzv_conf import RDZV_CONF, RDZV_CONF_KEYS, FromEnvironment
from elasticrun.launcher.spelling import did_you_mean


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of exiting, and names the closest flag to a misspelt one.

    The error becomes one line at the edge; a misspelt choice gets its closest choice
    too."""

    def error(self, message: str) -> NoReturn:
        if "training_script" in message:
            message = "no training script given (elasticrun [options] train.py [script args])"
        raise UsageError(f"{message} (see --help)")

    def parse_args(  # type: ignore[override]  # argparse's overloads; we always return a Namespace
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        argv = list(args) if args is not None else []
        try:
            parsed, extras = self.parse_known_args(argv, namespace)
        except UsageError as e:
            # a misspelt flag leaves a required one missing: the misspelling is the news
            if "required" in str(e) or "no training script" in str(e):
                self._misspelt(argv, [a for a in argv if a.startswith("--")])
            raise
        if extras:
            self._misspelt(argv, extras)
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _misspelt(self, argv: list[str], candidates: list[str]) -> None:
        """Raise the usage error for the first of `candidates` that is misspelt.

        That is, no flag of this command (or of the subcommand `argv` names) but close
        to one."""
        known = self._known_flags(argv)
        unknown = [c for c in candidates if c.startswith("-") and c.split("=", 1)[0] not in known]
        for flag in unknown:
            hint = did_you_mean(flag.split("=", 1)[0], known)
            if hint:
                self.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")

    def _known_flags(self, argv: list[str]) -> list[str]:
        """This parser's flags and those of the subcommands named in `argv`."""
        flags = list(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name in argv:
                    chosen = action.choices.get(name)
                    if isinstance(chosen, Parser):
                        flags += chosen._known_flags(argv)
        return flags

    def _check_value(self, action: argparse.Action, value: object) -> None:
        choices = action.choices
        if choices is not None and value not in choices:
            named = ", ".join(map(repr, choices))
            hint = did_you_mean(str(value), map(str, choices))
            raise argparse.ArgumentError(action, f"invalid choice: {value!r} (choose from {named}){hint}")

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> object:
        # Python 3.11's argparse drops a '--' given as a flag's value (`--nnodes=--`)
        # and hands on an empty list where one string belongs: keep '--' as the value.
        if action.option_strings and action.nargs is None and arg_strings == ["--"]:
            value = self._get_value(action, "--")
            self._check_value(action, value)
            return value
        return super()._get_values(action, arg_strings)


def rdzv_conf_keys(keys: Iterable[str]) -> str:
    """`keys` of --rdzv-conf for a help text, grouped by the backends that read them.

    As the one table of keys (`rdzv_conf.RDZV_CONF`) says: every key, and none twice."""
    groups: dict[str, list[str]] = {"": [], "c10d": [], "c10d and etcd": [], "etcd": []}
    for key in keys:
        groups[RDZV_CONF_KEYS[key].scope].append(key)
    return "; ".join(f"{scope}: {', '.join(names)}" if scope else ", ".join(names)
                     for scope, names in groups.items() if names)


# The actions below take argparse's keyword arguments (`**kw: Any`) and pass them on.
class _EnvDefault(argparse.Action):
    """A flag whose default comes from PET_<NAME>, as torchrun's do."""

    def __init__(self, dest: str, default: object = None, required: bool = False, **kw: Any) -> None:
        env_name = "PET_" + dest.upper()
        default = os.environ.get(env_name, default)
        super().__init__(dest=dest, default=default, required=required and default is None, **kw)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)


class _EnvAppend(argparse.Action):
    """A repeatable flag (values merged), with PET_<NAME> as the first value."""

    def __init__(self, dest: str, default: object = None, **kw: Any) -> None:
        env = os.environ.get("PET_" + dest.upper())
        super().__init__(dest=dest, default=[FromEnvironment(env)] if env else [], **kw)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, [*getattr(namespace, self.dest), values])


class _EnvFlag(argparse.Action):
    """A boolean flag, also set by PET_<NAME>=1."""

    def __init__(self, dest: str, default: bool = False, **kw: Any) -> None:
        env = os.environ.get("PET_" + dest.upper(), "")
        default = env.lower() in ("1", "true", "yes") if env else default
        super().__init__(dest=dest, default=default, nargs=0, **kw)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, True)


def _flag(parser: argparse.ArgumentParser, name: str, *extra: str, **kw: Any) -> None:
    """Add `--a-b` with its torchrun twin `--a_b` (and any short form)."""
    names = [f"--{name}", *extra]
    if "-" in name:
        names.insert(1, f"--{name.replace('-', '_')}")
    kw.setdefault("action", _EnvDefault)
    parser.add_argument(*names, dest=name.replace("-", "_"), **kw)


#: the width the launcher's --help wraps its description and epilog at
_HELP_WIDTH = 78


def _paragraphs(*texts: str) -> str:
    """`texts` wrapped for a help text, each a paragraph.

    A line of one that starts with two spaces is an item of a list, wrapped on its own
    with a hanging indent."""
    out = []
    for text in texts:
        lines = text.split("\n")
        out.append("\n".join(
            textwrap.fill(line, _HELP_WIDTH, subsequent_indent="      " if line.startswith("  ") else "")
            for line in lines
        ))
    return "\n\n".join(out)


def launch_parser() -> argparse.ArgumentParser:
    """The torchrun-compatible launcher flags."""
    p = Parser(
        prog="elasticrun",
        description=_paragraphs(
            "Elastic, fault-tolerant launcher for distributed PyTorch training, "
            "used exactly like torchrun. Job control: elasticrun {list,status,logs,stacks,join,drain,stop} --help; "
            "the standalone store: elasticrun store serve --help"
        ),
        epilog=_paragraphs(
            "--rdzv-conf keys:\n" + "\n".join(f"  {key.described()}" for key in RDZV_CONF),
            "Every flag also takes its default from PET_<FLAG> (e.g. PET_NNODES), as torchrun's do.",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"elasticrun {__version__}")
    _flag(p, "nnodes", default="1:1", help="number of nodes N, or MIN:MAX for an elastic job")
    _flag(p, "nproc-per-node", default="1",
          help="workers per node: N, cpu, gpu (one per GPU), xpu (one per Intel GPU) or auto (GPUs, else XPUs, "
               "else CPUs)")
    _flag(p, "rdzv-backend", default="static",
          help="c10d (built-in store), etcd (v3) or static (the default, as torchrun's: a fixed number of nodes; "
               "--nnodes=MIN:MAX needs c10d or etcd)")
    _flag(p, "rdzv-endpoint", default="", help=(
        "c10d: host:port (default port 29400), or node0:29400,node1:29400,... (the nodes that may serve the "
        "store, the first first); etcd: h1:2379,h2:2379,..."
    ))
    _flag(p, "rdzv-id", default=DEFAULT_RUN_ID, help="the job's id: nodes with the same id form one job")
    _flag(p, "rdzv-conf", action=_EnvAppend,
          help=f"key=value,... (repeatable, merged): {rdzv_conf_keys(RDZV_CONF_KEYS)}")
    _flag(p, "standalone", action=_EnvFlag, help="one node, no server: an in-memory rendezvous and a free port")
    _flag(p, "node-unit", type=int, default=1,
          help="run a multiple of this many nodes (tensor/pipeline groups that span nodes): the nodes left "
               "over wait as spares; MIN and MAX of --nnodes must be multiples of it")
    _flag(p, "max-restarts", type=int, default=0,
          help="worker-failure restarts before the job fails (membership changes never count)")
    _flag(p, "forgive-progress", default="",
          help="heartbeat, or SECONDS: a worker failure spends a restart only when the workers made no progress "
               "since the previous failure (every worker called elasticrun.worker.heartbeat(), or ran SECONDS); "
               "a crash loop still stops after --max-restarts (off by default)")
    _flag(p, "elastic-mode", default="restart", choices=["restart", "in-process"],
          help="on a membership change: restart every worker (torchrun's way), or keep the survivors running "
               "(in-process; the script uses elasticrun.worker.elastic)")
    _flag(p, "state-memory", default=None, metavar="SIZE",
          help="restart mode: host memory each worker's committed elasticrun.worker.elastic state may take, "
               "room for four copies (e.g. 512M, 16G; 0: keep none); a restarted worker resumes from it "
               "(default 16G, taken only as commits fill it); the next node keeps copies in as much again")
    _flag(p, "monitor-interval", type=float, default=0.1,
          help="accepted for torchrun compatibility: elasticrun reacts to events at once")
    _flag(p, "start-method", default="spawn", choices=["spawn", "fork", "forkserver"],
          help="accepted for compatibility: workers are always fresh processes")
    _flag(p, "event-log-handler", default="null",
          help="record the workers' status events with torch's event log handler of this name (e.g. console), "
               "as torchrun; imports torch")
    _flag(p, "role", default="default", help="the workers' role name (ROLE_NAME)")
    _flag(p, "module", "-m", action=_EnvFlag, help="run the script argument as a module, like python -m")
    _flag(p, "no-python", action=_EnvFlag, help="run the script argument as an executable, without python")
    _flag(p, "run-path", action=_EnvFlag,
          help="run the script (a file, a folder or a zip with __main__.py) with runpy.run_path, as torchrun")
    _flag(p, "log-dir", default=None, help="folder for per-attempt worker logs and error files")
    _flag(p, "redirects", "-r", default="0",
          help="send streams to log files only: 0-3 or RANK:N,... (1 out, 2 err, 3 both)")
    _flag(p, "tee", "-t", default="0",
          help="copy streams to log files as well as the console (same format as --redirects)")
    _flag(p, "local-ranks-filter", default="", help="show only these local ranks on the console, e.g. 0,1")
    _flag(p, "duplicate-stdout-filters", default=None,
          help="copy the tee'd stdout lines containing one of these (a,b; ',,' is a comma) to "
               "<attempt>/filtered_stdout.log")
    _flag(p, "duplicate-stderr-filters", default=None,
          help="the same for stderr (<attempt>/filtered_stderr.log)")
    _flag(p, "node-rank", type=int, default=0, help="static backend: this node's rank")
    _flag(p, "master-addr", default="127.0.0.1", help="static backend: address of node rank 0")
    _flag(p, "master-port", type=int, default=29500, help="static backend: port on node rank 0")
    _flag(p, "local-addr", default=None,
          help="this node's address as others reach it (default: the route to the endpoint)")
    _flag(p, "logs-specs", default=None,
          help="lay out the log files with this torchrun.logs_specs entry point, as torchrun; imports torch")
    _flag(p, "numa-binding", default=None, choices=["node", "socket", "exclusive", "core-complex"],
          help="bind each worker to the CPUs near its GPU, as torchrun (needs taskset)")
    _flag(p, "signals-to-handle", default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
          help="signals that stop the workers (forwarded) and make this node leave")
    _flag(p, "shutdown-timeout", type=float, default=None,
          help="seconds between SIGTERM and SIGKILL for workers (default $TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30)")
    _flag(p, "virtual-local-rank", action=_EnvFlag,
          help="each worker sees only its own GPU, as cuda:0, with LOCAL_RANK=0 (the same as --isolate-gpus)")
    _flag(p, "gpus", default=None,
          help="the GPUs this node's workers use, e.g. 0,2,3 (default: every healthy visible GPU)")
    _flag(p, "isolate-gpus", action=_EnvFlag,
          help="give each worker only its own GPU (CUDA_VISIBLE_DEVICES per worker), as cuda:0, with LOCAL_RANK=0")
    _flag(p, "health-interval", type=float, default=10.0,
          help="seconds between GPU health checks, and --health-check runs, while in the job (default 10)")
    _flag(p, "health-check", default=None, metavar="CMD",
          help="a command (run by /bin/sh -c) that must exit 0 before this node joins and every --health-interval "
               "while it is in the job; else the node does not join, or leaves the job, quarantined, with its last "
               "line as the reason (exit 200)")
    _flag(p, "health-check-timeout", type=float, default=30.0,
          help="seconds one run of --health-check may take; longer fails it (default 30)")
    _flag(p, "progress-timeout", type=float, default=None,
          help="opt-in hang watchdog (off by default): stop and restart the workers when one has made no progress "
               "for this many seconds: no optimizer step, no elasticrun.worker.heartbeat() call")
    _flag(p, "progress-start-timeout", type=float, default=None,
          help="with --progress-timeout: how long a worker may take to its first progress (imports, loading a "
               "model or checkpoint, compiling); default: --progress-timeout")
    _flag(p, "straggler", default="report", choices=["off", "report", "replace"],
          help="a node whose compute time per step is well above the others': report it (status, events, "
               "metrics), replace it (quarantined; a spare or the elastic range takes over), or off (no step "
               "timing in the workers); default report")
    _flag(p, "warm-imports", default="torch", metavar="MODULES",
          help="restart mode: keep a standby worker per local rank, these modules (comma-separated) imported, "
               "that becomes the next round's worker, so a restart does not wait for Python's start and the "
               "imports; off: every worker starts cold (default torch; --no-python always starts cold)")
    p.add_argument("--metrics-port", "--metrics_port", dest="metrics_port", default=None, metavar="[HOST:]PORT",
                   help="serve Prometheus metrics of this agent (and of the store it hosts) on this port "
                        "(all interfaces, or HOST only) at /metrics; off by default")
    p.add_argument("--log-format", "--log_format", dest="log_format", choices=["text", "json"],
                   default=log_format.default_format(),
                   help="the agent's own lines: text (ISO date-time, zone, node id) or json, one object a line "
                        "(default $ELASTICRUN_LOG_FORMAT or text)")
    p.add_argument("training_script", help="the training script (or module, or executable)")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER, help="its arguments")
    return p
