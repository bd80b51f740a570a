"""The blocking client of the built-in store server: `C10dClient`, the c10d operations.

Training scripts reach it through `elasticrun.worker.c10d_store` (a torch `Store`). It
loads only what talking to the server needs (`store/client/dial.py`, `store/wire.py`, the
generated stubs), never the server, its in-memory engine or the async client, so
importing it costs a worker little.

Like the async client, a call that finds the server unreachable is retried with backoff
until `timeout`, then fails with StoreUnavailableError naming host:port; a client whose
TLS the server refuses (plaintext to a TLS server, a client certificate it does not
take) gets StoreAuthError at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from elasticrun.errors import StoreTimeoutError
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
from elasticrun.store.wire import DEFAULT_TIMEOUT, TlsKeyPair

_T = TypeVar("_T")


class C10dClient:
    """The c10d operations of the store server, blocking (for training scripts).

    Keys are str, values bytes; waiting calls take their own timeout in seconds (0: no
    limit) on top of `timeout`, which bounds reaching the server. TLS as `GrpcStore`:
    `tls_ca` the CA to trust, `client_tls` the certificate to present.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        token: str | None = None,
        tls_ca: bytes | None = None,
        client_tls: TlsKeyPair | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self._dial = Dial(endpoint, token=token, tls_ca=tls_ca, client_tls=client_tls, timeout=timeout)
        self.endpoint = endpoint
        self.timeout = timeout
        self._channel = self._dial.channel()
        self._stub = pb_grpc.C10dStoreStub(self._channel)

    def _call(
        self, method: Callable[..., _T], request: object, wait: float | None = None
    ) -> _T:
        """One call, retried with backoff while the server is unreachable.

        `wait` is how long the server may hold a waiting call (0: no limit); the
        deadline is that plus `timeout`, and the retries stop after `timeout`.
        """
        retries = Backoff(self.timeout)
        deadline = None if wait == 0 else retries.deadline + (wait or 0.0)
        while True:
            try:
                return method(
                    request,
                    timeout=None if deadline is None else max(deadline - time.monotonic(), 0.0),
                    metadata=self._dial.metadata,
                )
            except grpc.RpcError as e:
                if foreign(e):
                    raise foreign_error(e, self.endpoint, etcd=self._answers_etcd(e)) from None
                refusal = self._dial.tls_refusal() if hung_up(e) else None
                if refusal is not None:
                    raise refusal from None
                if not retryable(e) or retries.out_of_time():
                    raise error_from(e, self.endpoint) from None
            time.sleep(retries.pause())

    def _answers_etcd(self, error: grpc.RpcError) -> bool:
        """Whether the gRPC server that lacks our service is etcd (asked without our token)."""
        if error.code() is not grpc.StatusCode.UNIMPLEMENTED:
            return False
        try:
            self._channel.unary_unary(ETCD_STATUS_METHOD)(b"", timeout=PROBE_TIMEOUT)
        except grpc.RpcError:
            return False
        return True

    def _timed_out(self, keys: list[str], timeout: float) -> StoreTimeoutError:
        return StoreTimeoutError(
            f"keys {keys} did not all appear in the store at {self.endpoint} "
            f"within {timeout:g} s"
        )

    def set(self, key: str, value: bytes) -> None:
        self._call(self._stub.Set, pb.SetRequest(key=key, value=value))

    def get(self, key: str, timeout: float) -> bytes:
        """The key's value, once it exists (StoreTimeoutError past `timeout`)."""
        reply: pb.GetReply = self._call(self._stub.Get, pb.GetRequest(key=key, timeout_seconds=timeout), timeout)
        if reply.timed_out:
            raise self._timed_out([key], timeout)
        return reply.value

    def add(self, key: str, amount: int) -> int:
        reply: pb.AddReply = self._call(self._stub.Add, pb.AddRequest(key=key, amount=amount))
        return reply.value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        request = pb.CompareSetRequest(key=key, expected=expected, desired=desired)
        reply: pb.CompareSetReply = self._call(self._stub.CompareSet, request)
        return reply.value

    def wait(self, keys: list[str], timeout: float) -> None:
        reply = self._call(
            self._stub.Wait, pb.WaitRequest(keys=keys, timeout_seconds=timeout), timeout
        )
        if reply.timed_out:
            raise self._timed_out(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        reply: pb.CheckReply = self._call(self._stub.Check, pb.CheckRequest(keys=keys))
        return reply.ready

    def num_keys(self) -> int:
        reply: pb.NumKeysReply = self._call(self._stub.NumKeys, pb.NumKeysRequest())
        return reply.count

    def delete_key(self, key: str) -> bool:
        reply: pb.DeleteKeyReply = self._call(self._stub.DeleteKey, pb.DeleteKeyRequest(key=key))
        return reply.deleted

    def multi_get(self, keys: list[str], timeout: float) -> list[bytes]:
        reply = self._call(
            self._stub.MultiGet, pb.MultiGetRequest(keys=keys, timeout_seconds=timeout), timeout
        )
        if reply.timed_out:
            raise self._timed_out(keys, timeout)
        return list(reply.values)

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._call(self._stub.MultiSet, pb.MultiSetRequest(keys=keys, values=values))

    def close(self) -> None:
        self._channel.close()
