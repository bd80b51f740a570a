"""The etcd-like service of the store server: what the rendezvous calls.

Prefix reads go out in pages of at most `PAGE_KEYS` keys or about `PAGE_BYTES`
(`RangePages`), each encoded in its caller's turn; a watch's replies are encoded once
per revision and key, however many watch it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc

from elasticrun.errors import CompactedError, ElasticrunError, LeaseExpiredError, StoreLimitError, StoreRequestError
from elasticrun.proto import store_pb2 as pb
from elasticrun.proto import store_pb2_grpc as pb_grpc
from elasticrun.store.interface import EventType, KeyValue, WatchEvent
from elasticrun.store.server.admission import CALLER, encode
from elasticrun.store.server.limits import PAGE_BYTES, PAGE_KEYS
from elasticrun.store.server.service_host import ServiceHost
from elasticrun.store.server.status_codes import status_of, unary


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
    """`kvs` in reply pages (one, empty, for none), each found when it is asked for.

    The work of each step is that of one page, however many keys there are."""
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
        token_unused=CALLER.get().needless_token,
    )


class StoreService(pb_grpc.StoreServicer):
    def __init__(self, server: ServiceHost) -> None:
        self._server = server
        self._engine = server.engine
        self._confirm = self._reply().SerializeToString()
        #: Encoded watch replies of the latest revision sent, by (key, prefix).
        self._cache: dict[tuple[str, bool], bytes] = {}
        self._cache_revision = 0

    @unary
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
            await context.abort(status_of(e), str(e))
        turn = self._server.shares.turn
        caller = CALLER.get()
        for page in _pages(result.kvs):
            async with turn(caller):  # the page's write too: its identity's one page in flight
                await context.write(encode(_range_reply(page, result.revision, self._server.hosted_by_agent)))

    @unary
    async def Put(self, request: pb.PutRequest, context: object) -> pb.PutReply:
        revision = await self._engine.put(request.key, request.value, lease=request.lease)
        return pb.PutReply(revision=revision)

    @unary
    async def DeleteRange(
        self, request: pb.DeleteRangeRequest, context: object
    ) -> pb.DeleteRangeReply:
        if request.prefix:
            deleted = await self._engine.delete_prefix(request.key)
        else:
            deleted = int(await self._engine.delete(request.key))
        return pb.DeleteRangeReply(deleted=deleted)

    @unary
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

    @unary
    async def CompareAndDelete(
        self, request: pb.CompareAndDeleteRequest, context: object
    ) -> pb.CompareReply:
        done = await self._engine.compare_and_delete(
            request.key, expected_mod_revision=request.expected_mod_revision
        )
        return pb.CompareReply(succeeded=done)

    @unary
    async def LeaseGrant(self, request: pb.LeaseGrantRequest, context: object) -> pb.LeaseGrantReply:
        # Only admin callers reach this (`callers.permits`): the leases are the agents'.
        return pb.LeaseGrantReply(lease=await self._engine.grant_lease(request.ttl_seconds))

    async def LeaseKeepAlive(
        self,
        request_iterator: AsyncIterator[pb.LeaseKeepAliveRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.LeaseKeepAliveReply]:
        async with self._server.long_call(context):
            async for request in request_iterator:
                try:
                    await self._engine.keep_alive(request.lease)
                    ttl = self._engine.lease_ttl(request.lease)
                except LeaseExpiredError:
                    yield pb.LeaseKeepAliveReply(lease=request.lease, expired=True)
                else:
                    yield pb.LeaseKeepAliveReply(lease=request.lease, ttl_seconds=ttl)

    @unary
    async def LeaseRevoke(
        self, request: pb.LeaseRevokeRequest, context: object
    ) -> pb.LeaseRevokeReply:
        await self._engine.revoke_lease(request.lease)
        return pb.LeaseRevokeReply()

    async def Watch(self, request: pb.WatchRequest, context: grpc.aio.ServicerContext) -> None:
        # Replies go out pre-serialized (the handler has no response serializer): a
        # change seen by 1,000 watchers of one key is encoded once, not 1,000 times.
        write = context.write
        caller = CALLER.get()
        turn = self._server.shares.turn
        async with self._server.counted_watch(context), self._server.long_call(context):
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
                await context.abort(status_of(e), str(e))

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
