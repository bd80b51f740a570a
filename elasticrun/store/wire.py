"""What both ends of a store connection agree on, each written once.

The gRPC server and its clients read these; a client imports nothing else of the
server, so a training script that only talks to the store (`elasticrun.worker.c10d_store`)
does not load the server or its in-memory engine. The etcd backend and the launcher take
their defaults (ports, the call timeout, the token's variable) from here as well.

Plain values, a pure function, and how a key pair is loaded into Python's ssl (the
server checks its own pair with it, a client its certificate): this module imports
nothing of elasticrun.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass

#: The call metadata that carries the token: `authorization: Bearer <token>`.
TOKEN_METADATA_KEY = "authorization"
#: Where the token comes from when no --token-file is given, for server and clients alike.
TOKEN_ENV = "ELASTICRUN_STORE_TOKEN"
#: Where a worker finds the token: the path of a file only its user can read, written by
#: its agent. Workers never get the token itself in their environment, where whatever
#: they log or send to an experiment tracker would carry it.
TOKEN_FILE_ENV = "ELASTICRUN_STORE_TOKEN_FILE"

#: Replies can carry many keys (a prefix range of a large job): the server sends, and
#: the clients accept, messages up to this size.
MAX_REPLY_BYTES = 256 << 20
#: Requests are bounded by the engine's key and value limits plus this much framing.
REQUEST_SLACK_BYTES = 64 << 10

#: How often a client pings an idle connection (a quiet watch), so that a dead server is
#: noticed; the server must allow pings at least this often or it closes the connection.
CLIENT_PING_MS = 10_000

#: The built-in store's port when `--rdzv-endpoint` names none (torchrun's c10d port).
DEFAULT_C10D_PORT = 29400
#: etcd's client port, when an etcd endpoint names none.
DEFAULT_ETCD_PORT = 2379
#: Why a CA for client certificates (`client_ca`) is refused without the server's own
#: key pair: the settings and the server say it alike.
CLIENT_CA_NEEDS_TLS = "client certificates are checked only over TLS: give the store's own certificate and key too"
#: Seconds one store call may take, retries and failover included (`store_timeout`).
DEFAULT_TIMEOUT = 10.0


#: What the metadata value starts with, before the token or credential.
BEARER_PREFIX = "Bearer "


def bearer(token: str) -> str:
    """The metadata value that carries `token` (or a credential derived from it)."""
    return BEARER_PREFIX + token


@dataclass(frozen=True, slots=True)
class TlsKeyPair:
    """A certificate chain and its private key, PEM-encoded.

    A server's, or a client's for servers that check client certificates (etcd's
    --client-cert-auth, the built-in store's client_ca)."""

    cert: bytes
    key: bytes

    def load_into(self, context: ssl.SSLContext) -> None:
        """Load the pair into `context` (ssl.SSLError when it is no PEM pair).

        Python's ssl loads a key only from a file: it reads both from memory-backed
        files (memfd), so the key is never written to a disk.
        """
        with _memory_file("cert", self.cert) as cert, _memory_file("key", self.key) as key:
            context.load_cert_chain(cert, key, password=_no_password)


def _no_password() -> bytes:
    # Without a callback, OpenSSL would prompt on the terminal for an encrypted key's
    # passphrase; grpc cannot use an encrypted key anyway.
    return b""


@contextlib.contextmanager
def _memory_file(name: str, data: bytes) -> Iterator[str]:
    """A path that reads `data` from memory, for as long as the context lasts."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def is_loopback(host: str) -> bool:
    """Whether only this host can reach `host`.

    A loopback address, or a name that resolves to loopback addresses only. A wildcard
    (0.0.0.0, ::) is every interface."""
    try:
        addresses = {ipaddress.ip_address(host.strip("[]"))}
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return False
        addresses = {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}
    return bool(addresses) and all(address.is_loopback for address in addresses)
