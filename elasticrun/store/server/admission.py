"""How a call reaches its handler.

Its caller known from its headers before its message is read, a request that does not
decode refused in one line.

`add_store_service` and `add_c10d_service` register the generated services' handlers,
each wrapped by `_guarded`, so that nothing is spent on a call before its caller is
known (`StoreServer.counted_call`, given as `count`, which sets `CALLER` for the
handler).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
from collections.abc import AsyncIterator, Callable

import grpc

from elasticrun.proto import store_pb2 as pb
from elasticrun.proto import store_pb2_grpc as pb_grpc
from elasticrun.store.server.callers import Caller
from elasticrun.store.server.limits import MAX_KEY_LIST_BYTES, MAX_KEYS_PER_CALL, MESSAGE_DEADLINE

#: The caller of the call in progress, set once per call before its handler runs (each
#: call has a task, and so a context, of its own).
CALLER: contextvars.ContextVar[Caller] = contextvars.ContextVar("store_caller")


def encode(reply: pb.RangeReply | pb.MultiGetReply) -> bytes:
    data: bytes = reply.SerializeToString()
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


def add_store_service(servicer: pb_grpc.StoreServicer, server: grpc.aio.Server, count: _CallCounter) -> None:
    capture = _Capture()
    pb_grpc.add_StoreServicer_to_server(servicer, capture)
    _register(server, capture.name, _encoded_by_handler(capture.handlers, "Store"), count)


def add_c10d_service(servicer: pb_grpc.C10dStoreServicer, server: grpc.aio.Server, count: _CallCounter) -> None:
    capture = _Capture()
    pb_grpc.add_C10dStoreServicer_to_server(servicer, capture)
    _register(server, capture.name, _encoded_by_handler(capture.handlers, "C10dStore"), count)


def _encoded_by_handler(handlers: dict[str, grpc.RpcMethodHandler], service: str) -> dict[str, grpc.RpcMethodHandler]:
    """The generated handlers, some with no response serializer or a request deserializer that only bounds.

    Those of `_ENCODED_BY_HANDLER` have no response serializer (their replies go out as
    the bytes the handler made), and those of `_PARSED_BY_HANDLER` a request
    deserializer that only bounds the bytes."""
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
    """A request deserializer that keeps the bytes for the handler, refusing more than `limit` of them.

    The handler parses them; more than `limit` are refused unparsed."""

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
    """A request refused as it was read; its handler answers `code` with `why`.

    Its bytes did not decode (INVALID_ARGUMENT), or there were too many of them."""

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
    """The same method, served so that nothing is spent on a call before its caller is known.

    The call is attributed to its caller from its headers (`count`, which refuses a
    caller that may not make it and counts the call against its share while it runs),
    and only then is its request message read, within `MESSAGE_DEADLINE`.

    - every method is registered as a bidirectional stream, which gRPC hands to its
      handler at once with the message still unread; on the wire a unary call is such a
      stream, so clients see no difference;
    - a request that does not decode gets INVALID_ARGUMENT, where gRPC would answer
      UNKNOWN and log a traceback for each.

    Why, and why not `grpc.aio.ServerInterceptor`: docs/architecture.md, Design notes,
    "A call's caller is known before its message is read"."""
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
    """The call's one request message, once its caller is known.

    A call whose message does not come within `MESSAGE_DEADLINE` of its headers is ended
    (DEADLINE_EXCEEDED), so that a caller cannot hold its calls open without sending
    anything."""
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
