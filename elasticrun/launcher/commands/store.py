"""`elasticrun store`: the built-in store's own commands, and etcd's roles.

- `serve` runs the built-in store server alone on a dedicated host;
- `credential` prints a worker or reader credential derived from the store's token,
  for an operator to hand out (`store/credentials.py`);
- `etcd-roles` creates etcd's users and roles for the same split (`store/etcd/roles.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from elasticrun import __version__
from elasticrun.descriptors import quiet_exhaustion
from elasticrun.errors import UsageError
from elasticrun.launcher import log_format
from elasticrun.launcher.flags import Parser
from elasticrun.launcher.gc_settings import settle_gc
from elasticrun.launcher.metrics_http import MetricsAddress, metrics_address, serving
from elasticrun.launcher.rdzv_conf import parse_rdzv_conf, settings_from_flags
from elasticrun.launcher.store_state_dir import journaled
from elasticrun.store.credentials import reader_credential, worker_credential
from elasticrun.store.server.memory import MemoryStore
from elasticrun.store.server.store_server import StoreServer
from elasticrun.store.settings import exposure_warning, parse_access, read_file, read_token, server_tls
from elasticrun.store.wire import DEFAULT_C10D_PORT, TOKEN_ENV, TlsKeyPair

log = logging.getLogger("elasticrun.store")

@dataclass(frozen=True, slots=True)
class ServeConfig:
    host: str
    port: int
    token: str | None
    tls: TlsKeyPair | None
    client_ca: bytes | None
    metrics: MetricsAddress | None = None
    #: --state-dir: where the ended jobs are kept across restarts (store_state_dir.py)
    state_dir: Path | None = None


#: the store settings `store serve` takes, each from the flag of its name
_SERVE_SETTINGS = ("token_file", "require_token", "tls_cert", "tls_key", "client_ca")


def _flag_of(setting: str) -> str:
    """The flag of a setting in these commands (`token_file` is --token-file).

    A variable (`$ELASTICRUN_STORE_TOKEN`) stays as it is."""
    return "--" + setting.replace("_", "-") if setting.isidentifier() and setting.islower() else setting


def serve_config(args: argparse.Namespace, environ: Mapping[str, str]) -> ServeConfig:
    """Check the flags of `store serve` and gather what the server needs."""
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be within 0..65535, got {args.port}")
    given = {setting: getattr(args, setting) for setting in _SERVE_SETTINGS if getattr(args, setting) is not None}
    with settings_from_flags(_flag_of):
        tls, client_ca = server_tls(given)
        token = read_token(args.token_file, environ, required=args.require_token)
    state_dir = Path(args.state_dir) if args.state_dir else None
    # PORT alone: where the store listens, not every address (a loopback store stays one)
    metrics = metrics_address(args.metrics_port, default_host=args.host)
    return ServeConfig(args.host, args.port, token, tls, client_ca, metrics, state_dir)


async def serve(config: ServeConfig) -> int:
    """Serve until SIGTERM or SIGINT, then stop gracefully."""
    metrics = None
    if config.metrics is not None:  # the library is loaded only when asked for
        from prometheus_client import CollectorRegistry, Info
        from prometheus_client.process_collector import ProcessCollector

        from elasticrun.store.server.metrics import StoreMetrics

        metrics = StoreMetrics(CollectorRegistry(auto_describe=True))
        ProcessCollector(registry=metrics.registry)
        Info("elasticrun", "This store server: where it listens, the elasticrun version",
             registry=metrics.registry).info({"address": f"{config.host}:{config.port}", "version": __version__})
    engine = MemoryStore()
    server = StoreServer(
        config.host, config.port, engine=engine, token=config.token, tls=config.tls, client_ca=config.client_ca,
        metrics=metrics,
    )
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(engine.close)
        if config.state_dir is not None:  # restored before any client is served
            await stack.enter_async_context(journaled(config.state_dir, engine))
        if metrics is not None:
            stack.enter_context(serving(config.metrics, metrics.registry))
        with settings_from_flags(_flag_of):
            await server.start()
        return await _serve_until_stopped(server, config)


async def _serve_until_stopped(server: StoreServer, config: ServeConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    quiet_exhaustion(loop)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # On stdout, whatever the level: a script that asked for --port 0 reads it there.
    print(log_format.line(logging.INFO, f"store serving on {server.endpoint}", log.name), flush=True)
    warning = exposure_warning(
        server.endpoint, config.token, "--token-file", client_ca=config.client_ca, tls=config.tls is not None
    )
    if warning is not None:
        log.warning("%s", warning)
    await stop.wait()
    await server.stop()
    return 0


def _run(args: argparse.Namespace) -> int:
    log_format.use(args.log_format)
    config = serve_config(args, os.environ)
    settle_gc()
    return asyncio.run(serve(config))


def credential(args: argparse.Namespace, environ: Mapping[str, str]) -> str:
    """The credential `store credential` prints: a worker's of --rdzv-id, or the reader's."""
    with settings_from_flags(_flag_of):
        token = read_token(args.token_file, environ)
        if token is None:
            raise UsageError(f"no store token to derive it from: give --token-file, or set ${TOKEN_ENV}")
        if args.role == "reader":
            if args.rdzv_id is not None:
                raise UsageError("--rdzv-id goes with --role worker only: a reader credential reads every job")
            return reader_credential(token)
        if args.rdzv_id is None:
            raise UsageError("--role worker needs --rdzv-id: a worker credential reaches one job's worker keys")
        if not args.rdzv_id or "/" in args.rdzv_id:
            raise UsageError(f"--rdzv-id must be a non-empty name without '/', got {args.rdzv_id!r}")
        return worker_credential(token, args.rdzv_id)


def _print_credential(args: argparse.Namespace) -> int:
    print(credential(args, os.environ), flush=True)
    return 0


def _etcd_roles(args: argparse.Namespace) -> int:
    from elasticrun.store.etcd.backend import EtcdStore
    from elasticrun.store.etcd.roles import ADMIN, READER, set_up

    conf = parse_rdzv_conf(args.rdzv_conf, "etcd")
    with settings_from_flags():
        access = parse_access("etcd", args.rdzv_endpoint, conf, os.environ)
    with settings_from_flags(_flag_of):
        passwords = {
            role: _password(setting, path)
            for role, setting, path in (
                (ADMIN, "admin_password_file", args.admin_password_file),
                (READER, "reader_password_file", args.reader_password_file),
            )
            if path is not None
        }
    if not passwords:
        raise UsageError("give --admin-password-file, --reader-password-file or both: the users to set up")

    async def run() -> list[str]:
        store = EtcdStore(
            access.endpoints, tls_ca=access.tls_ca, client_tls=access.client_tls,
            user=access.user, password=access.password, timeout=access.timeout,
        )
        try:
            return await set_up(store, passwords)
        finally:
            await store.close()

    for line in asyncio.run(run()):
        print(f"elasticrun store etcd-roles: {line}", flush=True)
    return 0


def _password(setting: str, path: str) -> str:
    """A password from the file `path` names: its first line, not empty."""
    try:
        password = read_file(setting, path).decode().rstrip("\r\n")
    except UnicodeDecodeError:
        raise UsageError(f"{_flag_of(setting)}: {path} is not UTF-8 text") from None
    if not password:
        raise UsageError(f"{_flag_of(setting)}: {path} is empty")
    return password


def _no_command(args: argparse.Namespace) -> int:
    raise UsageError(
        "elasticrun store takes a command: serve (run the store on its own), credential (print a worker "
        "or reader credential) or etcd-roles (set up etcd's users); see elasticrun store serve --help"
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `store serve`, `store credential` and `store etcd-roles` to the CLI.

    The parsed args carry `run(args) -> int`."""
    store = subparsers.add_parser("store", help="the built-in key-value store")
    store.set_defaults(run=_no_command)
    commands = store.add_subparsers(dest="store_command", metavar="COMMAND", parser_class=Parser)
    serve_parser = commands.add_parser(
        "serve",
        help="run the store server alone (instead of inside the agent on the endpoint host)",
    )
    serve_parser.add_argument(
        "--host", default="0.0.0.0", help="address to listen on (default: all interfaces)"
    )
    serve_parser.add_argument("--port", type=int, default=DEFAULT_C10D_PORT, help="0: any free port")
    serve_parser.add_argument(
        "--token-file",
        help=f"file holding the token clients must present (default: ${TOKEN_ENV})",
    )
    serve_parser.add_argument(
        "--require-token",
        action="store_true",
        help=f"refuse to start without a token (from --token-file or ${TOKEN_ENV})",
    )
    serve_parser.add_argument("--tls-cert", help="PEM certificate chain: serve TLS only")
    serve_parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    serve_parser.add_argument(
        "--client-ca",
        help="PEM CA certificate: require every client to present a certificate it signed "
        "(mutual TLS; needs --tls-cert and --tls-key)",
    )
    serve_parser.add_argument(
        "--metrics-port", metavar="[HOST:]PORT", default=None,
        help="serve Prometheus metrics of the store on this port (all interfaces, or HOST only) at /metrics; "
        "off by default",
    )
    serve_parser.add_argument(
        "--state-dir", default=None,
        help="a private folder (made 0700) where the store keeps the jobs that ended, so that a job ended "
        "before a restart of the store stays ended for its closed_ttl; off by default",
    )
    serve_parser.add_argument(
        "--log-format", choices=log_format.FORMATS, default=log_format.default_format(),
        help="its own lines: text, or json (one object a line); default: $ELASTICRUN_LOG_FORMAT, else text",
    )
    serve_parser.set_defaults(run=_run)
    credential_parser = commands.add_parser(
        "credential",
        help="print a worker or reader credential for the built-in store, derived from its token",
        description="Print, on one line, a credential derived from the store's token: a worker's reaches the "
        "c10d operations on one job's own keys, a reader's reads every key and writes none. The store checks "
        "it with its token alone; give the token with --token-file or $" + TOKEN_ENV + ".",
    )
    credential_parser.add_argument("--role", required=True, choices=("worker", "reader"))
    credential_parser.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", help="the worker's job (--role worker)")
    credential_parser.add_argument(
        "--token-file", help=f"file holding the store's token (default: ${TOKEN_ENV})"
    )
    credential_parser.set_defaults(run=_print_credential)
    roles_parser = commands.add_parser(
        "etcd-roles",
        help="create etcd's elasticrun-admin and elasticrun-reader users and roles on /elasticrun/",
        description="As a user of etcd's root role (--rdzv-conf user=root,password_file=...), create the roles "
        "elasticrun-admin (readwrite on /elasticrun/) and elasticrun-reader (read on /elasticrun/), and a user "
        "of each with the password in its file (an existing user gets that password). Workers need no etcd user.",
    )
    roles_parser.add_argument(
        "--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", required=True, help="etcd: h1:2379,..."
    )
    roles_parser.add_argument(
        "--rdzv-conf", "--rdzv_conf", dest="rdzv_conf", action="append", default=[],
        help="etcd access: user, password_file, password_env, ca_cert, client_cert, client_key, store_timeout",
    )
    roles_parser.add_argument("--admin-password-file", help="the password of the user elasticrun-admin")
    roles_parser.add_argument("--reader-password-file", help="the password of the user elasticrun-reader")
    roles_parser.set_defaults(run=_etcd_roles)
