"""The async client of the built-in store server: `GrpcStore`, the rendezvous's Store.

Every call carries a deadline (`timeout`). A call that finds the server unreachable is
retried with backoff until that deadline (the channel reconnects on its own, quickly),
then fails with StoreUnavailableError naming host:port and the last cause. Watches
survive a dropped stream by resuming from the revision after the last one delivered;
a watch that reconnects to a server holding a different history (it restarted and lost
its memory) gets CompactedError, so the caller re-reads instead of missing changes.

Given several endpoints (c10d's `--rdzv-endpoint` list: the nodes that may serve the
store), a call that finds its server refusing connections turns to the first other one
where an agent serves the store (`turn_to`) and goes on there.

One exception to the retries: a server that said (in a watch reply) it is hosted by a
launcher agent lives and dies with that agent, so when its port refuses connections
every call fails at once with StoreGoneError, as torchrun's agents do when the agent
hosting their TCPStore dies, rather than after the whole timeout. Whether to wait for a
new store at the same endpoint (the agent restarted there) is the rendezvous's call
(`store_host_grace`). Nor are calls retried when the server refuses the
client's TLS (`dial.tls_refusal`: a plaintext client of a TLS server, a client
certificate the server does not take): StoreAuthError at once.

The blocking client of the c10d operations is `store/client/c10d.py`; what both share
(endpoint check, channel options, error translation) is `store/client/dial.py`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import grpc

from elasticrun.errors import (
    CompactedError,
    ElasticrunError,
    LeaseExpiredError,
    StoreGoneError,
    StoreUnavailableError,
)
from elasticrun.proto import store_pb2 as pb
from elasticrun.proto import store_pb2_grpc as pb_grpc
from elasticrun.store.backoff import Backoff
from elasticrun.store.client.dial import (
    ETCD_STATUS_METHOD,
    PROBE_TIMEOUT,
    Dial,
    error_from,
    foreign,
    foreign_error,
    hung_up,
    retryable,
)
from elasticrun.store.credentials import JOBS_PREFIX
from elasticrun.store.interface import (
    EventType,
    KeyValue,
    RangeResult,
    Store,
    WatchEvent,
)
from elasticrun.store.wire import DEFAULT_TIMEOUT, TlsKeyPair

_T = TypeVar("_T")

log = logging.getLogger("elasticrun.store")
#: the endpoints whose store was found to have no token (said once a process: one agent
#: or command may open more than one client of a store)
_SAID_TOKEN_UNUSED: set[str] = set()


def _key_value(kv: pb.KeyValue) -> KeyValue:
    return KeyValue(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease)


_EVENT_TYPES = {pb.WatchEvent.PUT: EventType.PUT, pb.WatchEvent.DELETE: EventType.DELETE}


class GrpcStore(Store):
    """The Store interface over the built-in store server at `endpoint` (host:port).

    `token` is sent with every call; `tls_ca` (PEM) makes the client speak TLS and
    trust that CA; `client_tls` is the certificate it presents to a server that requires
    one (mutual TLS). `timeout` bounds every call, including the retries of a call that
    found the server unreachable.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        others: Sequence[str] = (),
        token: str | None = None,
        tls_ca: bytes | None = None,
        client_tls: TlsKeyPair | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self._dial = Dial(endpoint, token=token, tls_ca=tls_ca, client_tls=client_tls, timeout=timeout)
        self.endpoint = endpoint
        #: every endpoint given (the first one first): where agents may serve the store
        self._endpoints = (endpoint, *others)
        self.timeout = timeout
        self._channel: grpc.aio.Channel | None = None
        self._stub_cache: pb_grpc.StoreStub | None = None
        self._keepalive: _KeepAliveStream | None = None
        #: The server said it lives inside an agent (learned from its reads and watches).
        self._hosted_by_agent = False

    # --- plumbing ------------------------------------------------------------------

    @property
    def _stub(self) -> pb_grpc.StoreStub:
        # Created on first use, inside the loop that will run it.
        if self._stub_cache is None:
            self._channel = self._dial.aio_channel()
            self._stub_cache = pb_grpc.StoreStub(self._channel)
        return self._stub_cache

    async def _call(
        self, method: Callable[[pb_grpc.StoreStub], Callable[..., Awaitable[_T]]], request: object, *, lease: int = 0
    ) -> _T:
        """One unary call under the deadline, retried with backoff while unreachable.

        `method` picks the call from the stub of each try: the store may have moved
        (`turn_to`)."""
        return await self._retried(
            lambda timeout: method(self._stub)(request, timeout=timeout, metadata=self._dial.metadata), lease=lease
        )

    async def _retried(self, attempt: Callable[[float], Awaitable[_T]], *, lease: int = 0) -> _T:
        """`attempt(timeout)` under the deadline, tried again with backoff while the server is unreachable."""
        retries = Backoff(self.timeout, clock=asyncio.get_running_loop().time)
        while True:
            try:
                return await attempt(retries.left())
            except grpc.aio.AioRpcError as e:
                await self._retry_or_raise(e, lease, out_of_time=retries.out_of_time())
            await asyncio.sleep(retries.pause())

    async def _retry_or_raise(self, error: grpc.RpcError, lease: int = 0, *, out_of_time: bool = False) -> None:
        """Return if `error` is worth another try, else raise what it means.

        A client whose TLS the server refuses is told so, not left retrying, and so is
        one that found something other than the store at its endpoint."""
        if foreign(error):
            raise foreign_error(error, self.endpoint, etcd=await self._answers_etcd(error)) from None
        if _refused(error) and await self._turn_to_another():
            return
        worth_it = self._worth_retrying(error)
        if worth_it and hung_up(error):
            refusal = await asyncio.to_thread(self._dial.tls_refusal)
            if refusal is not None:
                raise refusal from None
        if not worth_it or out_of_time:
            raise self._final_error(error, lease) from None

    async def _answers_etcd(self, error: grpc.RpcError) -> bool:
        """Whether the gRPC server that lacks our service is etcd (asked without our token)."""
        if error.code() is not grpc.StatusCode.UNIMPLEMENTED or self._channel is None:
            return False
        status = self._channel.unary_unary(ETCD_STATUS_METHOD)
        try:
            await status(b"", timeout=PROBE_TIMEOUT)
        except grpc.aio.AioRpcError:
            return False
        return True

    async def _turn_to_another(self) -> bool:
        """Given several endpoints, go on with another one where an agent serves the store now."""
        others = [e for e in self._endpoints if e != self.endpoint]
        return bool(others) and bool(await self.turn_to(others))

    def _worth_retrying(self, error: grpc.RpcError) -> bool:
        return retryable(error) and not self._host_gone(error)

    def _host_gone(self, error: grpc.RpcError) -> bool:
        """The agent that hosted the server is gone: its port refuses us."""
        return self._hosted_by_agent and _refused(error)

    def _final_error(self, error: grpc.RpcError, lease: int = 0) -> ElasticrunError:
        if self._host_gone(error):
            return StoreGoneError(
                self.endpoint,
                "connection refused: the agent that hosted it is gone",
            )
        translated = error_from(error, self.endpoint, lease)
        if isinstance(translated, StoreUnavailableError):
            return StoreUnavailableError(
                self.endpoint, f"{translated.cause} (gave up after {self.timeout:g} s)"
            )
        return translated

    def _learn(self, reply: pb.RangeReply) -> None:
        """What a read's reply says of the server.

        Whether an agent hosts it, and (said once) that it has no token, so that the one
        this client presents protects nothing."""
        self._hosted_by_agent = reply.hosted_by_agent
        if reply.token_unused and self.endpoint not in _SAID_TOKEN_UNUSED:
            _SAID_TOKEN_UNUSED.add(self.endpoint)
            log.warning(
                "the store at %s has no token: the one this client presents protects nothing; give the store "
                "the same token (store serve --token-file, or the token_file of the agent that hosts it)",
                self.endpoint,
            )

    # --- reads and writes ----------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        reply = await self._call(lambda stub: stub.Range, pb.RangeRequest(key=key))
        self._learn(reply)
        return _key_value(reply.kvs[0]) if reply.kvs else None

    async def get_prefix(self, prefix: str) -> RangeResult:
        """In pages, all read at one revision by the server (`RangePages`).

        A read broken off is read again whole."""
        request = pb.RangeRequest(key=prefix, prefix=True)

        async def read(timeout: float) -> RangeResult:
            kvs: list[KeyValue] = []
            revision = 0
            call = self._stub.RangePages(request, timeout=timeout, metadata=self._dial.metadata)
            try:
                async for page in call:
                    kvs.extend(map(_key_value, page.kvs))
                    revision = page.revision
                    self._learn(page)
            finally:
                call.cancel()
            return RangeResult(tuple(kvs), revision)

        return await self._retried(read)

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        reply: pb.PutReply = await self._call(
            lambda stub: stub.Put, pb.PutRequest(key=key, value=value, lease=lease), lease=lease
        )
        return reply.revision

    async def compare_and_put(
        self, key: str, value: bytes, *, expected_mod_revision: int, lease: int = 0
    ) -> bool:
        request = pb.CompareAndPutRequest(
            key=key, value=value, expected_mod_revision=expected_mod_revision, lease=lease
        )
        reply: pb.CompareReply = await self._call(lambda stub: stub.CompareAndPut, request, lease=lease)
        return reply.succeeded

    async def delete(self, key: str) -> bool:
        reply: pb.DeleteRangeReply = await self._call(lambda stub: stub.DeleteRange, pb.DeleteRangeRequest(key=key))
        return reply.deleted > 0

    async def compare_and_delete(self, key: str, *, expected_mod_revision: int) -> bool:
        request = pb.CompareAndDeleteRequest(key=key, expected_mod_revision=expected_mod_revision)
        reply: pb.CompareReply = await self._call(lambda stub: stub.CompareAndDelete, request)
        return reply.succeeded

    async def delete_prefix(self, prefix: str) -> int:
        request = pb.DeleteRangeRequest(key=prefix, prefix=True)
        reply: pb.DeleteRangeReply = await self._call(lambda stub: stub.DeleteRange, request)
        return reply.deleted

    # --- leases --------------------------------------------------------------------

    async def grant_lease(self, ttl: float) -> int:
        request = pb.LeaseGrantRequest(ttl_seconds=ttl)
        reply: pb.LeaseGrantReply = await self._call(lambda stub: stub.LeaseGrant, request)
        return reply.lease

    async def keep_alive(self, lease: int) -> None:
        """Keep the lease alive over the shared keep-alive stream (reopened as needed)."""
        retries = Backoff(self.timeout, clock=asyncio.get_running_loop().time)
        while True:
            if self._keepalive is None or self._keepalive.broken is not None:
                self._keepalive = _KeepAliveStream(
                    self._stub.LeaseKeepAlive(metadata=self._dial.metadata)
                )
            try:
                async with asyncio.timeout_at(retries.deadline):
                    reply = await self._keepalive.send(lease)
            except TimeoutError:
                raise StoreUnavailableError(
                    self.endpoint, f"no keep-alive reply within {self.timeout:g} s"
                ) from None
            except grpc.aio.AioRpcError as e:
                await self._retry_or_raise(e, lease, out_of_time=retries.out_of_time())
                await asyncio.sleep(retries.pause())
                continue
            if reply.expired:
                raise LeaseExpiredError(lease)
            return

    async def revoke_lease(self, lease: int) -> None:
        await self._call(lambda stub: stub.LeaseRevoke, pb.LeaseRevokeRequest(lease=lease))

    # --- watch ---------------------------------------------------------------------

    async def watch(
        self, key: str, *, start_revision: int, prefix: bool = False
    ) -> AsyncIterator[WatchEvent]:
        loop = asyncio.get_running_loop()
        cursor = max(start_revision, 1)
        history_id: int | None = None
        retries: Backoff | None = None  # from when the stream broke, while reconnecting
        while True:
            call = self._stub.Watch(
                pb.WatchRequest(key=key, prefix=prefix, start_revision=cursor),
                metadata=self._dial.metadata,
            )
            try:
                async for reply in call:
                    self._hosted_by_agent = reply.hosted_by_agent
                    if history_id is None:
                        history_id = reply.store_id
                    elif reply.store_id != history_id:
                        # A different server memory: none of our revisions exist there.
                        raise CompactedError(cursor, 0)
                    retries = None
                    if reply.compact_revision:
                        raise CompactedError(cursor, reply.compact_revision)
                    for event in reply.events:
                        yield WatchEvent(
                            _EVENT_TYPES[event.type], event.key, event.value, event.revision
                        )
                    if reply.events:
                        cursor = reply.events[-1].revision + 1
                error: grpc.RpcError | None = None
            except grpc.aio.AioRpcError as e:
                await self._retry_or_raise(e)
                error = e
            finally:
                call.cancel()
            # The stream ended or broke: resume from `cursor` until the deadline.
            retries = retries or Backoff(self.timeout, clock=loop.time)
            if retries.out_of_time():
                cause = error.details() if error is not None else "the watch stream ended"
                raise StoreUnavailableError(
                    self.endpoint, f"{cause} (watch lost for {self.timeout:g} s)"
                )
            await asyncio.sleep(retries.pause())

    async def turn_to(self, endpoints: Sequence[str]) -> str:
        """Go on with the first of `endpoints` where an agent serves the store now.

        Each is asked once, within PROBE_TIMEOUT: one that refuses (its agent does not
        serve, or is gone) is passed over. The calls that follow go there; a watch
        that resumes there finds another history (CompactedError) and its caller
        reads again."""
        for endpoint in endpoints:
            dial = dataclasses.replace(self._dial, endpoint=endpoint)
            channel = dial.aio_channel()
            try:
                reply = await pb_grpc.StoreStub(channel).Range(
                    pb.RangeRequest(key=JOBS_PREFIX), timeout=PROBE_TIMEOUT, metadata=dial.metadata
                )
            except grpc.aio.AioRpcError as e:
                log.debug("no store served at %s: %s", endpoint, e.details())
                await channel.close()
                continue
            if not reply.hosted_by_agent:  # a successor serves from its agent, nothing else does
                await channel.close()
                continue
            await self.close()
            self._dial, self.endpoint = dial, endpoint
            self._channel, self._stub_cache = channel, pb_grpc.StoreStub(channel)
            self._hosted_by_agent = True
            return endpoint
        return ""

    async def close(self) -> None:
        if self._keepalive is not None:
            self._keepalive.close()
            self._keepalive = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub_cache = None


class _KeepAliveStream:
    """One LeaseKeepAlive stream: requests go out in order, replies come back in order."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self._call = call
        self._waiting: collections.deque[asyncio.Future[pb.LeaseKeepAliveReply]] = (
            collections.deque()
        )
        self._write_lock = asyncio.Lock()
        self.broken: grpc.RpcError | None = None
        self._reader = asyncio.ensure_future(self._read())

    async def send(self, lease: int) -> pb.LeaseKeepAliveReply:
        future: asyncio.Future[pb.LeaseKeepAliveReply] = (
            asyncio.get_running_loop().create_future()
        )
        async with self._write_lock:
            if self.broken is not None:
                raise self.broken
            self._waiting.append(future)
            try:
                await self._call.write(pb.LeaseKeepAliveRequest(lease=lease))
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
                # The call ended under us: this stream is done, the caller opens another.
                error = e if isinstance(e, grpc.aio.AioRpcError) else _ended()
                self._give_up(future, error)
                raise error from None
            except asyncio.CancelledError:
                # Whether the request went out is unknown, so replies can no longer be
                # paired with requests: end this stream.
                self._give_up(future, _ended())
                raise
        return await future

    def _give_up(self, future: asyncio.Future[pb.LeaseKeepAliveReply], why: grpc.RpcError) -> None:
        # The reader may have paired it with a reply already (the reply came back while
        # the write was being cancelled, e.g. by the caller's deadline after a SIGSTOP).
        if future in self._waiting:
            self._waiting.remove(future)
        future.cancel()
        self.broken = why
        self._call.cancel()

    async def _read(self) -> None:
        try:
            async for reply in self._call:
                if not self._waiting:  # the reply of a send that gave up: stream is done
                    break
                future = self._waiting.popleft()
                if not future.done():  # its sender may have given up
                    future.set_result(reply)
            self.broken = _ended()
        except grpc.aio.AioRpcError as e:
            self.broken = e
        for future in self._waiting:
            if not future.done():
                future.set_exception(self.broken)
        self._waiting.clear()

    def close(self) -> None:
        self._call.cancel()
        self._reader.cancel()


def _refused(error: grpc.RpcError) -> bool:
    return "connection refused" in (error.details() or "").lower()


def _ended() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details="the keep-alive stream ended",
    )
