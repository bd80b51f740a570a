"""The etcd v3 backend of the Store interface (`--rdzv-backend=etcd`).

It speaks the etcd v3 gRPC API through the generated stubs that `etcd-sdk-python`
(`pyetcd`) ships. We do not use pyetcd's client object: it authenticates once, on one
endpoint, at construction, never renews an expired token, leaves retries to the caller,
and replaces gRPC errors with detail-less exceptions. What this module adds instead
(with `store/etcd/cluster.py`, the members' blocking side, and `store/etcd/error_table.py`):

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
- unary calls as grpc.aio calls on the loop: no thread is held per call in flight, so
  hundreds of nodes sharing one client do not queue behind a few threads;
- lease keep-alives: one long-lived LeaseKeepAlive stream per lease (grpc.aio, on the
  store's loop, no thread), a renewal being one message on it; a stream per lease, not
  one shared, because etcd answers a stream's requests in order and holds the renewal
  of an expired lease until its revocation is through raft: on a shared stream one
  expired lease would stall every other lease's renewal behind it. A broken stream is
  re-opened through the same failover;
- watches: one grpc.aio stream per watch, read on the loop (no thread), and
  re-created from the next undelivered revision on another endpoint when it breaks.

Its settings (TLS material, user and password) come read and checked from
`elasticrun.store.settings`; the password never appears in a message.

Leases: etcd counts TTLs in whole seconds (`grant_lease` rounds up) and raises any TTL
below its minimum, 1.5 election timeouts rounded up to a second (2 s with etcd's
default flags), to that minimum. A new raft leader also extends every lease by its TTL.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import grpc
import grpc.aio
from pyetcd import etcdrpc
from pyetcd.etcdrpc import kv_pb2

from elasticrun.errors import (
    CompactedError,
    LeaseExpiredError,
    StoreError,
    StoreSettingError,
    StoreUnavailableError,
)
from elasticrun.store.etcd.cluster import (
    CHANNEL_OPTIONS,
    FIRST_ATTEMPT_TIMEOUT,
    Cluster,
    Metadata,
    Stubs,
    channel_credentials,
)
from elasticrun.store.etcd.error_table import StreamFailure, classify_cancel, rpc_facts
from elasticrun.store.interface import (
    EventType,
    KeyValue,
    RangeResult,
    Store,
    WatchEvent,
    check_lease_ttl,
)
from elasticrun.store.wire import DEFAULT_TIMEOUT, TlsKeyPair

_T = TypeVar("_T")

_AioRpc = Callable[["_AioStubs", float, Metadata], Awaitable[Any]]
_AioStream: TypeAlias = "grpc.aio.StreamStreamCall"
#: etcd closes a watch stream whose member lost its leader when this is set, instead of
#: leaving it silent; the watch then resumes on a member that has one.
_REQUIRE_LEADER: Metadata = (("hasleader", "true"),)


@dataclass(frozen=True, slots=True)
class _AioStubs:
    """The etcd services on one endpoint's grpc.aio channel: every call but authenticating."""

    channel: grpc.aio.Channel
    kv: etcdrpc.KVStub
    lease: etcdrpc.LeaseStub
    watch: etcdrpc.WatchStub
    auth: etcdrpc.AuthStub


def _watch_events(
    cluster: Cluster,
    request: etcdrpc.WatchCreateRequest,
    response: etcdrpc.WatchResponse,
    endpoint: str,
    *,
    first: bool,
) -> tuple[WatchEvent, ...]:
    """A watch response's events.

    Advances `request` past them, so a watch re-created from it (on whichever member is
    up) loses and repeats nothing."""
    if response.compact_revision:
        raise CompactedError(request.start_revision, response.compact_revision)
    if response.canceled or (first and not response.created):
        reason = response.cancel_reason or "etcd cancelled the watch"
        raise cluster.error(classify_cancel(reason), reason, endpoint)
    events = tuple(_event(e) for e in response.events)
    if events:
        request.start_revision = events[-1].revision + 1
    return events


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
        self._cluster = Cluster(
            endpoints, channel_credentials(tls_ca, client_tls), user, password, timeout
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

    async def _run(self, rpc: _AioRpc, *, lease: int = 0) -> Any:
        """`rpc` through the cluster (failover, auth, errors), awaited on the loop.

        `rpc` starts a grpc.aio call on the endpoint's channel: no thread waits on an
        answer, so a client with hundreds of nodes' operations in flight does not queue
        them behind a handful of threads (where a node's lease could expire between its
        grant and its first use). Not grpc's blocking channel's futures: their calls
        contend for the GIL with that channel's polling thread and come back through
        `call_soon_threadsafe`, which cost a simulated node's registration a fifth to
        two fifths of its client CPU (BENCHMARKS-HISTORY.md, "Scale"). The response is etcd's
        message, untyped (pyetcd ships no type information).
        """

        async def attempt(stubs: Stubs, timeout: float, metadata: Metadata) -> Any:
            return await rpc(self._aio_stubs(stubs.endpoint), timeout, metadata)

        return await self._with_failover(attempt, lease=lease)

    async def _with_failover(
        self,
        attempt: Callable[[Stubs, float, Metadata], Awaitable[_T]],
        *,
        lease: int = 0,
        first_timeout: float = FIRST_ATTEMPT_TIMEOUT,
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
                code, details = rpc_facts(exc)
            await asyncio.sleep(cluster.recover(stubs, code, details, attempts, lease=lease))

    async def auth(self, method: str, request: object) -> Any:
        """One call of etcd's Auth service (`RoleAdd`, `UserGrantRole`, ...), with failover and credentials.

        This client's failover and credentials: how `etcd_roles` sets up users and
        roles."""
        return await self._run(lambda s, t, m: getattr(s.auth, method)(request, timeout=t, metadata=m))

    async def get(self, key: str) -> KeyValue | None:
        request = etcdrpc.RangeRequest(key=key.encode())
        response = await self._run(lambda s, t, m: s.kv.Range(request, timeout=t, metadata=m))
        return _key_value(response.kvs[0]) if response.kvs else None

    async def get_prefix(self, prefix: str) -> RangeResult:
        start, end = prefix_range(prefix)
        request = etcdrpc.RangeRequest(key=start, range_end=end)
        response = await self._run(lambda s, t, m: s.kv.Range(request, timeout=t, metadata=m))
        return RangeResult(tuple(_key_value(kv) for kv in response.kvs), response.header.revision)

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        request = etcdrpc.PutRequest(key=key.encode(), value=value, lease=lease)
        response = await self._run(
            lambda s, t, m: s.kv.Put(request, timeout=t, metadata=m), lease=lease
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

        def txn(stubs: _AioStubs, timeout: float, metadata: Metadata) -> Awaitable[Any]:
            nonlocal tries
            tries += 1
            call: Awaitable[Any] = stubs.kv.Txn(request, timeout=timeout, metadata=metadata)
            return call

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
            lambda s, t, m: s.kv.DeleteRange(request, timeout=t, metadata=m)
        )
        return int(response.deleted) > 0

    async def compare_and_delete(self, key: str, *, expected_mod_revision: int) -> bool:
        raw = key.encode()
        request = etcdrpc.TxnRequest(
            compare=[_unchanged_since(raw, expected_mod_revision)],
            success=[etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=raw))],
        )
        response = await self._run(lambda s, t, m: s.kv.Txn(request, timeout=t, metadata=m))
        return bool(response.succeeded and response.responses[0].response_delete_range.deleted)

    async def delete_prefix(self, prefix: str) -> int:
        start, end = prefix_range(prefix)
        request = etcdrpc.DeleteRangeRequest(key=start, range_end=end)
        response = await self._run(
            lambda s, t, m: s.kv.DeleteRange(request, timeout=t, metadata=m)
        )
        return int(response.deleted)

    async def grant_lease(self, ttl: float) -> int:
        request = etcdrpc.LeaseGrantRequest(TTL=math.ceil(check_lease_ttl(ttl)))
        response = await self._run(
            lambda s, t, m: s.lease.LeaseGrant(request, timeout=t, metadata=m)
        )
        if response.error:
            raise StoreError(f"etcd at {self.endpoint} refused a lease: {response.error}")
        self._lease_ttls[int(response.ID)] = float(response.TTL)
        return int(response.ID)

    async def keep_alive(self, lease: int) -> None:
        #: this renewal's exchange (its request written, its answer read) on the stream
        #: it went to; a retry on that stream waits for it rather than asking again
        asked: tuple[_AioStream, asyncio.Task[Any]] | None = None

        async def exchange(call: _AioStream) -> Any:
            await call.write(etcdrpc.LeaseKeepAliveRequest(ID=lease))
            return await call.read()

        async def renew(stubs: Stubs, timeout: float, metadata: Metadata) -> None:
            nonlocal asked
            call = self._lease_stream(lease, stubs, metadata)
            if asked is None or asked[0] is not call:
                if asked is not None:
                    _discard(asked[1])  # its stream was dropped
                asked = (call, asyncio.ensure_future(exchange(call)))
            try:
                # Shielded: grpc.aio ends the whole stream when a write or read is
                # cancelled. Not wait_for: on Python 3.11 it swallows a cancellation
                # that comes as the answer does, and a node's leave() waited forever
                # for its keep-alive task to end.
                async with asyncio.timeout(timeout):
                    response = await asyncio.shield(asked[1])
            except TimeoutError:
                # The stream stays: a try that fails over asks the next member on a new
                # one; a try on the same member (the only one) waits for this exchange,
                # since a new stream there could not be answered sooner and costs a busy
                # client more than the wait (BENCHMARKS-HISTORY.md, "a slow renewal's stream").
                raise StreamFailure(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "no answer to a lease keep-alive"
                ) from None
            except asyncio.InvalidStateError:  # written to a stream that had just ended
                self._drop_lease_stream(lease)
                raise StreamFailure(grpc.StatusCode.UNAVAILABLE, "the stream ended") from None
            except grpc.RpcError:
                self._drop_lease_stream(lease)
                raise
            asked = None
            if response is grpc.aio.EOF:
                self._drop_lease_stream(lease)
                raise StreamFailure(grpc.StatusCode.UNAVAILABLE, "the lease keep-alive stream ended")
            if response.TTL <= 0:
                self._drop_lease_stream(lease)
                raise LeaseExpiredError(lease)

        # A renewal's first try may take a third of the TTL, not the usual second, which
        # still leaves a silent member time to be failed over before the lease runs out
        # (docs/architecture.md, Design notes, "Leases under load").
        first = max(FIRST_ATTEMPT_TIMEOUT, self._lease_ttls.get(lease, 0.0) / 3)
        lock = self._lease_locks.setdefault(lease, asyncio.Lock())
        async with lock:  # one renewal at a time on a lease's stream
            try:
                await self._with_failover(renew, lease=lease, first_timeout=first)
            finally:
                if asked is not None:
                    # Given up with an answer due: the next renewal would read it as its
                    # own and count the lease renewed from later than etcd renewed it.
                    self._drop_lease_stream(lease)
                    _discard(asked[1])

    def _lease_stream(self, lease: int, stubs: Stubs, metadata: Metadata) -> _AioStream:
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
                lambda s, t, m: s.lease.LeaseRevoke(request, timeout=t, metadata=m),
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
                code, details = rpc_facts(exc)
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
                channel = grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
            else:
                channel = grpc.aio.secure_channel(endpoint, credentials, options=CHANNEL_OPTIONS)
            stubs = self._aio[endpoint] = _AioStubs(
                channel, etcdrpc.KVStub(channel), etcdrpc.LeaseStub(channel), etcdrpc.WatchStub(channel),
                etcdrpc.AuthStub(channel),
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


def _discard(future: asyncio.Future[Any]) -> None:
    """Cancel `future`, or take its outcome: nothing is left to log as never retrieved."""
    if not future.cancel() and not future.cancelled():
        future.exception()


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
