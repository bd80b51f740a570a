"""What the two clients of the built-in store server share: the connection and its errors.

`GrpcStore` (async, `store/client/grpc_store.py`) and `C10dClient` (blocking, `store/client/c10d.py`)
dial the server the same way (endpoint check, channel options, TLS, the token header),
retry the same failures with the same backoff (`store/backoff.py`), and turn a gRPC status into our errors
through one table, so both report an unreachable or refusing server alike. Kept apart
from either client so that a worker loading the blocking one does not load the other.
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass, field

import grpc

from elasticrun.errors import (
    ElasticrunError,
    LeaseExpiredError,
    NotAStoreError,
    StoreAuthError,
    StoreError,
    StoreLimitError,
    StorePermissionError,
    StoreRequestError,
    StoreSettingError,
    StoreUnavailableError,
)
from elasticrun.store.wire import (
    CLIENT_PING_MS,
    DEFAULT_C10D_PORT,
    DEFAULT_TIMEOUT,
    MAX_REPLY_BYTES,
    TOKEN_ENV,
    TOKEN_METADATA_KEY,
    TlsKeyPair,
    bearer,
)

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
    # default): one client's long replies never queue behind another's on one socket.
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


def credentials(tls_ca: bytes | None, client_tls: TlsKeyPair | None = None) -> grpc.ChannelCredentials | None:
    """TLS trusting the CA `tls_ca` (PEM) and presenting `client_tls`; None (plaintext) without either.

    The client certificate goes to a server that asks for one."""
    if tls_ca is None and client_tls is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=tls_ca,
        private_key=client_tls.key if client_tls else None,
        certificate_chain=client_tls.cert if client_tls else None,
    )


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata every call carries: the token's header, when there is a token."""
    return ((TOKEN_METADATA_KEY, bearer(token)),) if token else ()


#: How long a probe of the server may take (`tls_refusal`, etcd's status call): a server answers at once.
PROBE_TIMEOUT = 2.0


@dataclass(frozen=True, slots=True)
class Dial:
    """Where and how a client reaches the store server: what both clients are made from.

    Checked when made: a malformed endpoint or TLS material grpc refuses fails here,
    before any call. `timeout` bounds each call with its retries."""

    endpoint: str
    token: str | None = None
    #: the CA to trust (PEM): the client speaks TLS
    tls_ca: bytes | None = None
    #: the certificate to present to a server that asks for one (mutual TLS)
    client_tls: TlsKeyPair | None = None
    timeout: float = DEFAULT_TIMEOUT
    #: what every call carries: the token's header, when there is a token
    metadata: tuple[tuple[str, str], ...] = field(init=False)
    _target: str = field(init=False, repr=False)
    _credentials: grpc.ChannelCredentials | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_target", grpc_target(self.endpoint))
        object.__setattr__(self, "metadata", call_metadata(self.token))
        object.__setattr__(self, "_credentials", credentials(self.tls_ca, self.client_tls))

    @property
    def tls(self) -> bool:
        return self._credentials is not None

    def channel(self) -> grpc.Channel:
        """A blocking channel to the server (the c10d client's)."""
        if self._credentials is None:
            return grpc.insecure_channel(self._target, options=CLIENT_OPTIONS)
        return grpc.secure_channel(self._target, self._credentials, options=CLIENT_OPTIONS)

    def aio_channel(self) -> grpc.aio.Channel:
        """An asyncio channel to the server, to be made inside the loop that will use it."""
        if self._credentials is None:
            return grpc.aio.insecure_channel(self._target, options=CLIENT_OPTIONS)
        return grpc.aio.secure_channel(self._target, self._credentials, options=CLIENT_OPTIONS)

    def tls_refusal(self) -> StoreAuthError | None:
        """After the server hung up on this client: the error if it refused our TLS (`tls_refusal`)."""
        return tls_refusal(self.endpoint, self.tls, self.client_tls)


def hung_up(error: grpc.RpcError) -> bool:
    """Whether the server closed the connection before HTTP/2 began.

    What a client sees of a server refusing its TLS (and of a server going away). See
    `tls_refusal`."""
    return "socket closed" in (error.details() or "").lower()


def tls_refusal(endpoint: str, tls: bool, client_tls: TlsKeyPair | None = None) -> StoreAuthError | None:
    """For a client that the server at `endpoint` hung up on.

    The error to raise if that was a refusal of its TLS, else None (the server is going
    away: retry). Blocking.

    grpc words every such hang-up as "Socket closed" (UNAVAILABLE), a server going away
    as much as a refusal, so the client would retry for its whole timeout and end in
    "unreachable". The server itself is asked instead, over a connection of our own:

    - a plaintext client (`tls` false): a server that answers a TLS ClientHello with a
      TLS handshake record speaks TLS;
    - a TLS client: a server that requires client certificates and does not take ours
      (none, another CA's, expired) completes the handshake, then closes the connection
      without a word (gRPC's TLS sends no alert), where it would open HTTP/2 at once.
    """
    if not tls:
        if not _speaks_tls(endpoint):
            return None
        return StoreAuthError(
            f"the store at {endpoint} speaks TLS but this client does not: give the store's CA "
            "certificate (--rdzv-conf tls_ca=<file>)"
        )
    if not _refuses_client(endpoint, client_tls):
        return None
    if client_tls is None:
        return StoreAuthError(
            f"the store at {endpoint} requires a client certificate and this client has none: "
            "give it one signed by the store's client_ca (--rdzv-conf client_cert=<file>,client_key=<file>)"
        )
    fault = _certificate_fault(client_tls)
    if fault is not None:
        return StoreAuthError(
            f"the store at {endpoint} refused this client's certificate (--rdzv-conf client_cert): "
            f"{fault}; give a valid one"
        )
    return StoreAuthError(
        f"the store at {endpoint} refused this client's certificate (--rdzv-conf client_cert): "
        "check that it is signed by the CA the store was given as client_ca"
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
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT) as sock:
            sock.sendall(outgoing.read())
            reply = sock.recv(2)
    except OSError:
        return False
    return reply == b"\x16\x03"  # a TLS handshake record (ServerHello), any TLS version


def _refuses_client(endpoint: str, client_tls: TlsKeyPair | None) -> bool:
    """Whether the server at `endpoint` closes a TLS connection presenting `client_tls` at once.

    At once: right after the handshake, instead of opening HTTP/2 (see `tls_refusal`)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # whether the server takes us is all that is asked here
    context.set_alpn_protocols(["h2"])
    host, _, port = endpoint.rpartition(":")
    try:
        if client_tls is not None:
            client_tls.load_into(context)
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT) as sock:
            with context.wrap_socket(sock) as connection:
                try:
                    return not connection.recv(1)  # the server's HTTP/2 SETTINGS, or the end
                except (ConnectionResetError, ssl.SSLError):  # a reset or an alert, after the handshake
                    return True
    except OSError:  # no connection, no handshake, no answer in time: not a refusal of us
        return False


def _certificate_fault(pair: TlsKeyPair) -> str | None:
    """What OpenSSL finds wrong in `pair`'s certificate itself, short of who signed it.

    "certificate has expired", "... is not yet valid", "unsupported certificate
    purpose"; None when nothing (or the pair does not load).

    The certificate is checked as a server checks a client's, with itself as the trust
    anchor (a partial chain), in a TLS handshake in memory between two contexts that
    both hold `pair`.
    """
    checker = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    checker.verify_mode = ssl.CERT_REQUIRED
    checker.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    try:
        checker.load_verify_locations(cadata=pair.cert.decode("ascii"))
        pair.load_into(checker)
        pair.load_into(client)
    except (ssl.SSLError, UnicodeDecodeError):
        return None
    to_checker, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    ends = (client.wrap_bio(to_client, to_checker), checker.wrap_bio(to_checker, to_client, server_side=True))
    for _ in range(3):  # TLS 1.3 takes two flights each way
        for end in ends:
            try:
                end.do_handshake()
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLCertVerificationError as e:
                return e.verify_message
            except ssl.SSLError:
                return None
    return None


def _is_tls_failure(details: str) -> bool:
    # "tcp handshaker shutdown", or "handshaker shutdown" alone, is a plain connection
    # that did not complete (a busy or stopping server; seen with 1,000 clients
    # connecting at once): retryable, not a TLS failure, which names ssl or tsi_.
    lowered = details.lower().replace("tcp handshaker", "").replace("handshaker shutdown", "")
    return any(marker in lowered for marker in _TLS_MARKERS)


def retryable(error: grpc.RpcError) -> bool:
    """Whether the call may succeed if tried again: the server is away, not refusing."""
    details = error.details() or ""
    return error.code() in _RETRYABLE and not _is_tls_failure(details) and not foreign(error)


#: etcd's cheapest call, open to every client (no auth): whoever answers it is etcd
ETCD_STATUS_METHOD = "/etcdserverpb.Maintenance/Status"

#: what grpc says of a peer that does not speak HTTP/2 (an HTTP/1 server, SSH, a
#: database): it sent bytes that are no HTTP/2 frame
_NOT_HTTP2 = ("failed parsing http/2", "http1.x server")


def foreign(error: grpc.RpcError) -> bool:
    """Whether the server at the endpoint is not the built-in store.

    A gRPC server without our service (etcd, another program's), or no gRPC server at
    all. A store that is starting or restarting never answers so: this is final, not
    worth a retry."""
    details = (error.details() or "").lower()
    if error.code() is grpc.StatusCode.UNIMPLEMENTED:
        return "unknown service" in details
    return any(marker in details for marker in _NOT_HTTP2)


def foreign_error(error: grpc.RpcError, endpoint: str, *, etcd: bool) -> NotAStoreError:
    """What to tell a client that `foreign(error)` found at `endpoint`.

    `etcd`: the server answered etcd's status call."""
    if etcd:
        return NotAStoreError(endpoint, "an etcd server", "give --rdzv-backend=etcd, or the built-in store's endpoint")
    if error.code() is grpc.StatusCode.UNIMPLEMENTED:
        what = "a gRPC server of another kind"
    else:
        what = "a program that does not speak gRPC"
    return NotAStoreError(
        endpoint, what, "check --rdzv-endpoint (the host and port of the agent that hosts the store, "
        "or of elasticrun store serve)"
    )


def plain_cause(details: str) -> str:
    """grpc's words for a connection that failed, in ours (what was tried, what it means).

    Other details unchanged."""
    lowered = details.lower()
    if "connection refused" in lowered:
        return "connection refused: nothing listens on that port"
    if "errors resolving" in lowered or "dns resolution failed" in lowered:
        return "cannot resolve the host name"
    if "before receiving settings frame" in lowered:
        return "connections open, but nothing answers as a gRPC server there"
    return details


def error_from(error: grpc.RpcError, endpoint: str, lease: int = 0) -> ElasticrunError:
    """The one translation of a gRPC status into our errors, for both clients."""
    code, details = error.code(), error.details() or ""
    if code is grpc.StatusCode.UNAUTHENTICATED:
        if "store token" in details:  # the server names its own flag; ours is the client's
            return StoreAuthError(
                f"the store at {endpoint} refused us: missing or wrong store token; give the store's token "
                f"with --rdzv-conf token_file=<file> or ${TOKEN_ENV}"
            )
        return StoreAuthError(f"the store at {endpoint} refused us: {details}")
    if code is grpc.StatusCode.PERMISSION_DENIED:
        return StorePermissionError(f"the store at {endpoint} refused the request: {details}")
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
        return StoreUnavailableError(endpoint, plain_cause(details) or code.name)
    return StoreError(f"the store at {endpoint} failed: {code.name}: {details}")
