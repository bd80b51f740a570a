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
handler runs (`store/server/callers.py`): a call its role may not make gets PERMISSION_DENIED,
one past its identity's fair share RESOURCE_EXHAUSTED; all of that from the call's headers,
before its message is read (`store/server/admission.py`), and the message must come within
`MESSAGE_DEADLINE`. A worker's c10d keys live in its
job's own namespace (`/elasticrun/<job>/w/`), so a torch process group runs unchanged
and sees nothing else. State lives in memory and is never pickled.

No request holds the loop for long: a prefix read goes out in pages (`RangePages`), and
a caller other than admin has one reply in the making at a time (`Shares.turn`). Why on
the loop, not on a thread: docs/architecture.md, Design notes, "The store server's loop".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, cast

import grpc

from elasticrun.descriptors import soft_limit
from elasticrun.errors import (
    StoreAddressError,
    StoreSettingError,
    StoreUnavailableError,
)
from elasticrun.proto import store_pb2 as pb
from elasticrun.store.credentials import (
    JOBS_PREFIX,
    ROUND_RECORD,
    RUN_RECORD,
    Grant,
    run_is_on,
    run_of_launch,
    worker_prefix,
)
from elasticrun.store.server.admission import CALLER, add_c10d_service, add_store_service, encode
from elasticrun.store.server.c10d_service import C10dService
from elasticrun.store.server.callers import (
    DEFAULT_FAIR_SHARE,
    Caller,
    Counter,
    FairShare,
    Shares,
    identify,
    permits,
    refusal,
)
from elasticrun.store.server.connections import SWEEP_EVERY, Connections
from elasticrun.store.server.kv_service import StoreService
from elasticrun.store.server.limits import (
    DEFAULT_MAX_CALLS,
    DEFAULT_STOP_GRACE,
    SERVER_OPTIONS,
    connection_cap,
)
from elasticrun.store.server.memory import MemoryStore, SpaceQuota
from elasticrun.store.wire import (
    BEARER_PREFIX,
    CLIENT_CA_NEEDS_TLS,
    REQUEST_SLACK_BYTES,
    TOKEN_ENV,
    TOKEN_METADATA_KEY,
    TlsKeyPair,
)

if TYPE_CHECKING:  # imported by `store serve` and the launcher only when metrics are asked for
    from elasticrun.store.server.metrics import ServerLoad, StoreMetrics

logger = logging.getLogger(__name__)


class StoreServer:
    """The gRPC store server, run in the caller's event loop.

    - `engine`: served, and left open on stop so that a new server can serve the same
      history; without one, a `MemoryStore` of its own, closed on stop.
    - `hosted_by_agent`: this server lives and dies with a launcher agent, which every
      watch reply tells the clients: a refused connection then means its records are
      gone, so they stop waiting for it at once (the rendezvous then waits
      `store_host_grace` for a new store at the endpoint).
    - `max_calls`: the calls in progress from all clients; `fair_share`: what each
      identity other than admin may take of them, of watches and of the engine's keys and
      bytes, and what all those identities may take together.
    - `token`: the admin token (worker and reader credentials are derived from it).
    - `client_ca` (PEM, with `tls` only): every connection must present a client
      certificate that chains to it.
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
        #: which connections it keeps (known once it listens)
        self.connections: Connections | None = None
        self._sweeping: asyncio.Task[None] | None = None

    @property
    def endpoint(self) -> str:
        """`host:port` as clients dial it (the bound port once started)."""
        return _host_port(self.host, self.port or self._requested_port)

    async def start(self) -> None:
        """Listen on host:port (port 0: any free port, then see `port`)."""
        max_request = self.engine.max_key_bytes + self.engine.max_value_bytes
        cap = connection_cap(soft_limit())
        server = grpc.aio.server(
            maximum_concurrent_rpcs=self.max_calls,
            options=[
                *SERVER_OPTIONS,
                ("grpc.max_receive_message_length", max_request + REQUEST_SLACK_BYTES),
                ("grpc.max_allowed_incoming_connections", cap),
            ],
        )
        add_store_service(StoreService(self), server, self.counted_call)
        add_c10d_service(C10dService(self), server, self.counted_call)
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
        self.connections = Connections(self.port, cap)
        self._sweeping = asyncio.create_task(self._sweep(self.connections), name="store-connections")
        self._sweeping.add_done_callback(_said_if_failed)
        if self.metrics is not None:  # once it serves: an agent that hosts nothing exports no store metric
            self.metrics.serving(self.load)
        logger.debug(
            "store serving on %s (%s, %s)",
            self.endpoint,
            ("mutual TLS" if self._client_ca else "TLS") if self._tls else "plaintext",
            "token required" if self._token else "no token",
        )

    async def _sweep(self, connections: Connections) -> None:
        """Keep the reserve of the connection cap free for authenticated callers, for as long as it serves."""
        while True:
            await asyncio.sleep(SWEEP_EVERY)
            try:
                connections.sweep()
            except OSError as e:  # never the end of the store: the next sweep tries again
                logger.warning("the store could not count its connections: %s", e)

    async def stop(self, grace: float = DEFAULT_STOP_GRACE) -> None:
        """Stop: end watches and waits at once (clients resume), let calls finish."""
        if self._server is None:
            return
        self._stopping = True
        if self._sweeping is not None:
            self._sweeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeping
            self._sweeping = None
        if self.connections is not None:
            self.connections.close()
        for task in list(self._streams):
            task.cancel()
        await self._server.stop(grace)
        self._server = None
        if self._owns_engine:
            await self.engine.close()
        logger.debug("store on %s stopped", self.endpoint)

    @contextlib.asynccontextmanager
    async def long_call(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
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
        """Attribute the call to its caller, and count it while it runs and (with metrics) once it ends.

        The call is refused if the caller may not make it; it counts against the
        caller's share for as long as it runs, and in the metrics by its status code."""
        code = "OK"
        try:
            peer = context.peer()
            caller = await self._caller(context, service, method, peer)
            CALLER.set(caller)
            why = self.shares.calls.take(caller)
            if why is not None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
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

    async def _caller(self, context: grpc.aio.ServicerContext, service: str, method: str, peer: str) -> Caller:
        """Who makes this call, from `peer`.

        The call is refused (UNAUTHENTICATED, PERMISSION_DENIED) when its credential is
        wrong or its role may not make it; without a valid credential, its connection is
        shut too, once the refusal is sent (`Connections.refused`)."""
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
            host=_host_of(peer),
        )
        if caller is None:
            try:
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"missing or wrong store token (set it with --token-file or {TOKEN_ENV})",
                )
            finally:
                if self.connections is not None:
                    self.connections.refused(peer)
            raise AssertionError("unreachable: abort raises")
        if self.connections is not None:
            self.connections.authenticated(peer)
        if caller.grant.run:
            why = await self._check_run(caller.grant)
            if why is not None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        if not permits(caller.grant, service, method):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal(caller.grant, service, method))
        return caller

    async def _check_run(self, grant: Grant) -> str | None:
        """Why a worker credential of one run of a job is refused, or None.

        It is when that run is not the job's current one, or the job does not run (it
        ended: `stop`, or its workers' end; or no round has begun). The first call of a run that
        this server sees deletes the job's worker keys that earlier runs left (a job
        that ended without closing, agents killed, keys written after the close)."""
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
        round_kv = await self.engine.get(f"{JOBS_PREFIX}{grant.job}/{ROUND_RECORD}")
        if not run_is_on(round_kv.value if round_kv is not None else None):
            return f"this worker credential is of a run of job {grant.job!r} that has ended (or not begun)"
        if self._runs.get(grant.job) != grant.run:
            await self.engine.delete_prefix(worker_prefix(grant.job))
            self._runs[grant.job] = grant.run
        return None

    @contextlib.asynccontextmanager
    async def counted_watch(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Count a watch against its caller's share for as long as it runs."""
        async with _held(self.shares.watches, CALLER.get(), context):
            self._watches_total += 1
            try:
                yield
            finally:
                self._watches_total -= 1

    async def encoded(self, reply: Callable[[], pb.RangeReply | pb.MultiGetReply]) -> bytes:
        """The message `reply` makes, encoded in the caller's turn (`Shares.turn`)."""
        caller = CALLER.get()
        if not caller.limited:  # the agents' reads: no turn to wait for (a hot path)
            return encode(reply())
        async with self.shares.turn(caller):
            return encode(reply())

    def load(self) -> ServerLoad:
        """What the server holds now (sizes only: safe from the metrics thread)."""
        from elasticrun.store.server.metrics import ServerLoad

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


def _said_if_failed(task: asyncio.Task[None]) -> None:
    """Say at once that the store stopped keeping room for authenticated callers (a bug).

    It serves on: only its connection cap is blind from then on, as before the reserve."""
    if not task.cancelled() and task.exception() is not None:
        logger.error(
            "the store stopped keeping room for agents in its connection cap: %r; it serves on, "
            "its cap blind to who connects", task.exception(),
        )


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
