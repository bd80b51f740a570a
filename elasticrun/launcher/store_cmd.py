"""`elasticrun store serve`: run the built-in store server alone on a dedicated host."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from elasticrun.errors import UsageError
from elasticrun.launcher.gc_settings import settle_gc
from elasticrun.store.server import StoreServer, TlsKeyPair
from elasticrun.store.wire import DEFAULT_C10D_PORT, TOKEN_ENV


@dataclass(frozen=True, slots=True)
class ServeConfig:
    host: str
    port: int
    token: str | None
    tls: TlsKeyPair | None


def load_token(token_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The store token: the file's content (stripped), else $ELASTICRUN_STORE_TOKEN.

    It travels as a gRPC header value, which must be printable ASCII: anything else is
    refused here, with the place it came from, rather than failing every call later.
    """
    if token_file is None:
        token, where = environ.get(TOKEN_ENV) or None, f"${TOKEN_ENV}"
    else:
        try:
            data = Path(token_file).read_bytes()
        except OSError as e:
            raise UsageError(f"cannot read --token-file {token_file}: {e.strerror}") from None
        token, where = data.decode("latin-1").strip(), f"--token-file {token_file}"
        if not token:
            raise UsageError(f"{where} is empty")
    if token is not None and not all(" " <= c <= "~" for c in token):
        raise UsageError(f"{where}: the token must be printable ASCII text (it is sent as a gRPC header)")
    return token


def _read_pem(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read {flag} {path}: {e.strerror}") from None


def serve_config(args: argparse.Namespace, environ: Mapping[str, str]) -> ServeConfig:
    """Check the flags of `store serve` and gather what the server needs."""
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be within 0..65535, got {args.port}")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together: give both or neither")
    tls = None
    if args.tls_cert is not None:
        tls = TlsKeyPair(
            cert=_read_pem(args.tls_cert, "--tls-cert"), key=_read_pem(args.tls_key, "--tls-key")
        )
    return ServeConfig(args.host, args.port, load_token(args.token_file, environ), tls)


async def serve(config: ServeConfig) -> int:
    """Serve until SIGTERM or SIGINT, then stop gracefully."""
    server = StoreServer(config.host, config.port, token=config.token, tls=config.tls)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"elasticrun store serving on {server.endpoint}", flush=True)
    if config.token is None:
        print(
            f"elasticrun store: no token, so anyone who can reach {server.endpoint} may "
            f"read and write it (set --token-file or {TOKEN_ENV})",
            file=sys.stderr,
            flush=True,
        )
    await stop.wait()
    await server.stop()
    return 0


def _run(args: argparse.Namespace) -> int:
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
    serve_parser.add_argument("--tls-cert", help="PEM certificate chain: serve TLS only")
    serve_parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    serve_parser.set_defaults(run=_run)
