"""The built-in store server: a `MemoryStore` served over gRPC (grpc.aio).

The agent on the `--rdzv-endpoint` host embeds it in its own event loop; a dedicated
host runs it alone with `elasticrun store serve`. Two services share the engine: the
etcd-like `Store` the rendezvous uses and the c10d operations workers use.

Security: with a token, every call must carry `authorization: Bearer <credential>`,
the token itself (admin) or a worker or reader credential derived from it (compared in
constant time, never logged), or gets UNAUTHENTICATED; with a certificate and key, the
server speaks TLS only; with a CA for clients (`client_ca`) as well, it takes only
connections whose client certificate chains to that CA (mutual TLS), and the
certificate may name a role too. Each call is attributed to its caller once, before its
handler runs (`store/callers.py`): a call its role may not make gets PERMISSION_DENIED,
one past its identity's fair share RESOURCE_EXHAUSTED; all of that from the call's headers,
before its message is read (`_guarded`), and the message must come within
`MESSAGE_DEADLINE`. A worker's c10d keys live in its
job's own namespace (`/elasticrun/<job>/w/`), so a torch process group runs unchanged
and sees nothing else. State lives in memory and is never pickled.

No request holds the loop for long: a prefix read is sent in pages of at most 256 keys or
about 256 KiB (`RangePages`), read at one revision, each page encoded as it goes out
(about a millisecond); a caller other than admin has one reply in the making at a time
(`Shares.turn`), so however many reads and watches it runs, the others wait for one of
its pages at most, not for all of them. (The pages are encoded on the loop, not on a
worker thread: protobuf holds the GIL while it copies, so a thread would stall the loop
as long, plus the GIL's switch interval.)
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import operator
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, cast

import grpc

from elasticrun.errors import (
    CompactedError,
    ElasticrunError,
    LeaseExpiredError,
    StoreAddressError,
    StoreLimitError,
    StoreRequestError,
    StoreSettingError,
    StoreUnavailableError,
)
from elasticrun.proto import store_pb2 as pb
from elasticrun.proto import store_pb2_grpc as pb_grpc
from elasticrun.store.api import EventType, KeyValue, WatchEvent
from elasticrun.store.callers import (
    DEFAULT_FAIR_SHARE,
    Caller,
    Counter,
    FairShare,
    Shares,
    identify,
    permits,
    refusal,
)
from elasticrun.store.credentials import JOBS_PREFIX, RUN_RECORD, Grant, Role, run_of_launch, worker_prefix
from elasticrun.store.memory import MemoryStore, SpaceQuota
from elasticrun.store.wire import (
    BEARER_PREFIX,
    CLIENT_CA_NEEDS_TLS,
    CLIENT_PING_MS,
    MAX_REPLY_BYTES,
    REQUEST_SLACK_BYTES,
    TOKEN_ENV,
    TOKEN_METADATA_KEY,
    TlsKeyPair,
)

if TYPE_CHECKING:  # imported by `store serve` and the launcher only when metrics are asked for
    from elasticrun.store.metrics import ServerLoad, StoreMetrics

logger = logging.getLogger(__name__)

#: Calls in progress at once (watches and waits last): about 25 KiB each, so at most
#: ~2.5 GiB however many streams clients open; past it a call gets RESOURCE_EXHAUSTED.
#: A 1,000-node job holds a few thousand.
DEFAULT_MAX_CALLS = 100_000
#: A page of a prefix read: about this many bytes of keys and values (at least one key,
#: so up to a largest value more), or this many keys, whichever comes first. Encoding
#: one takes about a millisecond of CPU (a 1 MiB value alone, the largest, about 4 ms).
PAGE_BYTES = 256 << 10
PAGE_KEYS = 256
#: The most a c10d multi_get may answer at once: unlike a prefix read it cannot be
#: paged, and encoding a reply costs about 4 ms per MiB of the server's loop.
MAX_MULTI_GET_BYTES = 4 << 20
#: The most keys one c10d check, wait or multi_get may name (as many as a job's workers
#: may hold; duplicates count once in the work, every time in the reply), and the most
#: bytes its request may take, refused
#: before it is parsed; a multi_set writes at most MAX_MULTI_SET_KEYS keys (each write
#: keeps history and wakes watchers: ~10 µs a key). Their requests are parsed, bounded
#: and looked up by the handler, in the caller's turn (`Shares.turn`): one such call of
#: a worker's at a time, each a few milliseconds of the loop at most. Unbounded, a 1 MiB
#: list of one key 340,000 times held the loop 150 ms a call (issue 36).
MAX_KEYS_PER_CALL = 10_000
MAX_KEY_LIST_BYTES = 256 << 10
MAX_MULTI_SET_KEYS = 1_024
#: The most of the loop's time one identity other than admin spends on those steps.
KEY_LIST_LOOP_SHARE = 0.25
#: How long a call may take to deliver its request message once its headers arrived:
#: a 1 MiB value over a slow link takes well under a second; a caller that sends headers
#: and nothing more holds its call (and its share) no longer than this.
MESSAGE_DEADLINE = 10.0
#: How long in-flight calls may finish when the server stops.
DEFAULT_STOP_GRACE = 2.0

#: Calls open at once on one connection.
MAX_STREAMS_PER_CONNECTION = 256

#: Pings keep idle connections (a quiet watch) alive through NATs and reveal dead
#: peers; the server must accept the client's pace.
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a second server on a busy port must fail, not share it
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # half the clients' pace: a ping that comes a little early is no abuse
    ("grpc.http2.min_ping_interval_without_data_ms", CLIENT_PING_MS // 2),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_send_message_length", MAX_REPLY_BYTES),
    # Calls open at once on one connection (HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS):
    # a client queues past it, one that does not is refused the stream (REFUSED_STREAM)
    # by gRPC's transport, before any call exists. An agent holds a few, a worker one.
    ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
    # a connection that has not finished its TLS handshake by then is closed
    ("grpc.server_handshake_timeout_ms", 10_000),
]

_T = TypeVar("_T")

#: The caller of the call in progress, set once per call before its handler runs (each
#: call has a task, and so a context, of its own).
_CALLER: contextvars.ContextVar[Caller] = contextvars.ContextVar("store_caller")


class StoreServer:
    """The gRPC store server, run in the caller's event loop.

    It serves `engine` when given (and leaves it open on stop, so a new server can
    serve the same history) or a `MemoryStore` of its own (closed on stop).
    `hosted_by_agent` tells the clients (in every watch reply) that this server lives
    and dies with a launcher agent: a refused connection then means its records are gone
    with it, so the clients stop waiting for it at once instead of after their timeout
    (the rendezvous then waits `store_host_grace` for a new store at the endpoint, the
    head's replacement, and registers there anew).
    `max_calls` bounds the calls in progress from all clients, `fair_share` what each
    identity other than admin may take of them, of watches and of the engine's keys and
    bytes, and what all those identities may take together. `token` is the admin token
    (worker and reader credentials are derived from it). `client_ca` (PEM, with `tls`
    only) makes it require and verify a client certificate on every connection.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        engine: MemoryStore | None = None,
        token: str | None = None,
        tls: TlsKeyPair | None = None,
        client_ca: bytes | None = None,
        max_calls: int = DEFAULT_MAX_CALLS,
        fair_share: FairShare = DEFAULT_FAIR_SHARE,
        hosted_by_agent: bool = False,
        metrics: StoreMetrics | None = None,
    ) -> None:
        self.host = host
        self.hosted_by_agent = hosted_by_agent
        self.max_calls = max_calls
        self.shares = Shares(fair_share, max_calls)
        #: calls in progress by connection (no entry at zero), for the metrics
        self._connections: dict[str, int] = {}
        #: calls and watches in progress, kept as they change: metrics read them from another thread
        self._calls_total = 0
        self._watches_total = 0
        self.metrics = metrics
        self.engine = engine if engine is not None else MemoryStore()
        #: what a worker credential's writes may make the engine hold
        self.quota = SpaceQuota(
            keys=fair_share.keys,
            bytes=fair_share.bytes,
            all_keys=fair_share.of(self.engine.max_keys),
            all_bytes=fair_share.of(self.engine.max_total_bytes),
        )
        self._owns_engine = engine is None
        self._requested_port = port
        self._token = token
        self._tls = tls
        self._client_ca = client_ca
        self._server: grpc.aio.Server | None = None
        self._streams: set[asyncio.Task[object]] = set()
        #: each job's launch record as last read (mod revision, run), and the run whose
        #: worker keys its worker folder holds (`_check_run`)
        self._launches: dict[str, tuple[int, str]] = {}
        self._runs: dict[str, str] = {}
        self._stopping = False
        self.port = 0

    @property
    def endpoint(self) -> str:
        """`host:port` as clients dial it (the bound port once started)."""
        return _host_port(self.host, self.port or self._requested_port)

    async def start(self) -> None:
        """Listen on host:port (port 0: any free port, then see `port`)."""
        max_request = self.engine.max_key_bytes + self.engine.max_value_bytes
        server = grpc.aio.server(
            maximum_concurrent_rpcs=self.max_calls,
            options=[
                *SERVER_OPTIONS,
                ("grpc.max_receive_message_length", max_request + REQUEST_SLACK_BYTES),
            ],
        )
        _add_store_service(_StoreService(self), server, self.counted_call)
        _add_c10d_service(_C10dService(self), server, self.counted_call)
        if self.metrics is not None:
            self.metrics.serving(self.load)
        address = _host_port(self.host, self._requested_port)
        # grpc would only fail to bind on a bad certificate: "port in use"
        if self._tls is not None:
            _check_key_pair(self._tls)
        if self._client_ca is not None:
            _check_client_ca(self._client_ca, self._tls)
        try:
            if self._tls is not None:
                creds = grpc.ssl_server_credentials(
                    [(self._tls.key, self._tls.cert)],
                    root_certificates=self._client_ca,
                    require_client_auth=self._client_ca is not None,
                )
                self.port = server.add_secure_port(address, creds)
            else:
                self.port = server.add_insecure_port(address)
        except (RuntimeError, UnicodeError):  # UnicodeError: an undecodable byte in host
            self.port = 0
        if self.port == 0:  # grpc raises, or (older versions) returns 0
            raise StoreAddressError(
                f"the store cannot listen on {address}: the port is in use or the "
                "address is not one of this host's; choose another host or port"
            )
        await server.start()
        self._server = server
        logger.debug(
            "store serving on %s (%s, %s)",
            self.endpoint,
            ("mutual TLS" if self._client_ca else "TLS") if self._tls else "plaintext",
            "token required" if self._token else "no token",
        )

    async def stop(self, grace: float = DEFAULT_STOP_GRACE) -> None:
        """Stop: end watches and waits at once (clients resume), let calls finish."""
        if self._server is None:
            return
        self._stopping = True
        for task in list(self._streams):
            task.cancel()
        await self._server.stop(grace)
        self._server = None
        if self._owns_engine:
            await self.engine.close()
        logger.debug("store on %s stopped", self.endpoint)

    @contextlib.asynccontextmanager
    async def _long_call(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Track a call that may run for long (watch, wait) so that stop() can end it."""
        task = cast("asyncio.Task[object]", asyncio.current_task())  # grpc.aio: always one
        self._streams.add(task)
        try:
            yield
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the store server is stopping")
        except StoreUnavailableError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        finally:
            self._streams.discard(task)

    @contextlib.asynccontextmanager
    async def counted_call(
        self, context: grpc.aio.ServicerContext, service: str = "", method: str = ""
    ) -> AsyncIterator[None]:
        """Attribute the call to its caller (refusing it if the caller may not make
        it), count it against the caller's share for as long as it runs, and (with
        metrics) by its status code once it ends."""
        code = "OK"
        try:
            caller = await self._caller(context, service, method)
            _CALLER.set(caller)
            why = self.shares.calls.take(caller)
            if why is not None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
            peer = context.peer()
            self._connections[peer] = self._connections.get(peer, 0) + 1
            self._calls_total += 1
            try:
                yield
            finally:
                self.shares.calls.give_back(caller)
                self._calls_total -= 1
                left = self._connections.pop(peer) - 1
                if left:
                    self._connections[peer] = left
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except BaseException:
            status = context.code()
            code = status.name if isinstance(status, grpc.StatusCode) else "UNKNOWN"
            raise
        finally:
            if self.metrics is not None:
                self.metrics.calls.labels(service, method, code).inc()

    async def _caller(self, context: grpc.aio.ServicerContext, service: str, method: str) -> Caller:
        """Who makes this call; the call is refused (UNAUTHENTICATED, PERMISSION_DENIED)
        when its credential is wrong or its role may not make it."""
        given = None
        for key, value in context.invocation_metadata() or ():
            if key == TOKEN_METADATA_KEY:
                text = value.decode("latin-1") if isinstance(value, bytes) else value
                given = text.removeprefix(BEARER_PREFIX) if text.startswith(BEARER_PREFIX) else ""
        certificate: bytes | None = None
        uris: list[bytes] = []
        if self._client_ca is not None:
            facts = context.auth_context()
            certificate = b"".join(facts.get("x509_pem_cert", ()))
            uris = facts.get("peer_uri", [])
        caller = identify(
            bearer=given,
            token=self._token,
            certificate=certificate,
            uris=[uri.decode("utf-8", "replace") for uri in uris],
            host=_host_of(context.peer()),
        )
        if caller is None:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"missing or wrong store token (set it with --token-file or {TOKEN_ENV})",
            )
            raise AssertionError("unreachable: abort raises")
        if caller.grant.run:
            why = await self._check_run(caller.grant)
            if why is not None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        if not permits(caller.grant, service, method):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal(caller.grant, service, method))
        return caller

    async def _check_run(self, grant: Grant) -> str | None:
        """Why a worker credential of one run of a job is refused (that run is not the
        job's current one), or None. The first call of a run that this server sees
        deletes the job's worker keys that earlier runs left (a job that ended without
        closing, agents killed, keys written after the close)."""
        kv = await self.engine.get(f"{JOBS_PREFIX}{grant.job}/{RUN_RECORD}")
        revision = kv.mod_revision if kv is not None else 0
        cached = self._launches.get(grant.job)
        if cached is None or cached[0] != revision:
            cached = self._launches[grant.job] = (revision, run_of_launch(kv.value if kv is not None else None))
        if cached[1] != grant.run:
            return (
                f"this worker credential is of another run of job {grant.job!r} than the one running now "
                "(a job's workers get a credential of their run each time it starts)"
            )
        if self._runs.get(grant.job) != grant.run:
            await self.engine.delete_prefix(worker_prefix(grant.job))
            self._runs[grant.job] = grant.run
        return None

    @contextlib.asynccontextmanager
    async def counted_watch(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Count a watch against its caller's share for as long as it runs."""
        async with _held(self.shares.watches, _CALLER.get(), context):
            self._watches_total += 1
            try:
                yield
            finally:
                self._watches_total -= 1

    async def encoded(self, reply: Callable[[], pb.RangeReply | pb.MultiGetReply]) -> bytes:
        """The message `reply` makes, encoded in the caller's turn (`Shares.turn`)."""
        caller = _CALLER.get()
        if not caller.limited:  # the agents' reads: no turn to wait for (a hot path)
            return _encode(reply())
        async with self.shares.turn(caller):
            return _encode(reply())

    def load(self) -> ServerLoad:
        """What the server holds now (sizes only: safe from the metrics thread)."""
        from elasticrun.store.metrics import ServerLoad

        return ServerLoad(
            connections=len(self._connections), calls=self._calls_total, watches=self._watches_total,
            engine=self.engine.load(),
        )


@contextlib.asynccontextmanager
async def _held(counter: Counter, caller: Caller, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Hold one of `counter` for `caller`, or refuse the call with RESOURCE_EXHAUSTED."""
    why = counter.take(caller)
    if why is not None:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
    try:
        yield
    finally:
        counter.give_back(caller)


def _encode(reply: pb.RangeReply | pb.MultiGetReply) -> bytes:
    data: bytes = reply.SerializeToString()
    return data


def _host_of(peer: str) -> str:
    """The host of gRPC's peer string ("ipv4:10.0.0.5:41234", "ipv6:[::1]:5000")."""
    address = peer.partition(":")[2]
    return address.rpartition(":")[0].strip("[]") or address


def _check_key_pair(pair: TlsKeyPair) -> None:
    """Refuse a certificate and key that cannot serve TLS, saying which is wrong.

    grpc only fails to bind then (and logs the reason), which reads as a busy port.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load_ca(context, "tls_cert", pair.cert)
    try:
        pair.load_into(context)
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise StoreSettingError(("tls_cert", "tls_key"), "the key does not belong to the certificate") from None
        raise StoreSettingError("tls_key", f"not an unencrypted PEM private key ({_ssl_reason(e)})") from None


def _check_client_ca(client_ca: bytes, tls: TlsKeyPair | None) -> None:
    """Refuse a CA for client certificates that cannot work: without TLS, or no PEM."""
    if tls is None:
        raise StoreSettingError(("client_ca", "tls_cert", "tls_key"), CLIENT_CA_NEEDS_TLS)
    _load_ca(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), "client_ca", client_ca)


def _load_ca(context: ssl.SSLContext, setting: str, pem: bytes) -> None:
    try:
        context.load_verify_locations(cadata=pem.decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError) as e:
        raise StoreSettingError(setting, f"not a PEM certificate ({_ssl_reason(e)})") from None


def _ssl_reason(error: ssl.SSLError | UnicodeDecodeError) -> str:
    if isinstance(error, UnicodeDecodeError):
        return "it is not text"
    return error.reason or str(error)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- error translation ---------------------------------------------------------------


def _status_of(error: ElasticrunError) -> grpc.StatusCode:
    if isinstance(error, StoreLimitError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, LeaseExpiredError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(error, StoreRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, StoreUnavailableError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.FAILED_PRECONDITION


_Handler = Callable[..., Awaitable[_T]]


def _unary(fn: _Handler[_T]) -> _Handler[_T]:
    """Turn our errors raised by a unary handler into a gRPC status with the message."""

    @functools.wraps(fn)
    async def handler(self: object, request: object, context: grpc.aio.ServicerContext) -> _T:
        try:
            return await fn(self, request, context)
        except ElasticrunError as e:
            status, details = _status_of(e), str(e)
        # Aborted outside the except clause: the error's traceback (whose frames hold the
        # request, a 1 MiB value, say) is not chained to the abort that grpc keeps, so a
        # refused request is freed at once rather than by a later garbage collection.
        await context.abort(status, details)
        raise AssertionError("unreachable: abort raises")

    return handler


# --- the etcd-like service -----------------------------------------------------------


def _kv_message(kv: KeyValue) -> pb.KeyValue:
    return pb.KeyValue(
        key=kv.key,
        value=kv.value,
        create_revision=kv.create_revision,
        mod_revision=kv.mod_revision,
        version=kv.version,
        lease=kv.lease,
    )


_EVENT_TYPES = {EventType.PUT: pb.WatchEvent.PUT, EventType.DELETE: pb.WatchEvent.DELETE}


def _pages(kvs: Sequence[KeyValue]) -> Iterator[Sequence[KeyValue]]:
    """`kvs` in reply pages (one, empty, for none), each found when it is asked for:
    the work of each step is that of one page, however many keys there are."""
    start = 0
    while True:
        end, size = start, 0
        while end < len(kvs) and end - start < PAGE_KEYS:
            grown = size + len(kvs[end].key) + len(kvs[end].value)
            if grown > PAGE_BYTES and end > start:
                break
            end, size = end + 1, grown
        yield kvs[start:end]
        if end == len(kvs):
            return
        start = end


def _one_page(kvs: Sequence[KeyValue]) -> bool:
    return len(kvs) <= PAGE_KEYS and len(next(_pages(kvs))) == len(kvs)


def _range_reply(kvs: Sequence[KeyValue], revision: int, hosted_by_agent: bool) -> pb.RangeReply:
    return pb.RangeReply(
        kvs=[_kv_message(kv) for kv in kvs], revision=revision, hosted_by_agent=hosted_by_agent,
        token_unused=_CALLER.get().needless_token,
    )


class _StoreService(pb_grpc.StoreServicer):
    def __init__(self, server: StoreServer) -> None:
        self._server = server
        self._engine = server.engine
        self._confirm = self._reply().SerializeToString()
        #: Encoded watch replies of the latest revision sent, by (key, prefix).
        self._cache: dict[tuple[str, bool], bytes] = {}
        self._cache_revision = 0

    @_unary
    async def Range(self, request: pb.RangeRequest, context: object) -> bytes:
        if request.prefix:
            result = await self._engine.get_prefix(request.key)
            kvs, revision = result.kvs, result.revision
            if not _one_page(kvs):
                raise StoreLimitError(
                    f"the keys under {request.key[:64]!r} are more than one reply page "
                    f"({len(kvs)} keys): read them with RangePages"
                )
        else:
            kv = await self._engine.get(request.key)
            kvs, revision = ((kv,) if kv else ()), self._engine.revision
        return await self._server.encoded(lambda: _range_reply(kvs, revision, self._server.hosted_by_agent))

    async def RangePages(self, request: pb.RangeRequest, context: grpc.aio.ServicerContext) -> None:
        # One snapshot, read at once (its keys are immutable), sent a page at a time:
        # every page says the same revision, and other calls run between the pages.
        try:
            result = await self._engine.get_prefix(request.key)
        except ElasticrunError as e:
            await context.abort(_status_of(e), str(e))
        turn = self._server.shares.turn
        caller = _CALLER.get()
        for page in _pages(result.kvs):
            async with turn(caller):  # the page's write too: its identity's one page in flight
                await context.write(_encode(_range_reply(page, result.revision, self._server.hosted_by_agent)))

    @_unary
    async def Put(self, request: pb.PutRequest, context: object) -> pb.PutReply:
        revision = await self._engine.put(request.key, request.value, lease=request.lease)
        return pb.PutReply(revision=revision)

    @_unary
    async def DeleteRange(
        self, request: pb.DeleteRangeRequest, context: object
    ) -> pb.DeleteRangeReply:
        if request.prefix:
            deleted = await self._engine.delete_prefix(request.key)
        else:
            deleted = int(await self._engine.delete(request.key))
        return pb.DeleteRangeReply(deleted=deleted)

    @_unary
    async def CompareAndPut(
        self, request: pb.CompareAndPutRequest, context: object
    ) -> pb.CompareReply:
        done = await self._engine.compare_and_put(
            request.key,
            request.value,
            expected_mod_revision=request.expected_mod_revision,
            lease=request.lease,
        )
        return pb.CompareReply(succeeded=done)

    @_unary
    async def CompareAndDelete(
        self, request: pb.CompareAndDeleteRequest, context: object
    ) -> pb.CompareReply:
        done = await self._engine.compare_and_delete(
            request.key, expected_mod_revision=request.expected_mod_revision
        )
        return pb.CompareReply(succeeded=done)

    @_unary
    async def LeaseGrant(self, request: pb.LeaseGrantRequest, context: object) -> pb.LeaseGrantReply:
        # Only admin callers reach this (`callers.permits`): the leases are the agents'.
        return pb.LeaseGrantReply(lease=await self._engine.grant_lease(request.ttl_seconds))

    async def LeaseKeepAlive(
        self,
        request_iterator: AsyncIterator[pb.LeaseKeepAliveRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.LeaseKeepAliveReply]:
        async with self._server._long_call(context):
            async for request in request_iterator:
                try:
                    await self._engine.keep_alive(request.lease)
                    ttl = self._engine.lease_ttl(request.lease)
                except LeaseExpiredError:
                    yield pb.LeaseKeepAliveReply(lease=request.lease, expired=True)
                else:
                    yield pb.LeaseKeepAliveReply(lease=request.lease, ttl_seconds=ttl)

    @_unary
    async def LeaseRevoke(
        self, request: pb.LeaseRevokeRequest, context: object
    ) -> pb.LeaseRevokeReply:
        await self._engine.revoke_lease(request.lease)
        return pb.LeaseRevokeReply()

    async def Watch(self, request: pb.WatchRequest, context: grpc.aio.ServicerContext) -> None:
        # Replies go out pre-serialized (the handler has no response serializer): a
        # change seen by 1,000 watchers of one key is encoded once, not 1,000 times.
        write = context.write
        caller = _CALLER.get()
        turn = self._server.shares.turn
        async with self._server.counted_watch(context), self._server._long_call(context):
            await write(self._confirm)
            batches = self._engine.watch_batches(
                request.key, request.start_revision, request.prefix
            )
            cache_key = (request.key, request.prefix)
            try:
                async with contextlib.aclosing(batches):
                    async for batch in batches:
                        if caller.limited:  # its watches take turns with its reads
                            async with turn(caller):
                                await write(self._encoded(cache_key, batch))
                        else:
                            await write(self._encoded(cache_key, batch))
            except CompactedError as e:
                await write(self._reply(compact_revision=e.oldest).SerializeToString())
            except StoreRequestError as e:  # an empty key
                await context.abort(_status_of(e), str(e))

    def _reply(
        self, *, events: Sequence[pb.WatchEvent] = (), compact_revision: int = 0
    ) -> pb.WatchReply:
        """A WatchReply that says which server life it comes from, and what kind of server."""
        return pb.WatchReply(
            store_id=self._engine.history_id,
            hosted_by_agent=self._server.hosted_by_agent,
            events=events,
            compact_revision=compact_revision,
        )

    def _encoded(self, cache_key: tuple[str, bool], batch: list[WatchEvent]) -> bytes:
        """The WatchReply carrying `batch`, encoded once per (revision, key, prefix)."""
        revision = batch[-1].revision
        if revision != self._cache_revision:
            self._cache.clear()
            self._cache_revision = revision
        data = self._cache.get(cache_key)
        if data is None:
            data = self._reply(
                events=[
                    pb.WatchEvent(
                        type=_EVENT_TYPES[e.type], key=e.key, value=e.value, revision=e.revision
                    )
                    for e in batch
                ],
            ).SerializeToString()
            self._cache[cache_key] = data
        return data


class _Capture:
    """Stands in for the server in the generated add_*_to_server: keeps the handlers."""

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(
        self, name: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.name, self.handlers = name, handlers


#: Wraps a call for as long as it runs (`StoreServer.counted_call`).
_Counter = Callable[[grpc.aio.ServicerContext], contextlib.AbstractAsyncContextManager[None]]
#: The same for any call, told the service and method (`StoreServer.counted_call`).
_CallCounter = Callable[[grpc.aio.ServicerContext, str, str], contextlib.AbstractAsyncContextManager[None]]


def _counter_of(count: _CallCounter, service: str, method: str) -> _Counter:
    def counted(context: grpc.aio.ServicerContext) -> contextlib.AbstractAsyncContextManager[None]:
        return count(context, service, method)

    return counted


#: The methods whose handlers encode their replies themselves (they return or write
#: bytes): a reply built once for many watchers, or on a worker thread when large.
_ENCODED_BY_HANDLER: dict[str, dict[str, Callable[[bytes], object]]] = {
    "Store": {
        "Range": pb.RangeRequest.FromString,
        "RangePages": pb.RangeRequest.FromString,
        "Watch": pb.WatchRequest.FromString,
    },
    "C10dStore": {"MultiGet": pb.MultiGetRequest.FromString},
}


#: The methods whose handlers parse their requests themselves (they take bytes), and
#: the most bytes such a request may take (None: the server's limit for any message).
_PARSED_BY_HANDLER: dict[str, dict[str, int | None]] = {
    "Store": {},
    "C10dStore": {
        "Check": MAX_KEY_LIST_BYTES, "Wait": MAX_KEY_LIST_BYTES, "MultiGet": MAX_KEY_LIST_BYTES, "MultiSet": None,
    },
}


def _add_store_service(servicer: _StoreService, server: grpc.aio.Server, count: _CallCounter) -> None:
    capture = _Capture()
    pb_grpc.add_StoreServicer_to_server(servicer, capture)
    _register(server, capture.name, _encoded_by_handler(capture.handlers, "Store"), count)


def _add_c10d_service(servicer: _C10dService, server: grpc.aio.Server, count: _CallCounter) -> None:
    capture = _Capture()
    pb_grpc.add_C10dStoreServicer_to_server(servicer, capture)
    _register(server, capture.name, _encoded_by_handler(capture.handlers, "C10dStore"), count)


def _encoded_by_handler(handlers: dict[str, grpc.RpcMethodHandler], service: str) -> dict[str, grpc.RpcMethodHandler]:
    """The generated handlers, but those of `_ENCODED_BY_HANDLER` with no response
    serializer (their replies go out as the bytes the handler made), and those of
    `_PARSED_BY_HANDLER` with a request deserializer that only bounds the bytes."""
    handlers = dict(handlers)
    for method, parse in _ENCODED_BY_HANDLER[service].items():
        handler = handlers[method]
        make = (
            grpc.unary_stream_rpc_method_handler if handler.response_streaming else grpc.unary_unary_rpc_method_handler
        )
        handlers[method] = make(
            handler.unary_stream if handler.response_streaming else handler.unary_unary,
            request_deserializer=parse,
        )
    for method, limit in _PARSED_BY_HANDLER[service].items():
        handler = handlers[method]
        handlers[method] = grpc.unary_unary_rpc_method_handler(
            handler.unary_unary, request_deserializer=_bytes_within(method, limit),
            response_serializer=handler.response_serializer,
        )
    return handlers


def _bytes_within(method: str, limit: int | None) -> Callable[[bytes], object]:
    """A request deserializer that keeps the bytes (the handler parses them), refusing
    more than `limit` of them unparsed."""

    def take(data: bytes) -> object:
        if limit is not None and len(data) > limit:
            return _Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"a c10d {method} request of {len(data)} bytes is over the store's limit of {limit} bytes "
                f"(at most {MAX_KEYS_PER_CALL} keys a call): name fewer keys, or shorter ones",
            )
        return data

    return take


def _register(
    server: grpc.aio.Server, name: str, handlers: dict[str, grpc.RpcMethodHandler], count: _CallCounter
) -> None:
    service = name.rsplit(".", 1)[-1]
    handlers = {
        method: _guarded(handler, _counter_of(count, service, method))
        for method, handler in handlers.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


# --- requests that do not decode -----------------------------------------------------


class _Refused:
    """A request refused as it was read (its bytes did not decode: INVALID_ARGUMENT, or
    there were too many of them); its handler answers `code` with `why`."""

    __slots__ = ("code", "why")

    def __init__(self, code: grpc.StatusCode, why: str) -> None:
        self.code, self.why = code, why


def _tolerant(deserialize: Callable[[bytes], object]) -> Callable[[bytes], object]:
    def parse(data: bytes) -> object:
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError: corrupt wire format, a string not UTF-8
            return _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {str(e) or type(e).__name__}")

    return parse


async def _refuse(request: _Refused, context: grpc.aio.ServicerContext) -> None:
    await context.abort(request.code, request.why)


def _guarded(handler: grpc.RpcMethodHandler, count: _Counter) -> grpc.RpcMethodHandler:
    """The same method, served so that nothing is spent on a call before its caller is
    known: the call is attributed to its caller from its headers (`count`, which
    refuses a caller that may not make it and counts the call against its share while
    it runs), and only then is its request message read, within `MESSAGE_DEADLINE`.

    gRPC reads a unary call's message before it runs the handler, and counts the call
    against the server's limit from its headers: a client that opens calls and never
    sends their message held a slot each, with no token (issue 36). So every method is
    registered as a bidirectional stream, which gRPC hands to its handler at once with
    the messages still unread; on the wire a unary call and a stream that carries one
    message each way are the same, so clients see no difference. A request that does
    not decode gets INVALID_ARGUMENT (grpc itself would answer UNKNOWN and log a
    traceback for each: a log flood on demand)."""
    parse = _tolerant(handler.request_deserializer)
    if handler.request_streaming:
        if not handler.response_streaming:
            raise TypeError("no client-streaming method is served")
        inner_ss = handler.stream_stream

        async def checked(requests: AsyncIterator[object], context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
            async for request in requests:
                if isinstance(request, _Refused):
                    await _refuse(request, context)
                yield request

        async def streams(requests: AsyncIterator[object], context: grpc.aio.ServicerContext) -> None:
            async with count(context):
                async for reply in inner_ss(checked(requests, context), context):
                    await context.write(reply)

        return grpc.stream_stream_rpc_method_handler(streams, parse, handler.response_serializer)
    inner = handler.unary_stream if handler.response_streaming else handler.unary_unary
    writes_itself = handler.response_streaming and not inspect.isasyncgenfunction(inner)

    async def one(requests: AsyncIterator[object], context: grpc.aio.ServicerContext) -> None:
        async with count(context):
            request = await _message(context)
            if writes_itself:  # a stream whose handler writes its replies (context.write)
                await inner(request, context)
            elif handler.response_streaming:
                async for reply in inner(request, context):
                    await context.write(reply)
            else:
                await context.write(await inner(request, context))

    return grpc.stream_stream_rpc_method_handler(one, parse, handler.response_serializer)


async def _message(context: grpc.aio.ServicerContext) -> object:
    """The call's one request message, once its caller is known; a call whose message
    does not come within `MESSAGE_DEADLINE` of its headers is ended (DEADLINE_EXCEEDED),
    so that a caller cannot hold its calls open without sending anything."""
    try:
        async with asyncio.timeout(MESSAGE_DEADLINE):
            # read, not the request iterator: its generator would keep the message
            # (up to a MiB) alive for as long as the call's state lives
            request = await context.read()
    except TimeoutError:
        await context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the call's request did not arrive within {MESSAGE_DEADLINE:g} s of its headers",
        )
    if request is grpc.aio.EOF:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request message")
    if isinstance(request, _Refused):
        await _refuse(request, context)
    return request


# --- the c10d operations -------------------------------------------------------------


class _C10dService(pb_grpc.C10dStoreServicer):
    """torch.distributed.Store semantics over the engine.

    Engine calls never suspend, so a read followed by a write with no other await in
    between (add, compare_set) is atomic, as TCPStore's single-threaded daemon is.
    Values of `add` are decimal ASCII, as TCPStore stores them.

    An admin caller's keys are the engine's own. A worker's are its job's (`_Keys`):
    each key it names lives under `/elasticrun/<job>/w/`, `num_keys` counts those only,
    and its writes keep to the server's quota for worker credentials.
    """

    def __init__(self, server: StoreServer) -> None:
        self._server = server
        self._engine = server.engine

    def _keys(self) -> _Keys:
        grant = _CALLER.get().grant
        if grant.role is Role.WORKER:
            return _Keys(worker_prefix(grant.job), self._server.quota, grant.job)
        return _Keys()

    async def _await_key(self, key: str) -> None:
        if await self._engine.get(key) is not None:
            return
        watch = self._engine.watch(key, start_revision=self._engine.revision + 1)
        async with contextlib.aclosing(watch):
            async for event in watch:
                if event.type is EventType.PUT:
                    return

    @contextlib.asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        """The caller's turn (`Shares.turn`; admin: at once) for a step whose work grows
        with a key list: one such step of an identity's at a time, and after each, a
        pause in its turn so that its steps take at most KEY_LIST_LOOP_SHARE of the
        loop's time, however many of its calls wait. (A step is a few milliseconds; a
        put takes a few passes of the loop, so steps back to back would delay each of
        them by one.)"""
        caller = _CALLER.get()
        async with self._server.shares.turn(caller):
            start = time.perf_counter()
            yield
            if caller.limited:
                await asyncio.sleep((time.perf_counter() - start) * (1 / KEY_LIST_LOOP_SHARE - 1))

    def _key_list(self, names: list[str], what: str) -> list[str]:
        """The engine's keys for the c10d keys `names`, each once, in first-named order;
        a list longer than MAX_KEYS_PER_CALL is refused. (C loops only: a list of
        10,000 keys takes about a millisecond.)"""
        if len(names) > MAX_KEYS_PER_CALL:
            raise StoreLimitError(
                f"a c10d {what} may name at most {MAX_KEYS_PER_CALL} keys, this one names {len(names)}: "
                "ask for them in smaller batches"
            )
        unique = list(dict.fromkeys(names))
        if "" in unique:
            raise StoreRequestError("a key must not be empty")
        return self._keys().all_of(unique)

    async def _await_keys(
        self, keys: list[str], timeout: float, context: grpc.aio.ServicerContext, *, in_turn: bool = True
    ) -> list[KeyValue] | None:
        """The keys' entries once they all exist, None past `timeout` (0: no limit).
        Each look at them all is one pass with no suspension (a consistent snapshot),
        in the caller's turn when `in_turn`."""
        async with self._server._long_call(context):
            try:
                async with asyncio.timeout(timeout if timeout > 0 else None):
                    while True:
                        async with self._turn() if in_turn else contextlib.nullcontext():
                            kvs = self._engine.entries(keys)
                        if all(kvs):  # no None
                            return cast("list[KeyValue]", kvs)
                        for key, kv in zip(keys, kvs, strict=True):
                            if kv is None:
                                await self._await_key(key)
            except TimeoutError:
                return None

    @_unary
    async def Set(self, request: pb.SetRequest, context: object) -> pb.SetReply:
        keys = self._keys()
        await self._engine.put(keys.of(request.key), request.value, quota=keys.quota)
        return pb.SetReply()

    @_unary
    async def Get(
        self, request: pb.GetRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetReply:
        key = self._keys().of(request.key)
        kvs = await self._await_keys([key], request.timeout_seconds, context, in_turn=False)
        if kvs is None:
            return pb.GetReply(timed_out=True)
        return pb.GetReply(value=kvs[0].value)

    @_unary
    async def Add(self, request: pb.AddRequest, context: object) -> pb.AddReply:
        keys = self._keys()
        kv = await self._engine.get(keys.of(request.key))
        try:
            value = (int(kv.value) if kv else 0) + request.amount
        except ValueError:
            raise StoreRequestError(
                f"cannot add to key {request.key!r}: its value is not an integer"
            ) from None
        if not -(1 << 63) <= value < (1 << 63):
            raise StoreRequestError(
                f"cannot add {request.amount} to key {request.key!r}: the sum leaves the "
                "64-bit integer range"
            )
        await self._engine.put(keys.of(request.key), str(value).encode(), quota=keys.quota)
        return pb.AddReply(value=value)

    @_unary
    async def CompareSet(
        self, request: pb.CompareSetRequest, context: object
    ) -> pb.CompareSetReply:
        keys = self._keys()
        key = keys.of(request.key)
        kv = await self._engine.get(key)
        if kv is None:
            if request.expected:
                return pb.CompareSetReply(value=request.expected)  # as TCPStore does
            await self._engine.put(key, request.desired, quota=keys.quota)
            return pb.CompareSetReply(value=request.desired)
        if kv.value == request.expected:
            await self._engine.put(key, request.desired, quota=keys.quota)
            return pb.CompareSetReply(value=request.desired)
        return pb.CompareSetReply(value=kv.value)

    @_unary
    async def Wait(self, data: bytes, context: grpc.aio.ServicerContext) -> pb.WaitReply:
        async with self._turn():
            request = _parse(pb.WaitRequest, data)
            keys = self._key_list(list(request.keys), "wait")
        kvs = await self._await_keys(keys, request.timeout_seconds, context)
        return pb.WaitReply(timed_out=kvs is None)

    @_unary
    async def Check(self, data: bytes, context: object) -> pb.CheckReply:
        async with self._turn():
            keys = self._key_list(list(_parse(pb.CheckRequest, data).keys), "check")
            return pb.CheckReply(ready=all(self._engine.entries(keys)))

    @_unary
    async def NumKeys(self, request: pb.NumKeysRequest, context: object) -> pb.NumKeysReply:
        job = self._keys().job
        return pb.NumKeysReply(count=len(self._engine) if job is None else self._engine.worker_keys(job))

    @_unary
    async def DeleteKey(
        self, request: pb.DeleteKeyRequest, context: object
    ) -> pb.DeleteKeyReply:
        return pb.DeleteKeyReply(deleted=await self._engine.delete(self._keys().of(request.key)))

    @_unary
    async def MultiGet(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async with self._turn():
            request = _parse(pb.MultiGetRequest, data)
            names = list(request.keys)
            keys = self._key_list(names, "multi_get")
        found = await self._await_keys(keys, request.timeout_seconds, context)
        if found is None:
            return _encode(pb.MultiGetReply(timed_out=True))
        async with self._turn():
            by_name = dict(zip(dict.fromkeys(names), map(_value_of, found), strict=True))
            values = list(map(by_name.__getitem__, names))
            size = sum(map(len, values))
        if size > MAX_MULTI_GET_BYTES:
            raise StoreLimitError(
                f"multi_get of {len(values)} keys would reply {size} bytes, over the store's "
                f"limit of {MAX_MULTI_GET_BYTES} bytes per multi_get: get them in smaller batches"
            )
        return await self._server.encoded(lambda: pb.MultiGetReply(values=values))

    @_unary
    async def MultiSet(self, data: bytes, context: object) -> pb.MultiSetReply:
        async with self._turn():
            request = _parse(pb.MultiSetRequest, data)
            if len(request.keys) != len(request.values):
                raise StoreRequestError(
                    f"multi_set got {len(request.keys)} keys but {len(request.values)} values"
                )
            if len(request.keys) > MAX_MULTI_SET_KEYS:
                raise StoreLimitError(
                    f"a c10d multi_set may write at most {MAX_MULTI_SET_KEYS} keys, this one "
                    f"{len(request.keys)}: set them in smaller batches"
                )
            keys = self._keys()
            items = [(keys.of(k), v) for k, v in zip(request.keys, request.values, strict=True)]
            await self._engine.put_all(items, quota=keys.quota)
        return pb.MultiSetReply()


_value_of = operator.attrgetter("value")

_M = TypeVar("_M", pb.CheckRequest, pb.WaitRequest, pb.MultiGetRequest, pb.MultiSetRequest)


def _parse(kind: type[_M], data: bytes) -> _M:
    """A request its handler parses itself (`_PARSED_BY_HANDLER`)."""
    try:
        request: _M = kind.FromString(data)
    except Exception as e:  # DecodeError: corrupt wire format, a string not UTF-8
        raise StoreRequestError(f"malformed request: {str(e) or type(e).__name__}") from None
    return request


@dataclass(frozen=True, slots=True)
class _Keys:
    """Where a c10d caller's keys live: the engine's own (admin), or a job's worker
    namespace (`prefix`), with the quota its writes keep to."""

    prefix: str = ""
    quota: SpaceQuota | None = None
    #: the job of a worker, None for admin
    job: str | None = None

    def of(self, key: str) -> str:
        # An empty key stays empty, for the engine to refuse as it refuses any.
        return self.prefix + key if key else key

    def all_of(self, keys: list[str]) -> list[str]:
        """`of` for each of `keys`, which are not empty."""
        return list(map(self.prefix.__add__, keys)) if self.prefix else keys
