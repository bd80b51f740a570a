"""The key-value store interface that the rendezvous is written against.

It is the etcd v3 model cut down to what a rendezvous needs: revisioned keys, prefix
reads, compare-and-put on a key's modification revision, leases with a TTL, and ordered
watches that can resume from a revision. Every backend (in-memory, the built-in gRPC
store, etcd) implements exactly this, so the rendezvous code exists once; the contract
test suite (`tests/test_store_contract.py`) holds every implementation to it.

Keys are `str`, values are `bytes`. Revisions are store-wide and strictly increasing:
every successful write (put or delete, including a lease expiry that deletes keys)
increments the store revision and stamps the keys it touched with it.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from elasticrun.errors import StoreRequestError

#: The longest lease TTL granted: etcd's own (`MaxLeaseTTL`, about 285 years), so a TTL
#: one backend accepts the other does too; anything longer is a mistake of units or a
#: value that no longer fits a deadline (1e300 s).
MAX_LEASE_TTL = 9_000_000_000.0


def check_lease_ttl(ttl: float) -> float:
    """A TTL every backend grants alike, or the StoreRequestError that says why not."""
    if not 0 < ttl <= MAX_LEASE_TTL:
        raise StoreRequestError(
            f"a lease TTL must be a positive number of seconds up to {MAX_LEASE_TTL:.0f} (etcd's limit), got {ttl}"
        )
    return ttl


@dataclass(frozen=True, slots=True)
class KeyValue:
    """A key as read from the store."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int  # number of writes since creation, 1 for a new key
    lease: int  # 0 when the key is not bound to a lease


@dataclass(frozen=True, slots=True)
class RangeResult:
    """Keys read together, and the store revision they were read at.

    Watching from `revision + 1` afterwards sees every change after this read, with no
    gap and no duplicate: the read-then-watch pattern that every watcher uses.
    """

    kvs: tuple[KeyValue, ...]
    revision: int


class EventType(enum.Enum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change to one key. `value` is empty for a DELETE."""

    type: EventType
    key: str
    value: bytes
    revision: int


class Store(abc.ABC):
    """An etcd-like key-value store, used from asyncio.

    Errors: `StoreUnavailableError` when the store cannot be reached within the
    implementation's deadline, `StoreAuthError` when it refuses us,
    `StoreLimitError` for a request over the store's bounds, `LeaseExpiredError` for a
    lease that is gone, `CompactedError` for a watch from a revision no longer kept.
    """

    #: Where the store is, for error messages ("127.0.0.1:29400", "memory").
    endpoint: str

    @abc.abstractmethod
    async def get(self, key: str) -> KeyValue | None:
        """The key, or None when it does not exist."""

    @abc.abstractmethod
    async def get_prefix(self, prefix: str) -> RangeResult:
        """Every key starting with `prefix`, sorted by key, and the store revision."""

    @abc.abstractmethod
    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Write the key (bound to `lease` when non-zero); return the new revision."""

    @abc.abstractmethod
    async def compare_and_put(
        self, key: str, value: bytes, *, expected_mod_revision: int, lease: int = 0
    ) -> bool:
        """Write the key only if its mod_revision is `expected_mod_revision`.

        `expected_mod_revision=0` means "only if the key does not exist" (create).
        Returns whether the write happened. Atomic with respect to every other writer.
        """

    @abc.abstractmethod
    async def delete(self, key: str) -> bool:
        """Delete the key; return whether it existed."""

    @abc.abstractmethod
    async def compare_and_delete(self, key: str, *, expected_mod_revision: int) -> bool:
        """Delete the key only if its mod_revision is `expected_mod_revision`."""

    @abc.abstractmethod
    async def delete_prefix(self, prefix: str) -> int:
        """Delete every key starting with `prefix`; return how many were deleted."""

    @abc.abstractmethod
    async def grant_lease(self, ttl: float) -> int:
        """Create a lease that expires `ttl` seconds from now unless kept alive.

        Backends with whole-second TTLs (etcd) round up.
        """

    @abc.abstractmethod
    async def keep_alive(self, lease: int) -> None:
        """Reset the lease's TTL. Raises LeaseExpiredError when the lease is gone."""

    @abc.abstractmethod
    async def revoke_lease(self, lease: int) -> None:
        """End the lease now, deleting its keys. A lease already gone is not an error."""

    @abc.abstractmethod
    def watch(
        self, key: str, *, start_revision: int, prefix: bool = False
    ) -> AsyncIterator[WatchEvent]:
        """Changes to `key` (or every key under it when `prefix`), in revision order.

        Starts with the changes at `start_revision` and later that the store still
        keeps (CompactedError when it no longer does), then follows live changes for
        as long as the caller iterates. A transient loss of the connection is hidden:
        the implementation resumes from the last delivered revision, so no event is
        lost or repeated. The caller stops watching by leaving the `async for` (or
        cancelling the task that runs it).
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections. Leases are not revoked: they expire on their own."""

    async def turn_to(self, endpoints: Sequence[str]) -> str:
        """Go on with the first of `endpoints` whose store serves now; its endpoint ("": none).

        For a store that an agent hosted and that is gone (`StoreGoneError`): the
        job's successors (docs/concepts.md) take it over at their own endpoints. Every
        other store stays where it is and says "".
        """
        return ""

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
