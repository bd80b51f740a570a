"""The command line: torchrun's flags (both spellings, PET_* defaults) and subcommands.

This is the edge: errors from anywhere below become one line on stderr and an exit
code here (2 for usage errors), never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from elasticrun.descriptors import raise_soft_limit
from elasticrun.errors import ElasticrunError, UsageError
from elasticrun.launcher import log_format
from elasticrun.launcher.flags import Parser, launch_parser
from elasticrun.launcher.spelling import closest

#: the subcommands: `elasticrun NAME` is registered by launcher/commands/NAME.py
SUBCOMMANDS = ("status", "list", "logs", "stacks", "join", "drain", "stop", "store")

_GRPC_ENV = {"GRPC_VERBOSITY": "NONE", "GRPC_ENABLE_FORK_SUPPORT": "0"}


def subcommand_parser() -> argparse.ArgumentParser:
    """`elasticrun <subcommand> ...`: job control and the store server."""
    from elasticrun.launcher.commands import drain, join, logs, stacks, status, stop, store
    from elasticrun.launcher.commands import list as list_  # the module; the builtin stays `list`

    p = Parser(prog="elasticrun")
    commands = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module in (status, list_, logs, stacks, join, drain, stop, store):
        module.register(commands)
    return p


def _quiet_grpc() -> None:
    """Load grpc with its C core quiet and without fork handlers, for this process only.

    grpc reads these variables once, when it loads; they are removed again so that the
    workers inherit the user's environment unchanged. Our own errors say what failed.
    """
    saved = {k: os.environ.get(k) for k in _GRPC_ENV}
    os.environ.update(_GRPC_ENV)
    try:
        import grpc  # noqa: F401
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


def _one_line(message: str) -> str:
    """The message as one printable line.

    A newline or a terminal escape that came in with the user's input is shown escaped,
    never acted on."""
    if message.isprintable():
        return message
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


def _check_not_a_misspelt_subcommand(argv: Sequence[str]) -> None:
    """`elasticrun stauts ...`.

    A first word that names no file here but is close to a subcommand is a misspelt
    subcommand, not a training script that is missing."""
    first = argv[0] if argv else "-"
    if first.startswith("-") or os.path.exists(first):
        return
    command = closest(first, SUBCOMMANDS)
    if command is not None:
        raise UsageError(
            f"'{first}' is neither a subcommand nor a training script here; did you mean elasticrun {command}?"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    log_format.setup_logging()
    raise_soft_limit()  # an agent or a store serves connections: one descriptor each
    _quiet_grpc()
    try:
        if argv and argv[0] in SUBCOMMANDS:
            args = subcommand_parser().parse_args(argv)
            if isinstance(getattr(args, "rdzv_id", None), str):
                from elasticrun.launcher.parsing import check_run_id

                check_run_id(args.rdzv_id)
            run: Callable[[argparse.Namespace], int] = args.run
            return run(args)
        _check_not_a_misspelt_subcommand(argv)
        args = launch_parser().parse_args(argv)
        from elasticrun.launcher.assemble import build_config
        from elasticrun.launcher.launch import run_launch
        log_format.use(args.log_format)
        return run_launch(build_config(args, os.environ))
    except ElasticrunError as e:
        print(log_format.error_line(_one_line(str(e))), file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("elasticrun: interrupted", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:
        # The reader went away (`elasticrun status | head`): not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def console_main() -> None:
    """Entry point of the `elasticrun` script and `python -m elasticrun`."""
    sys.exit(main())
