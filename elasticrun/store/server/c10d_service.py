"""The c10d operations of the store server: what the workers' torch Store calls.

Requests whose work grows with a key list (check, wait, multi_get, multi_set) are
parsed, bounded and looked up by the handler, in the caller's turn (`Shares.turn`).
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar, cast

import grpc

from elasticrun.errors import StoreLimitError, StoreRequestError
from elasticrun.proto import store_pb2 as pb
from elasticrun.proto import store_pb2_grpc as pb_grpc
from elasticrun.store.credentials import Role, worker_prefix
from elasticrun.store.interface import EventType, KeyValue
from elasticrun.store.server.admission import CALLER, encode
from elasticrun.store.server.limits import (
    KEY_LIST_LOOP_SHARE,
    MAX_KEYS_PER_CALL,
    MAX_MULTI_GET_BYTES,
    MAX_MULTI_SET_KEYS,
)
from elasticrun.store.server.memory import SpaceQuota
from elasticrun.store.server.service_host import ServiceHost
from elasticrun.store.server.status_codes import unary


class C10dService(pb_grpc.C10dStoreServicer):
    """torch.distributed.Store semantics over the engine.

    Engine calls never suspend, so a read followed by a write with no other await in
    between (add, compare_set) is atomic, as TCPStore's single-threaded daemon is.
    Values of `add` are decimal ASCII, as TCPStore stores them.

    An admin caller's keys are the engine's own. A worker's are its job's (`_Keys`):
    each key it names lives under `/elasticrun/<job>/w/`, `num_keys` counts those only,
    and its writes keep to the server's quota for worker credentials.
    """

    def __init__(self, server: ServiceHost) -> None:
        self._server = server
        self._engine = server.engine

    def _keys(self) -> _Keys:
        grant = CALLER.get().grant
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
        """The caller's turn (`Shares.turn`; admin: at once) for a step whose work grows with a key list.

        One such step of an identity's at a time, and after each, a pause in its turn so
        that its steps take at most KEY_LIST_LOOP_SHARE of the loop's time, however many
        of its calls wait. (A step is a few milliseconds; a put takes a few passes of
        the loop, so steps back to back would delay each of them by one.)"""
        caller = CALLER.get()
        async with self._server.shares.turn(caller):
            start = time.perf_counter()
            yield
            if caller.limited:
                await asyncio.sleep((time.perf_counter() - start) * (1 / KEY_LIST_LOOP_SHARE - 1))

    def _key_list(self, names: list[str], what: str) -> list[str]:
        """The engine's keys for the c10d keys `names`, each once, in first-named order.

        A list longer than MAX_KEYS_PER_CALL is refused. (C loops only: a list of 10,000
        keys takes about a millisecond.)"""
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

        Each look at them all is one pass with no suspension (a consistent snapshot), in
        the caller's turn when `in_turn`."""
        async with self._server.long_call(context):
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

    @unary
    async def Set(self, request: pb.SetRequest, context: object) -> pb.SetReply:
        keys = self._keys()
        await self._engine.put(keys.of(request.key), request.value, quota=keys.quota)
        return pb.SetReply()

    @unary
    async def Get(
        self, request: pb.GetRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetReply:
        key = self._keys().of(request.key)
        kvs = await self._await_keys([key], request.timeout_seconds, context, in_turn=False)
        if kvs is None:
            return pb.GetReply(timed_out=True)
        return pb.GetReply(value=kvs[0].value)

    @unary
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

    @unary
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

    @unary
    async def Wait(self, data: bytes, context: grpc.aio.ServicerContext) -> pb.WaitReply:
        async with self._turn():
            request = _parse(pb.WaitRequest, data)
            keys = self._key_list(list(request.keys), "wait")
        kvs = await self._await_keys(keys, request.timeout_seconds, context)
        return pb.WaitReply(timed_out=kvs is None)

    @unary
    async def Check(self, data: bytes, context: object) -> pb.CheckReply:
        async with self._turn():
            keys = self._key_list(list(_parse(pb.CheckRequest, data).keys), "check")
            return pb.CheckReply(ready=all(self._engine.entries(keys)))

    @unary
    async def NumKeys(self, request: pb.NumKeysRequest, context: object) -> pb.NumKeysReply:
        job = self._keys().job
        return pb.NumKeysReply(count=len(self._engine) if job is None else self._engine.worker_keys(job))

    @unary
    async def DeleteKey(
        self, request: pb.DeleteKeyRequest, context: object
    ) -> pb.DeleteKeyReply:
        return pb.DeleteKeyReply(deleted=await self._engine.delete(self._keys().of(request.key)))

    @unary
    async def MultiGet(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async with self._turn():
            request = _parse(pb.MultiGetRequest, data)
            names = list(request.keys)
            keys = self._key_list(names, "multi_get")
        found = await self._await_keys(keys, request.timeout_seconds, context)
        if found is None:
            return encode(pb.MultiGetReply(timed_out=True))
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

    @unary
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
    """Where a c10d caller's keys live.

    The engine's own (admin), or a job's worker namespace (`prefix`), with the quota its
    writes keep to."""

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
