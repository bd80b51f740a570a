"""The etcd v3 backend of the Store interface (`--rdzv-backend=etcd`).

It speaks the etcd v3 gRPC API through the generated stubs that `etcd-sdk-python`
(`pyetcd`) ships. We do not use pyetcd's client object: it authenticates once, on one
endpoint, at construction, never renews an expired token, leaves retries to the caller,
and replaces gRPC errors with detail-less exceptions. What this module adds instead:

- failover: an operation that finds its endpoint unavailable moves on to the next one,
  until the store's `timeout` runs out (then StoreUnavailableError naming every endpoint
  and what each said);
- auth: a token per user, fetched lazily and fetched again when a member no longer
  knows it (simple tokens live in each member's memory and expire when idle);
- one table (`_ERROR_TABLE`) that turns gRPC statuses into our errors;
- the one blocking gRPC call (authenticating) runs on the store's own threads, so the
  event loop never waits on etcd, and an etcd outage cannot starve the loop's default
  executor (which asyncio also uses for DNS lookups); the pauses between retries are
  taken on the loop, never on those few threads;
- unary calls as grpc futures awaited on the loop: no thread is held per call in
  flight, so hundreds of nodes sharing one client do not queue behind a few threads;
- lease keep-alives: one long-lived LeaseKeepAlive stream per lease (grpc.aio, on the
  store's loop, no thread), a renewal being one message on it; a stream per lease, not
  one shared, because etcd answers a stream's requests in order and holds the renewal
  of an expired lease until its revocation is through raft: on a shared stream one
  expired lease would stall every other lease's renewal behind it. A broken stream is
  re-opened through the same failover;
- watches: one grpc.aio stream per watch, read on the loop (no thread), and
  re-created from the next undelivered revision on another endpoint when it breaks.

Its settings (TLS material, user and password) come read and checked from
`elasticrun.store.access`; the password never appears in a message.

Leases: etcd counts TTLs in whole seconds (`grant_lease` rounds up) and raises any TTL
below its minimum, 1.5 election timeouts rounded up to a second (2 s with etcd's
default flags), to that minimum. A new raft leader also extends every lease by its TTL.
"""

from __future__ import annotations

import asyncio
import enum
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypeVar

import grpc
import grpc.aio
from pyetcd import etcdrpc
from pyetcd.etcdrpc import kv_pb2

from elasticrun.errors import (
    CompactedError,
    LeaseExpiredError,
    StoreAuthError,
    StoreError,
    StoreLimitError,
    StorePermissionError,
    StoreRequestError,
    StoreSettingError,
    StoreUnavailableError,
)
from elasticrun.store.api import (
    EventType,
    KeyValue,
    RangeResult,
    Store,
    WatchEvent,
    check_lease_ttl,
)
from elasticrun.store.channel import plain_cause
from elasticrun.store.wire import DEFAULT_ETCD_PORT, DEFAULT_TIMEOUT, TlsKeyPair

_T = TypeVar("_T")

_Metadata = tuple[tuple[str, str], ...]
_Rpc = Callable[["_Stubs", float, _Metadata], _T]
_FutureRpc = Callable[["_Stubs", float, _Metadata], grpc.Future]
_AioStream: TypeAlias = "grpc.aio.StreamStreamCall"

_CHANNEL_OPTIONS = (
    # Pings find a member that vanished without closing the connection (a partition).
    # etcd refuses pings more frequent than every 5 s by default.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # A restarted member must become usable again within a second, not minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
)
#: etcd closes a watch stream whose member lost its leader when this is set, instead of
#: leaving it silent; the watch then resumes on a member that has one.
_REQUIRE_LEADER: _Metadata = (("hasleader", "true"),)
_RETRY_PAUSE_FIRST = 0.05
_RETRY_PAUSE_MAX = 0.5
#: A request a follower forwarded to a leader that just died is never answered: etcd
#: only gives up on it after 5 s. So the first try of an operation is cut short, and
#: each try that runs out doubles the next one, for a slow but healthy cluster.
_FIRST_ATTEMPT_TIMEOUT = 1.0


# --- errors ---------------------------------------------------------------------------


class _Kind(enum.Enum):
    TRANSIENT = "try another endpoint"
    TOKEN_EXPIRED = "authenticate again"
    AUTH_REQUIRED = "credentials missing"
    AUTH_FAILED = "credentials refused"
    AUTH_DISABLED = "credentials given to an etcd without auth"
    PERMISSION = "the user's roles do not allow it"
    TLS = "TLS handshake failed"
    NOT_ETCD = "not an etcd v3 server"
    LEASE_GONE = "lease not found"
    LIMIT = "over a limit"
    REQUEST = "a malformed request"
    OTHER = "other"


#: (status code, text in the details or "" for any, kind): the first match wins.
_ERROR_TABLE: tuple[tuple[grpc.StatusCode, str, _Kind], ...] = (
    (grpc.StatusCode.UNAVAILABLE, "http1", _Kind.NOT_ETCD),
    (grpc.StatusCode.UNAVAILABLE, "failed parsing http/2", _Kind.NOT_ETCD),
    (grpc.StatusCode.UNAVAILABLE, "ssl", _Kind.TLS),
    (grpc.StatusCode.UNAVAILABLE, "handshake", _Kind.TLS),
    (grpc.StatusCode.UNAVAILABLE, "certificate", _Kind.TLS),
    (grpc.StatusCode.UNAVAILABLE, "tsi_", _Kind.TLS),  # e.g. our client certificate refused
    (grpc.StatusCode.UNAVAILABLE, "", _Kind.TRANSIENT),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "", _Kind.TRANSIENT),
    # Our deadline, as seen (and reported first) by the etcd server.
    (grpc.StatusCode.UNKNOWN, "context deadline exceeded", _Kind.TRANSIENT),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "too many requests", _Kind.TRANSIENT),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "", _Kind.LIMIT),
    (grpc.StatusCode.UNAUTHENTICATED, "invalid auth token", _Kind.TOKEN_EXPIRED),
    (grpc.StatusCode.INVALID_ARGUMENT, "revision of auth store is old", _Kind.TOKEN_EXPIRED),
    (grpc.StatusCode.INVALID_ARGUMENT, "user name is empty", _Kind.AUTH_REQUIRED),
    (grpc.StatusCode.INVALID_ARGUMENT, "authentication failed", _Kind.AUTH_FAILED),
    (grpc.StatusCode.INVALID_ARGUMENT, "too large", _Kind.LIMIT),
    (grpc.StatusCode.INVALID_ARGUMENT, "too many operations", _Kind.LIMIT),
    (grpc.StatusCode.INVALID_ARGUMENT, "key is not provided", _Kind.REQUEST),
    (grpc.StatusCode.UNAUTHENTICATED, "", _Kind.AUTH_FAILED),
    (grpc.StatusCode.PERMISSION_DENIED, "", _Kind.PERMISSION),
    (grpc.StatusCode.FAILED_PRECONDITION, "authentication is not enabled", _Kind.AUTH_DISABLED),
    (grpc.StatusCode.NOT_FOUND, "lease not found", _Kind.LEASE_GONE),
    (grpc.StatusCode.UNIMPLEMENTED, "", _Kind.NOT_ETCD),
)


#: Failures of one member's setup: the others may be fine, so fail over; give up at once
#: only when every endpoint failed this way.
_WRONG_ENDPOINT = frozenset({_Kind.TLS, _Kind.NOT_ETCD})


def _classify(code: grpc.StatusCode, details: str) -> _Kind:
    text = details.lower()
    for table_code, needle, kind in _ERROR_TABLE:
        if code == table_code and needle in text:
            return kind
    return _Kind.OTHER


class _StreamFailure(grpc.RpcError):
    """A shared stream's end (or its silence), as the status its waiters see."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.status, self.text = code, details


def _rpc_facts(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, _StreamFailure):
        return exc.status, exc.text
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or ""
    # Every RpcError grpc raises from a call is also a grpc.Call carrying these.
    if isinstance(exc, grpc.Call):
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.UNKNOWN, str(exc)


def _store_error(
    kind: _Kind, details: str, endpoint: str, *, user: str | None, lease: int
) -> StoreError:
    """The error a user sees for a final (not retried) failure at `endpoint`."""
    conf = "--rdzv-conf"
    if kind is _Kind.TLS:
        return StoreAuthError(
            f"TLS handshake with etcd at {endpoint} failed ({details}): check ca_cert, "
            f"client_cert and client_key in {conf} against the etcd server's certificates"
        )
    if kind is _Kind.NOT_ETCD:
        return StoreError(
            f"{endpoint} is not an etcd v3 server ({details}): --rdzv-backend=etcd needs "
            f"etcd >= 3.4 and --rdzv-endpoint naming its client port (usually {DEFAULT_ETCD_PORT})"
        )
    if kind is _Kind.AUTH_REQUIRED:
        return StoreAuthError(
            f"etcd at {endpoint} requires authentication: set user and password_file "
            f"or password_env in {conf}"
        )
    if kind in (_Kind.AUTH_FAILED, _Kind.TOKEN_EXPIRED):
        who = f"user {user!r}" if user is not None else "an anonymous client"
        return StoreAuthError(
            f"etcd at {endpoint} refused {who} ({details}): check user and "
            f"password_file/password_env in {conf} and the user's role on the key prefix"
        )
    if kind is _Kind.PERMISSION:
        who = f"user {user!r}" if user is not None else "an anonymous client"
        return StorePermissionError(
            f"etcd at {endpoint} refused {who} the request ({details}): its roles do not allow it "
            "(`elasticrun store etcd-roles` sets up the admin and reader roles)"
        )
    if kind is _Kind.AUTH_DISABLED:
        return StoreAuthError(
            f"etcd at {endpoint} has authentication disabled but {conf} sets user "
            f"{user!r}: remove user and password_file/password_env, or enable auth on etcd"
        )
    if kind is _Kind.LEASE_GONE:
        return LeaseExpiredError(lease)
    if kind is _Kind.LIMIT:
        return StoreLimitError(f"etcd at {endpoint} refused a request over a limit: {details}")
    if kind is _Kind.REQUEST:
        return StoreRequestError(f"etcd at {endpoint} refused the request: {details}")
    return StoreError(f"etcd at {endpoint} failed: {details}")


# --- the blocking side ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Stubs:
    """The etcd services on one endpoint's channel."""

    endpoint: str
    channel: grpc.Channel
    kv: etcdrpc.KVStub
    lease: etcdrpc.LeaseStub
    watch: etcdrpc.WatchStub
    auth: etcdrpc.AuthStub

    @classmethod
    def open(cls, endpoint: str, credentials: grpc.ChannelCredentials | None) -> _Stubs:
        if credentials is None:
            channel = grpc.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
        else:
            channel = grpc.secure_channel(endpoint, credentials, options=_CHANNEL_OPTIONS)
        return cls(
            endpoint,
            channel,
            etcdrpc.KVStub(channel),
            etcdrpc.LeaseStub(channel),
            etcdrpc.WatchStub(channel),
            etcdrpc.AuthStub(channel),
        )


@dataclass(slots=True)
class _Attempts:
    """One operation's tries: its deadline, why each endpoint failed, the next pause."""

    endpoint_list: str
    endpoint_count: int
    deadline: float
    tls: bool
    causes: dict[str, str] = field(default_factory=dict)
    in_a_row: int = 0
    pause: float = _RETRY_PAUSE_FIRST
    attempt_timeout: float = _FIRST_ATTEMPT_TIMEOUT
    renewed_token: bool = False
    #: the error of each endpoint found to be no (usable) etcd server
    wrong: dict[str, StoreError] = field(default_factory=dict)

    def next_timeout(self) -> float:
        """The deadline of the next try, or StoreUnavailableError when time is up."""
        return min(self._remaining(), self.attempt_timeout)

    def _remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            cause = "; ".join(f"{ep}: {why}" for ep, why in self.causes.items())
            if not self.tls and "socket closed" in cause.lower():
                # What a plain client sees of a server that wants TLS.
                cause += " (if etcd serves clients over TLS, set ca_cert in --rdzv-conf)"
            raise StoreUnavailableError(self.endpoint_list, cause or "timed out")
        return left

    def failed(self, endpoint: str, details: str, *, timed_out: bool) -> float:
        """Note the failure; the pause before the next try: once every endpoint failed
        in a row (bounded, growing), else none."""
        self.causes[endpoint] = plain_cause(details)
        if timed_out:
            self.attempt_timeout *= 2
        self.in_a_row += 1
        if self.in_a_row % self.endpoint_count:
            return 0.0
        pause = max(0.0, min(self.pause, self.deadline - time.monotonic()))
        self.pause = min(self.pause * 2, _RETRY_PAUSE_MAX)
        return pause


class _Cluster:
    """Blocking, thread-safe access to the etcd members: failover, auth, error mapping."""

    def __init__(
        self,
        endpoints: Sequence[str],
        credentials: grpc.ChannelCredentials | None,
        user: str | None,
        password: str | None,
        timeout: float,
    ) -> None:
        self.endpoint_list = ",".join(endpoints)
        self.timeout = timeout
        self.user = user
        self._password = password
        self._stubs = [_Stubs.open(ep, credentials) for ep in endpoints]
        self._tls = credentials is not None
        self._lock = threading.Lock()
        self._current = 0
        self._token: str | None = None
        self.credentials = credentials

    def attempts(self, first_timeout: float = _FIRST_ATTEMPT_TIMEOUT) -> _Attempts:
        deadline = time.monotonic() + self.timeout
        return _Attempts(
            self.endpoint_list, len(self._stubs), deadline, self._tls, attempt_timeout=first_timeout
        )

    def current(self) -> _Stubs:
        return self._stubs[self._current]

    def call(self, rpc: _Rpc[_T], *, lease: int = 0) -> _T:
        """Run `rpc` on the current endpoint, failing over until the deadline."""
        attempts = self.attempts()
        while True:
            timeout = attempts.next_timeout()
            stubs = self.current()
            try:
                return rpc(stubs, timeout, self.metadata(stubs, timeout))
            except grpc.RpcError as exc:
                code, details = _rpc_facts(exc)
                time.sleep(self.recover(stubs, code, details, attempts, lease=lease))

    def recover(
        self,
        stubs: _Stubs,
        code: grpc.StatusCode,
        details: str,
        attempts: _Attempts,
        *,
        lease: int = 0,
    ) -> float:
        """Get ready for the next attempt after a failure on `stubs`, or raise; returns
        how long to pause first. It never blocks: the async callers pause on their
        loop, since a pause on the store's few threads queued every other operation's
        recovery behind it (10,000 nodes' keep-alives timing out at once waited for
        minutes there, and their leases lapsed)."""
        kind = _classify(code, details)
        if kind in _WRONG_ENDPOINT:
            attempts.wrong[stubs.endpoint] = self.error(kind, details, stubs.endpoint)
            if len(attempts.wrong) == attempts.endpoint_count:
                raise next(iter(attempts.wrong.values()))
        if kind is _Kind.TRANSIENT or kind in _WRONG_ENDPOINT:
            self._fail_over(stubs)
            return attempts.failed(
                stubs.endpoint, details, timed_out=code != grpc.StatusCode.UNAVAILABLE
            )
        if kind is _Kind.TOKEN_EXPIRED and self.user is not None and not attempts.renewed_token:
            attempts.renewed_token = True
            self._token = None
            return 0.0
        raise self.error(kind, details, stubs.endpoint, lease=lease)

    def known_metadata(self) -> _Metadata | None:
        """The token header without authenticating: None when a token must be fetched."""
        if self.user is None:
            return ()
        token = self._token
        return None if token is None else (("token", token),)

    def metadata(self, stubs: _Stubs, timeout: float) -> _Metadata:
        """The token header, authenticating on `stubs` first when there is none."""
        if self.user is None:
            return ()
        token = self._token
        if token is None:
            request = etcdrpc.AuthenticateRequest(name=self.user, password=self._password)
            token = stubs.auth.Authenticate(request, timeout=timeout).token
            self._token = token
        return (("token", token),)

    def error(self, kind: _Kind, details: str, endpoint: str, *, lease: int = 0) -> StoreError:
        return _store_error(kind, details, endpoint, user=self.user, lease=lease)

    def _fail_over(self, failed: _Stubs) -> None:
        """Move to the next endpoint, unless another thread already moved past `failed`."""
        with self._lock:
            if self._stubs[self._current] is failed:
                self._current = (self._current + 1) % len(self._stubs)

    def close(self) -> None:
        for stubs in self._stubs:
            stubs.channel.close()


@dataclass(frozen=True, slots=True)
class _AioStubs:
    """The streaming etcd services on one endpoint's grpc.aio channel."""

    channel: grpc.aio.Channel
    lease: etcdrpc.LeaseStub
    watch: etcdrpc.WatchStub


def _watch_events(
    cluster: _Cluster,
    request: etcdrpc.WatchCreateRequest,
    response: etcdrpc.WatchResponse,
    endpoint: str,
    *,
    first: bool,
) -> tuple[WatchEvent, ...]:
    """A watch response's events; advances `request` past them, so a watch re-created
    from it (on whichever member is up) loses and repeats nothing."""
    if response.compact_revision:
        raise CompactedError(request.start_revision, response.compact_revision)
    if response.canceled or (first and not response.created):
        reason = response.cancel_reason or "etcd cancelled the watch"
        raise cluster.error(_classify_cancel(reason), reason, endpoint)
    events = tuple(_event(e) for e in response.events)
    if events:
        request.start_revision = events[-1].revision + 1
    return events


def _classify_cancel(reason: str) -> _Kind:
    """Watch cancel reasons are the texts of etcd's gRPC errors, without their codes."""
    text = reason.lower()
    if "permission denied" in text or "auth" in text:
        return _Kind.AUTH_FAILED
    return _Kind.OTHER


def _event(event: kv_pb2.Event) -> WatchEvent:
    kv = event.kv
    if event.type == kv_pb2.Event.DELETE:
        return WatchEvent(EventType.DELETE, kv.key.decode(), b"", kv.mod_revision)
    return WatchEvent(EventType.PUT, kv.key.decode(), kv.value, kv.mod_revision)


def _key_value(kv: kv_pb2.KeyValue) -> KeyValue:
    return KeyValue(
        kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease
    )


def prefix_range(prefix: str) -> tuple[bytes, bytes]:
    """etcd's [key, range_end) for every key starting with `prefix` ("" = every key)."""
    start = prefix.encode()
    end = bytearray(start)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return start or b"\0", b"\0"
    end[-1] += 1
    return start, bytes(end)


def _channel_credentials(tls_ca: bytes | None, client: TlsKeyPair | None) -> grpc.ChannelCredentials | None:
    if tls_ca is None and client is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=tls_ca,
        private_key=client.key if client else None,
        certificate_chain=client.cert if client else None,
    )


# --- the asyncio side -----------------------------------------------------------------


async def _awaited(call: grpc.Future) -> object:
    """The result of a grpc call future, awaited without a thread; cancelled with us."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[object] = loop.create_future()

    def transfer(finished: grpc.Future) -> None:
        if done.done():
            return
        error = finished.exception()
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(finished.result())

    def finished(finished_call: grpc.Future) -> None:  # on a grpc thread, or right here
        if finished_call.cancelled():
            return  # by us, below: nobody waits for it any more
        try:
            loop.call_soon_threadsafe(transfer, finished_call)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    call.add_done_callback(finished)
    try:
        return await done
    except asyncio.CancelledError:
        call.cancel()
        raise


class EtcdStore(Store):
    """The Store interface over an etcd v3 cluster, for use from asyncio.

    `endpoints` are "host:port" client endpoints of the cluster's members, tried in
    order on failure. TLS is on when `tls_ca` (or a client certificate) is given;
    `user` and `password` authenticate. `timeout` bounds each operation, failover
    included. Keys are used as given: the caller namespaces them.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        tls_ca: bytes | None = None,
        client_tls: TlsKeyPair | None = None,
        user: str | None = None,
        password: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        if not endpoints:
            raise StoreSettingError("endpoint", "name at least one etcd endpoint (host:port)")
        if (user is None) != (password is None):
            raise StoreSettingError("user", "etcd auth needs user together with password_file or password_env")
        self.endpoint = ",".join(endpoints)
        self._cluster = _Cluster(
            endpoints, _channel_credentials(tls_ca, client_tls), user, password, timeout
        )
        self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="etcd")
        self._closed = False
        # Lease keep-alive streams (grpc.aio, made on first use on the caller's loop).
        self._aio: dict[str, _AioStubs] = {}
        self._watch_calls: set[_AioStream] = set()
        self._lease_streams: dict[int, tuple[str, _AioStream]] = {}
        self._lease_locks: dict[int, asyncio.Lock] = {}
        #: the TTL of each lease this client granted: how long a renewal may take
        self._lease_ttls: dict[int, float] = {}

    async def _run(self, rpc: _FutureRpc, *, lease: int = 0) -> Any:
        """`rpc` through the cluster (failover, auth, errors), awaited on the loop.

        `rpc` starts a call and returns its grpc future: no thread waits on an answer,
        so a client with hundreds of nodes' operations in flight does not queue them
        behind a handful of threads (where a node's lease could expire between its
        grant and its first use). The response is etcd's message, untyped (pyetcd ships
        no type information).
        """

        async def attempt(stubs: _Stubs, timeout: float, metadata: _Metadata) -> Any:
            return await _awaited(rpc(stubs, timeout, metadata))

        return await self._with_failover(attempt, lease=lease)

    async def _with_failover(
        self,
        attempt: Callable[[_Stubs, float, _Metadata], Awaitable[_T]],
        *,
        lease: int = 0,
        first_timeout: float = _FIRST_ATTEMPT_TIMEOUT,
    ) -> _T:
        """Try `attempt` on the current member until it succeeds or the cluster gives up.

        A gRPC error goes to the cluster, which fails over, re-authenticates or raises
        our error for it (its table), and says how long to pause, which this does on the
        loop. Authenticating (a blocking call) runs on the store's threads; the attempts
        themselves run on the loop.
        """
        if self._closed:
            raise StoreUnavailableError(self.endpoint, "this store client is closed")
        cluster = self._cluster
        loop = asyncio.get_running_loop()
        attempts = cluster.attempts(first_timeout)
        while True:
            timeout = attempts.next_timeout()
            stubs = cluster.current()
            try:
                metadata = cluster.known_metadata()
                if metadata is None:
                    metadata = await loop.run_in_executor(
                        self._executor, cluster.metadata, stubs, timeout
                    )
                return await attempt(stubs, timeout, metadata)
            except grpc.RpcError as exc:
                code, details = _rpc_facts(exc)
            await asyncio.sleep(cluster.recover(stubs, code, details, attempts, lease=lease))

    async def auth(self, method: str, request: object) -> Any:
        """One call of etcd's Auth service (`RoleAdd`, `UserGrantRole`, ...) with this
        client's failover and credentials: how `etcd_roles` sets up users and roles."""
        return await self._run(lambda s, t, m: getattr(s.auth, method).future(request, timeout=t, metadata=m))

    async def get(self, key: str) -> KeyValue | None:
        request = etcdrpc.RangeRequest(key=key.encode())
        response = await self._run(lambda s, t, m: s.kv.Range.future(request, timeout=t, metadata=m))
        return _key_value(response.kvs[0]) if response.kvs else None

    async def get_prefix(self, prefix: str) -> RangeResult:
        start, end = prefix_range(prefix)
        request = etcdrpc.RangeRequest(key=start, range_end=end)
        response = await self._run(lambda s, t, m: s.kv.Range.future(request, timeout=t, metadata=m))
        return RangeResult(tuple(_key_value(kv) for kv in response.kvs), response.header.revision)

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        request = etcdrpc.PutRequest(key=key.encode(), value=value, lease=lease)
        response = await self._run(
            lambda s, t, m: s.kv.Put.future(request, timeout=t, metadata=m), lease=lease
        )
        return int(response.header.revision)

    async def compare_and_put(
        self, key: str, value: bytes, *, expected_mod_revision: int, lease: int = 0
    ) -> bool:
        raw = key.encode()
        request = etcdrpc.TxnRequest(
            compare=[_unchanged_since(raw, expected_mod_revision)],
            success=[
                etcdrpc.RequestOp(
                    request_put=etcdrpc.PutRequest(key=raw, value=value, lease=lease)
                )
            ],
            failure=[etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=raw))],
        )
        tries = 0

        def txn(stubs: _Stubs, timeout: float, metadata: _Metadata) -> grpc.Future:
            nonlocal tries
            tries += 1
            return stubs.kv.Txn.future(request, timeout=timeout, metadata=metadata)

        def outcome(response: etcdrpc.TxnResponse) -> bool:
            if response.succeeded or tries == 1:
                return bool(response.succeeded)
            # A retry after a lost reply: the earlier try may be the write now in place.
            kvs = response.responses[0].response_range.kvs
            return bool(kvs) and (kvs[0].value, kvs[0].lease) == (value, lease) and (
                kvs[0].mod_revision > expected_mod_revision
            )

        return outcome(await self._run(txn, lease=lease))

    async def delete(self, key: str) -> bool:
        request = etcdrpc.DeleteRangeRequest(key=key.encode())
        response = await self._run(
            lambda s, t, m: s.kv.DeleteRange.future(request, timeout=t, metadata=m)
        )
        return int(response.deleted) > 0

    async def compare_and_delete(self, key: str, *, expected_mod_revision: int) -> bool:
        raw = key.encode()
        request = etcdrpc.TxnRequest(
            compare=[_unchanged_since(raw, expected_mod_revision)],
            success=[etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=raw))],
        )
        response = await self._run(lambda s, t, m: s.kv.Txn.future(request, timeout=t, metadata=m))
        return bool(response.succeeded and response.responses[0].response_delete_range.deleted)

    async def delete_prefix(self, prefix: str) -> int:
        start, end = prefix_range(prefix)
        request = etcdrpc.DeleteRangeRequest(key=start, range_end=end)
        response = await self._run(
            lambda s, t, m: s.kv.DeleteRange.future(request, timeout=t, metadata=m)
        )
        return int(response.deleted)

    async def grant_lease(self, ttl: float) -> int:
        request = etcdrpc.LeaseGrantRequest(TTL=math.ceil(check_lease_ttl(ttl)))
        response = await self._run(
            lambda s, t, m: s.lease.LeaseGrant.future(request, timeout=t, metadata=m)
        )
        if response.error:
            raise StoreError(f"etcd at {self.endpoint} refused a lease: {response.error}")
        self._lease_ttls[int(response.ID)] = float(response.TTL)
        return int(response.ID)

    async def keep_alive(self, lease: int) -> None:
        async def renew(stubs: _Stubs, timeout: float, metadata: _Metadata) -> None:
            call = self._lease_stream(lease, stubs, metadata)
            try:
                async with asyncio.timeout(timeout):
                    await call.write(etcdrpc.LeaseKeepAliveRequest(ID=lease))
                    response = await call.read()
            except TimeoutError:  # a silent member: the next try reconnects
                self._drop_lease_stream(lease)
                raise _StreamFailure(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "no answer to a lease keep-alive"
                ) from None
            except asyncio.InvalidStateError:  # written to a stream that had just ended
                self._drop_lease_stream(lease)
                raise _StreamFailure(grpc.StatusCode.UNAVAILABLE, "the stream ended") from None
            except grpc.RpcError:
                self._drop_lease_stream(lease)
                raise
            if response is grpc.aio.EOF:
                self._drop_lease_stream(lease)
                raise _StreamFailure(grpc.StatusCode.UNAVAILABLE, "the lease keep-alive stream ended")
            if response.TTL <= 0:
                self._drop_lease_stream(lease)
                raise LeaseExpiredError(lease)

        # A renewal's first try may take a third of the TTL, not the usual second: on a
        # busy host (10,000 simulated nodes on two cores) answers came late, each try
        # cut short was sent again on a new stream, more load, and leases lapsed with
        # their renewals in flight. A third still leaves a silent member time to be
        # failed over before the lease runs out.
        first = max(_FIRST_ATTEMPT_TIMEOUT, self._lease_ttls.get(lease, 0.0) / 3)
        lock = self._lease_locks.setdefault(lease, asyncio.Lock())
        async with lock:  # one renewal at a time on a lease's stream
            await self._with_failover(renew, lease=lease, first_timeout=first)

    def _lease_stream(self, lease: int, stubs: _Stubs, metadata: _Metadata) -> _AioStream:
        """The lease's open LeaseKeepAlive stream to `stubs`' endpoint, or a new one."""
        known = self._lease_streams.get(lease)
        if known is not None and known[0] == stubs.endpoint and not known[1].done():
            return known[1]
        self._drop_lease_stream(lease)
        stub = self._aio_stubs(stubs.endpoint).lease
        call = stub.LeaseKeepAlive(metadata=metadata + _REQUIRE_LEADER)
        self._lease_streams[lease] = (stubs.endpoint, call)
        return call

    def _drop_lease_stream(self, lease: int) -> None:
        known = self._lease_streams.pop(lease, None)
        if known is not None:
            known[1].cancel()

    async def revoke_lease(self, lease: int) -> None:
        request = etcdrpc.LeaseRevokeRequest(ID=lease)
        try:
            await self._run(
                lambda s, t, m: s.lease.LeaseRevoke.future(request, timeout=t, metadata=m),
                lease=lease,
            )
        except LeaseExpiredError:
            pass  # already gone: the outcome the caller wanted
        finally:
            self._drop_lease_stream(lease)
            self._lease_locks.pop(lease, None)
            self._lease_ttls.pop(lease, None)

    async def watch(
        self, key: str, *, start_revision: int, prefix: bool = False
    ) -> AsyncIterator[WatchEvent]:
        # A grpc.aio stream read on the loop: no thread per watch (with hundreds of
        # nodes per client, hundreds of watch threads fought the loop for the GIL).
        if self._closed:
            raise StoreUnavailableError(self.endpoint, "this store client is closed")
        start, end = prefix_range(key) if prefix else (key.encode(), b"")
        request = etcdrpc.WatchCreateRequest(
            key=start, range_end=end, start_revision=start_revision
        )
        cluster = self._cluster
        loop = asyncio.get_running_loop()
        attempts = cluster.attempts()
        while True:
            timeout = attempts.next_timeout()
            stubs = cluster.current()
            call: _AioStream | None = None
            try:
                metadata = cluster.known_metadata()
                if metadata is None:
                    metadata = await loop.run_in_executor(
                        self._executor, cluster.metadata, stubs, timeout
                    )
                call = self._aio_stubs(stubs.endpoint).watch.Watch(
                    metadata=metadata + _REQUIRE_LEADER
                )
                self._watch_calls.add(call)
                # A member that never answers is cut off like one that refuses.
                async with asyncio.timeout(timeout):
                    await call.write(etcdrpc.WatchRequest(create_request=request))
                    created = await call.read()
                first = True
                response = created
                while response is not grpc.aio.EOF:
                    events = _watch_events(cluster, request, response, stubs.endpoint, first=first)
                    if first:
                        attempts = cluster.attempts()
                        first = False
                    for event in events:
                        yield event
                    response = await call.read()
                code, details = grpc.StatusCode.UNAVAILABLE, "the watch stream ended"
            except TimeoutError:
                code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "no answer to a watch"
            except grpc.RpcError as exc:
                code, details = _rpc_facts(exc)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._closed and task is not None and not task.cancelling():
                    raise StoreUnavailableError(
                        self.endpoint, "this store client is closed"
                    ) from None
                raise
            finally:
                if call is not None:
                    call.cancel()
                    self._watch_calls.discard(call)
            if self._closed:
                raise StoreUnavailableError(self.endpoint, "this store client is closed")
            await asyncio.sleep(cluster.recover(stubs, code, details, attempts))

    def _aio_stubs(self, endpoint: str) -> _AioStubs:
        """The grpc.aio stubs for `endpoint` (made on first use, on the caller's loop)."""
        stubs = self._aio.get(endpoint)
        if stubs is None:
            credentials = self._cluster.credentials
            if credentials is None:
                channel = grpc.aio.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
            else:
                channel = grpc.aio.secure_channel(endpoint, credentials, options=_CHANNEL_OPTIONS)
            stubs = self._aio[endpoint] = _AioStubs(
                channel, etcdrpc.LeaseStub(channel), etcdrpc.WatchStub(channel)
            )
        return stubs

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for call in list(self._watch_calls):
            call.cancel()
        for lease in list(self._lease_streams):
            self._drop_lease_stream(lease)
        for aio in self._aio.values():
            await aio.channel.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._cluster.close()


def _unchanged_since(key: bytes, mod_revision: int) -> etcdrpc.Compare:
    """The compare for "key's mod_revision is `mod_revision`" (0: the key is absent)."""
    if mod_revision == 0:
        return etcdrpc.Compare(
            key=key, target=etcdrpc.Compare.CREATE, result=etcdrpc.Compare.EQUAL, create_revision=0
        )
    return etcdrpc.Compare(
        key=key,
        target=etcdrpc.Compare.MOD,
        result=etcdrpc.Compare.EQUAL,
        mod_revision=mod_revision,
    )
