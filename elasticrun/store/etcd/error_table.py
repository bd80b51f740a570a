"""etcd's gRPC errors, classified by one table, and the errors a user sees for them.

`classify` turns a status and its details into a `Kind`: what to do about it (try
another member, authenticate again, give up with our error). `store_error` makes the
final error, naming the endpoint and the --rdzv-conf setting to check.
"""

from __future__ import annotations

import enum

import grpc
import grpc.aio

from elasticrun.errors import (
    LeaseExpiredError,
    StoreAuthError,
    StoreError,
    StoreLimitError,
    StorePermissionError,
    StoreRequestError,
)
from elasticrun.store.wire import DEFAULT_ETCD_PORT


class Kind(enum.Enum):
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
_ERROR_TABLE: tuple[tuple[grpc.StatusCode, str, Kind], ...] = (
    (grpc.StatusCode.UNAVAILABLE, "http1", Kind.NOT_ETCD),
    (grpc.StatusCode.UNAVAILABLE, "failed parsing http/2", Kind.NOT_ETCD),
    (grpc.StatusCode.UNAVAILABLE, "ssl", Kind.TLS),
    (grpc.StatusCode.UNAVAILABLE, "handshake", Kind.TLS),
    (grpc.StatusCode.UNAVAILABLE, "certificate", Kind.TLS),
    (grpc.StatusCode.UNAVAILABLE, "tsi_", Kind.TLS),  # e.g. our client certificate refused
    (grpc.StatusCode.UNAVAILABLE, "", Kind.TRANSIENT),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "", Kind.TRANSIENT),
    # Our deadline, as seen (and reported first) by the etcd server.
    (grpc.StatusCode.UNKNOWN, "context deadline exceeded", Kind.TRANSIENT),
    # etcd's back-pressure when its applied index trails the committed one by 5,000
    # entries (a burst of thousands of nodes registering at once): try again after a
    # pause. etcd 3.4 sends it with code UNKNOWN (seen at 10,000 nodes on 16 cores), the
    # error's documented code is RESOURCE_EXHAUSTED: both are the same overload.
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "too many requests", Kind.TRANSIENT),
    (grpc.StatusCode.UNKNOWN, "too many requests", Kind.TRANSIENT),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "", Kind.LIMIT),
    (grpc.StatusCode.UNAUTHENTICATED, "invalid auth token", Kind.TOKEN_EXPIRED),
    (grpc.StatusCode.INVALID_ARGUMENT, "revision of auth store is old", Kind.TOKEN_EXPIRED),
    (grpc.StatusCode.INVALID_ARGUMENT, "user name is empty", Kind.AUTH_REQUIRED),
    (grpc.StatusCode.INVALID_ARGUMENT, "authentication failed", Kind.AUTH_FAILED),
    (grpc.StatusCode.INVALID_ARGUMENT, "too large", Kind.LIMIT),
    (grpc.StatusCode.INVALID_ARGUMENT, "too many operations", Kind.LIMIT),
    (grpc.StatusCode.INVALID_ARGUMENT, "key is not provided", Kind.REQUEST),
    (grpc.StatusCode.UNAUTHENTICATED, "", Kind.AUTH_FAILED),
    (grpc.StatusCode.PERMISSION_DENIED, "", Kind.PERMISSION),
    (grpc.StatusCode.FAILED_PRECONDITION, "authentication is not enabled", Kind.AUTH_DISABLED),
    (grpc.StatusCode.NOT_FOUND, "lease not found", Kind.LEASE_GONE),
    (grpc.StatusCode.UNIMPLEMENTED, "", Kind.NOT_ETCD),
)


#: Failures of one member's setup: the others may be fine, so fail over; give up at once
#: only when every endpoint failed this way.
WRONG_ENDPOINT = frozenset({Kind.TLS, Kind.NOT_ETCD})


def classify(code: grpc.StatusCode, details: str) -> Kind:
    text = details.lower()
    for table_code, needle, kind in _ERROR_TABLE:
        if code == table_code and needle in text:
            return kind
    return Kind.OTHER


class StreamFailure(grpc.RpcError):
    """A shared stream's end (or its silence), as the status its waiters see."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.status, self.text = code, details


def rpc_facts(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, StreamFailure):
        return exc.status, exc.text
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or ""
    # Every RpcError grpc raises from a call is also a grpc.Call carrying these.
    if isinstance(exc, grpc.Call):
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.UNKNOWN, str(exc)


def store_error(
    kind: Kind, details: str, endpoint: str, *, user: str | None, lease: int
) -> StoreError:
    """The error a user sees for a final (not retried) failure at `endpoint`."""
    conf = "--rdzv-conf"
    if kind is Kind.TLS:
        return StoreAuthError(
            f"TLS handshake with etcd at {endpoint} failed ({details}): check ca_cert, "
            f"client_cert and client_key in {conf} against the etcd server's certificates"
        )
    if kind is Kind.NOT_ETCD:
        return StoreError(
            f"{endpoint} is not an etcd v3 server ({details}): --rdzv-backend=etcd needs "
            f"etcd >= 3.4 and --rdzv-endpoint naming its client port (usually {DEFAULT_ETCD_PORT})"
        )
    if kind is Kind.AUTH_REQUIRED:
        return StoreAuthError(
            f"etcd at {endpoint} requires authentication: set user and password_file "
            f"or password_env in {conf}"
        )
    if kind in (Kind.AUTH_FAILED, Kind.TOKEN_EXPIRED):
        who = f"user {user!r}" if user is not None else "an anonymous client"
        return StoreAuthError(
            f"etcd at {endpoint} refused {who} ({details}): check user and "
            f"password_file/password_env in {conf} and the user's role on the key prefix"
        )
    if kind is Kind.PERMISSION:
        who = f"user {user!r}" if user is not None else "an anonymous client"
        return StorePermissionError(
            f"etcd at {endpoint} refused {who} the request ({details}): its roles do not allow it "
            "(`elasticrun store etcd-roles` sets up the admin and reader roles)"
        )
    if kind is Kind.AUTH_DISABLED:
        return StoreAuthError(
            f"etcd at {endpoint} has authentication disabled but {conf} sets user "
            f"{user!r}: remove user and password_file/password_env, or enable auth on etcd"
        )
    if kind is Kind.LEASE_GONE:
        return LeaseExpiredError(lease)
    if kind is Kind.LIMIT:
        return StoreLimitError(f"etcd at {endpoint} refused a request over a limit: {details}")
    if kind is Kind.REQUEST:
        return StoreRequestError(f"etcd at {endpoint} refused the request: {details}")
    return StoreError(f"etcd at {endpoint} failed: {details}")


def classify_cancel(reason: str) -> Kind:
    """Watch cancel reasons are the texts of etcd's gRPC errors, without their codes."""
    text = reason.lower()
    if "permission denied" in text or "auth" in text:
        return Kind.AUTH_FAILED
    return Kind.OTHER
