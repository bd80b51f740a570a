"""ServiceHost: what the store's gRPC services need of the server that hosts them.

The services (`kv_service.py`, `c10d_service.py`) are built by `StoreServer` and call
back into it: the engine, the callers' shares, the tracking of long calls that `stop()`
must end. Typed against this protocol, they never import the server module, which
imports them: the dependency goes one way (the import contract `no-cycles`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import grpc

from elasticrun.proto import store_pb2 as pb
from elasticrun.store.server.callers import Shares
from elasticrun.store.server.memory import MemoryStore, SpaceQuota


class ServiceHost(Protocol):
    """The server side of a service: `StoreServer` is the one implementation."""

    engine: MemoryStore
    shares: Shares
    quota: SpaceQuota
    hosted_by_agent: bool

    def long_call(self, context: grpc.aio.ServicerContext) -> contextlib.AbstractAsyncContextManager[None]:
        """Track a call that may run for long (watch, wait) so that stop() can end it."""

    def counted_watch(self, context: grpc.aio.ServicerContext) -> contextlib.AbstractAsyncContextManager[None]:
        """Count a watch against its caller's share for as long as it runs."""

    async def encoded(self, reply: Callable[[], pb.RangeReply | pb.MultiGetReply]) -> bytes:
        """The message `reply` makes, encoded in the caller's turn."""
