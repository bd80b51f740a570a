"""What the two clients of the built-in store server share: the connection and its errors.

`GrpcStore` (async, `store/client.py`) and `C10dClient` (blocking, `store/c10d_client.py`)
dial the server the same way (endpoint check, channel options, TLS, the token header),
retry the same failures with the same backoff, and turn a gRPC status into our errors
through one table, so both report an unreachable or refusing server alike. Kept apart
from either client so that a worker loading the blocking one does not load the other.
"""

from __future__ import annotations

import socket
import ssl

import grpc

from elasticrun.errors import (
    ElasticrunError,
    LeaseExpiredError,
    StoreAuthError,
    StoreError,
    StoreLimitError,
    StoreRequestError,
    StoreSettingError,
    StoreUnavailableError,
)
from elasticrun.store.wire import (
    CLIENT_PING_MS,
    DEFAULT_C10D_PORT,
    MAX_REPLY_BYTES,
    TOKEN_METADATA_KEY,
    bearer,
)

#: The first pause before retrying a call that found the server unreachable, and the
#: longest: the pause doubles in between.
FIRST_BACKOFF = 0.05
MAX_BACKOFF = 1.0

#: Reconnect fast (grpc's default backoff grows to two minutes); ping idle connections
#: so that a dead server is noticed by a quiet watch too.
CLIENT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.keepalive_time_ms", CLIENT_PING_MS),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", MAX_REPLY_BYTES),
    ("grpc.max_send_message_length", -1),
    # A connection of its own per client (grpc shares them within a process by
    # default): the server's per-connection limits then hold per client.
    ("grpc.use_local_subchannel_pool", 1),
]

_TLS_MARKERS = ("ssl", "handshake", "certificate", "tsi_")

#: What a server that is gone or going answers, worth another try: nobody listens, or a
#: stopping server cancelled the call (our own cancellations raise asyncio.CancelledError).
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def grpc_target(endpoint: str) -> str:
    """Check `host:port` (`[v6]:port` too) and return it as a gRPC target."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise StoreSettingError(
            "endpoint", f"malformed store endpoint {endpoint!r}: expected host:port, e.g. node0:{DEFAULT_C10D_PORT}"
        )
    return endpoint


def credentials(tls_ca: bytes | None) -> grpc.ChannelCredentials | None:
    """TLS trusting the CA `tls_ca` (PEM), or None for a plaintext channel."""
    return grpc.ssl_channel_credentials(root_certificates=tls_ca) if tls_ca else None


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata every call carries: the token's header, when there is a token."""
    return ((TOKEN_METADATA_KEY, bearer(token)),) if token else ()


#: How long the probe of `tls_refusal` may take: a TLS server answers at once.
TLS_PROBE_TIMEOUT = 2.0


def hung_up(error: grpc.RpcError) -> bool:
    """Whether the server closed the connection before HTTP/2 began: what a plaintext
    client sees of a TLS server (and of a server going away). See `tls_refusal`."""
    return "socket closed" in (error.details() or "").lower()


def tls_refusal(endpoint: str) -> StoreAuthError | None:
    """For a plaintext client that the server at `endpoint` hung up on: the error to
    raise if that server speaks TLS, else None (it is going away: retry). Blocking.

    grpc words a TLS server's hang-up as "Socket closed" (UNAVAILABLE), as it does a
    server going away, so the client would retry for its whole timeout and end in
    "unreachable". A server that answers a TLS ClientHello with a TLS handshake record
    speaks TLS: say so at once.
    """
    if not _speaks_tls(endpoint):
        return None
    return StoreAuthError(
        f"the store at {endpoint} speaks TLS but this client does not: give the store's CA "
        "certificate (--rdzv-conf tls_ca=<file>)"
    )


def _speaks_tls(endpoint: str) -> bool:
    host, _, port = endpoint.rpartition(":")
    outgoing = ssl.MemoryBIO()
    hello = ssl.create_default_context()
    hello.check_hostname = False
    hello.verify_mode = ssl.CERT_NONE
    try:  # only to write our ClientHello into `outgoing`: no reply is read here
        hello.wrap_bio(ssl.MemoryBIO(), outgoing).do_handshake()
    except ssl.SSLWantReadError:
        pass
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=TLS_PROBE_TIMEOUT) as sock:
            sock.sendall(outgoing.read())
            reply = sock.recv(2)
    except OSError:
        return False
    return reply == b"\x16\x03"  # a TLS handshake record (ServerHello), any TLS version


def _is_tls_failure(details: str) -> bool:
    # "tcp handshaker shutdown" is a plain connection that did not complete (a busy or
    # stopping server): retryable, not a TLS failure.
    lowered = details.lower().replace("tcp handshaker", "")
    return any(marker in lowered for marker in _TLS_MARKERS)


def retryable(error: grpc.RpcError) -> bool:
    """Whether the call may succeed if tried again: the server is away, not refusing."""
    return error.code() in _RETRYABLE and not _is_tls_failure(error.details() or "")


def error_from(error: grpc.RpcError, endpoint: str, lease: int = 0) -> ElasticrunError:
    """The one translation of a gRPC status into our errors, for both clients."""
    code, details = error.code(), error.details() or ""
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return StoreAuthError(f"the store at {endpoint} refused us: {details}")
    if _is_tls_failure(details):
        return StoreAuthError(
            f"TLS with the store at {endpoint} failed (is the CA right, and does the "
            f"server speak TLS?): {details}"
        )
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return StoreLimitError(f"the store at {endpoint} refused the request: {details}")
    if code is grpc.StatusCode.NOT_FOUND and lease:
        return LeaseExpiredError(lease)
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return StoreRequestError(f"the store at {endpoint} refused the request: {details}")
    if code in (*_RETRYABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return StoreUnavailableError(endpoint, details or code.name)
    return StoreError(f"the store at {endpoint} failed: {code.name}: {details}")
