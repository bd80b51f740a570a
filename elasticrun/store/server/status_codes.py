"""How the store server's handlers turn our errors into gRPC statuses, in one place.

A store raises `StoreError`s; a unary handler wrapped in `unary` answers them with the
status code `status_of` gives and the error's message, which the clients map back
(`store/client/dial.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from elasticrun.errors import (
    ElasticrunError,
    LeaseExpiredError,
    StoreLimitError,
    StoreRequestError,
    StoreUnavailableError,
)

_T = TypeVar("_T")


def status_of(error: ElasticrunError) -> grpc.StatusCode:
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


def unary(fn: _Handler[_T]) -> _Handler[_T]:
    """Turn our errors raised by a unary handler into a gRPC status with the message."""

    @functools.wraps(fn)
    async def handler(self: object, request: object, context: grpc.aio.ServicerContext) -> _T:
        try:
            return await fn(self, request, context)
        except ElasticrunError as e:
            status, details = status_of(e), str(e)
        # Aborted outside the except clause: the error's traceback (whose frames hold the
        # request, a 1 MiB value, say) is not chained to the abort that grpc keeps, so a
        # refused request is freed at once rather than by a later garbage collection.
        await context.abort(status, details)
        raise AssertionError("unreachable: abort raises")

    return handler
