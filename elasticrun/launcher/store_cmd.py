"""`elasticrun store serve`: run the built-in store server alone on a dedicated host."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from elasticrun.errors import UsageError
from elasticrun.launcher import log_format
from elasticrun.launcher.config import settings_from_flags
from elasticrun.launcher.gc_settings import settle_gc
from elasticrun.launcher.metrics_http import MetricsAddress, metrics_address, serving
from elasticrun.store.access import exposure_warning, read_token, server_tls
from elasticrun.store.server import StoreServer
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


#: the flag of each store setting `store serve` takes
_FLAGS = {
    "token_file": "--token-file",
    "require_token": "--require-token",
    "tls_cert": "--tls-cert",
    "tls_key": "--tls-key",
    "client_ca": "--client-ca",
}


def _flag_of(setting: str) -> str:
    return _FLAGS.get(setting, setting)


def serve_config(args: argparse.Namespace, environ: Mapping[str, str]) -> ServeConfig:
    """Check the flags of `store serve` and gather what the server needs."""
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be within 0..65535, got {args.port}")
    given = {setting: getattr(args, setting) for setting in _FLAGS if getattr(args, setting) is not None}
    with settings_from_flags(_flag_of):
        tls, client_ca = server_tls(given)
        token = read_token(args.token_file, environ, required=args.require_token)
    return ServeConfig(args.host, args.port, token, tls, client_ca, metrics_address(args.metrics_port))


async def serve(config: ServeConfig) -> int:
    """Serve until SIGTERM or SIGINT, then stop gracefully."""
    metrics = None
    if config.metrics is not None:  # the library is loaded only when asked for
        from prometheus_client import CollectorRegistry
        from prometheus_client.process_collector import ProcessCollector

        from elasticrun.store.metrics import StoreMetrics

        metrics = StoreMetrics(CollectorRegistry(auto_describe=True))
        ProcessCollector(registry=metrics.registry)
    server = StoreServer(
        config.host, config.port, token=config.token, tls=config.tls, client_ca=config.client_ca, metrics=metrics
    )
    with contextlib.ExitStack() as stack:
        if metrics is not None:
            stack.enter_context(serving(config.metrics, metrics.registry))
        with settings_from_flags(_flag_of):
            await server.start()
        return await _serve_until_stopped(server, config)


async def _serve_until_stopped(server: StoreServer, config: ServeConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # On stdout, whatever the level: a script that asked for --port 0 reads it there.
    print(log_format.line(logging.INFO, f"store serving on {server.endpoint}", log.name), flush=True)
    warning = exposure_warning(server.endpoint, config.token, "--token-file", client_ca=config.client_ca)
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


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `store serve` to the CLI; the parsed args carry `run(args) -> int`."""
    store = subparsers.add_parser("store", help="the built-in key-value store")
    commands = store.add_subparsers(dest="store_command", required=True)
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
        "--log-format", choices=log_format.FORMATS, default=log_format.default_format(),
        help="its own lines: text, or json (one object a line); default: $ELASTICRUN_LOG_FORMAT, else text",
    )
    serve_parser.set_defaults(run=_run)
