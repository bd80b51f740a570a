"""Blocking, thread-safe access to an etcd cluster's members: failover, TLS, auth.

`Cluster` keeps one channel per member and the current one, fails over on a transient
error (`_Attempts`: one operation's tries, its deadline, the pauses between), fetches a
user's token lazily and again when a member no longer knows it, and maps a final
failure to our error (`store/etcd/error_table.py`). `EtcdStore` (`store/etcd/backend.py`) drives it
from asyncio.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
from pyetcd import etcdrpc

from elasticrun.errors import StoreError, StoreUnavailableError
from elasticrun.store.backoff import Backoff
from elasticrun.store.client.dial import plain_cause
from elasticrun.store.etcd.error_table import WRONG_ENDPOINT, Kind, classify, rpc_facts, store_error
from elasticrun.store.wire import TlsKeyPair

_T = TypeVar("_T")

Metadata = tuple[tuple[str, str], ...]
_Rpc = Callable[["Stubs", float, Metadata], _T]

CHANNEL_OPTIONS = (
    # Pings find a member that vanished without closing the connection (a partition).
    # etcd refuses pings more frequent than every 5 s by default.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # A restarted member must become usable again within a second, not minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
)
_RETRY_PAUSE_FIRST = 0.05
_RETRY_PAUSE_MAX = 0.5
#: A request a follower forwarded to a leader that just died is never answered: etcd
#: only gives up on it after 5 s. So the first try of an operation is cut short, and
#: each try that runs out doubles the next one, for a slow but healthy cluster.
FIRST_ATTEMPT_TIMEOUT = 1.0


@dataclass(frozen=True, slots=True)
class Stubs:
    """One endpoint's blocking channel: for authenticating, the one blocking call.

    Every other call goes on the endpoint's grpc.aio channel (`store/etcd/backend.py`);
    this one names the endpoint for failover and carries the call that runs on the
    store's threads."""

    endpoint: str
    channel: grpc.Channel
    auth: etcdrpc.AuthStub

    @classmethod
    def open(cls, endpoint: str, credentials: grpc.ChannelCredentials | None) -> Stubs:
        if credentials is None:
            channel = grpc.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
        else:
            channel = grpc.secure_channel(endpoint, credentials, options=CHANNEL_OPTIONS)
        return cls(endpoint, channel, etcdrpc.AuthStub(channel))


@dataclass(slots=True)
class _Attempts:
    """One operation's tries: its deadline, why each endpoint failed, the next pause."""

    endpoint_list: str
    endpoint_count: int
    #: the operation's deadline, and the pauses once every endpoint failed in a row
    backoff: Backoff
    tls: bool
    causes: dict[str, str] = field(default_factory=dict)
    in_a_row: int = 0
    attempt_timeout: float = FIRST_ATTEMPT_TIMEOUT
    renewed_token: bool = False
    #: the error of each endpoint found to be no (usable) etcd server
    wrong: dict[str, StoreError] = field(default_factory=dict)

    def next_timeout(self) -> float:
        """The deadline of the next try, or StoreUnavailableError when time is up."""
        return min(self._remaining(), self.attempt_timeout)

    def _remaining(self) -> float:
        left = self.backoff.left()
        if left <= 0:
            cause = "; ".join(f"{ep}: {why}" for ep, why in self.causes.items())
            if not self.tls and "socket closed" in cause.lower():
                # What a plain client sees of a server that wants TLS.
                cause += " (if etcd serves clients over TLS, set ca_cert in --rdzv-conf)"
            raise StoreUnavailableError(self.endpoint_list, cause or "timed out")
        return left

    def failed(self, endpoint: str, details: str, *, timed_out: bool) -> float:
        """Note the failure; return the pause before the next try.

        A pause only once every endpoint failed in a row (bounded, growing); else none.
        The pause is drawn from its upper half: thousands of nodes refused in the same
        instant (etcd's "too many requests") must not all come back in the same instant."""
        self.causes[endpoint] = plain_cause(details)
        if timed_out:
            self.attempt_timeout *= 2
        self.in_a_row += 1
        if self.in_a_row % self.endpoint_count:
            return 0.0
        return min(self.backoff.pause() * random.uniform(0.5, 1.0), self.backoff.left())


def _timed_out(code: grpc.StatusCode, details: str) -> bool:
    """Whether the try ran out of time (the next one gets longer), rather than being refused."""
    return code is grpc.StatusCode.DEADLINE_EXCEEDED or "deadline exceeded" in details.lower()


class Cluster:
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
        self._stubs = [Stubs.open(ep, credentials) for ep in endpoints]
        self._tls = credentials is not None
        self._lock = threading.Lock()
        self._current = 0
        self._token: str | None = None
        self.credentials = credentials

    def attempts(self, first_timeout: float = FIRST_ATTEMPT_TIMEOUT) -> _Attempts:
        backoff = Backoff(self.timeout, first=_RETRY_PAUSE_FIRST, longest=_RETRY_PAUSE_MAX)
        return _Attempts(self.endpoint_list, len(self._stubs), backoff, self._tls, attempt_timeout=first_timeout)

    def current(self) -> Stubs:
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
                code, details = rpc_facts(exc)
                time.sleep(self.recover(stubs, code, details, attempts, lease=lease))

    def recover(
        self,
        stubs: Stubs,
        code: grpc.StatusCode,
        details: str,
        attempts: _Attempts,
        *,
        lease: int = 0,
    ) -> float:
        """Get ready for the next attempt after a failure on `stubs`, or raise.

        Returns how long to pause first. It never blocks: the async callers pause on
        their loop, not on the store's few threads, where a pause queued every other
        operation's recovery behind it (docs/architecture.md, Design notes, "Leases
        under load")."""
        kind = classify(code, details)
        if kind in WRONG_ENDPOINT:
            attempts.wrong[stubs.endpoint] = self.error(kind, details, stubs.endpoint)
            if len(attempts.wrong) == attempts.endpoint_count:
                raise next(iter(attempts.wrong.values()))
        if kind is Kind.TRANSIENT or kind in WRONG_ENDPOINT:
            self._fail_over(stubs)
            return attempts.failed(stubs.endpoint, details, timed_out=_timed_out(code, details))
        if kind is Kind.TOKEN_EXPIRED and self.user is not None and not attempts.renewed_token:
            attempts.renewed_token = True
            self._token = None
            return 0.0
        raise self.error(kind, details, stubs.endpoint, lease=lease)

    def known_metadata(self) -> Metadata | None:
        """The token header without authenticating: None when a token must be fetched."""
        if self.user is None:
            return ()
        token = self._token
        return None if token is None else (("token", token),)

    def metadata(self, stubs: Stubs, timeout: float) -> Metadata:
        """The token header, authenticating on `stubs` first when there is none."""
        if self.user is None:
            return ()
        token = self._token
        if token is None:
            request = etcdrpc.AuthenticateRequest(name=self.user, password=self._password)
            token = stubs.auth.Authenticate(request, timeout=timeout).token
            self._token = token
        return (("token", token),)

    def error(self, kind: Kind, details: str, endpoint: str, *, lease: int = 0) -> StoreError:
        return store_error(kind, details, endpoint, user=self.user, lease=lease)

    def _fail_over(self, failed: Stubs) -> None:
        """Move to the next endpoint, unless another thread already moved past `failed`."""
        with self._lock:
            if self._stubs[self._current] is failed:
                self._current = (self._current + 1) % len(self._stubs)

    def close(self) -> None:
        for stubs in self._stubs:
            stubs.channel.close()


def channel_credentials(tls_ca: bytes | None, client: TlsKeyPair | None) -> grpc.ChannelCredentials | None:
    if tls_ca is None and client is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=tls_ca,
        private_key=client.key if client else None,
        certificate_chain=client.cert if client else None,
    )
