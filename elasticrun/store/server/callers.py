"""Who calls the store server, what each role may call, and each caller's fair share.

The server attributes every call once, before its handler runs (`identify`): the role
its token and its client certificate grant (`store/credentials.py`; with both, the lesser
wins), and the identity its share is counted by: the credential itself (each job's
worker credential, the admin token; the reader credential, which every reader holds,
with the caller's host), or the certificate's fingerprint when the certificate decides
the role. A store with neither a token nor a client CA
cannot tell its callers apart by anything they hold: they are all admin, identified by
their host.

Admin callers are trusted with everything (they can stop the job outright), and
thousands of agents share the admin token: they are bounded only by the store's totals.
Every other identity gets a fair share (`FairShare`): calls in progress, open watches,
keys and bytes each bounded per identity, and all of them together bounded to a part of
the store's totals, so that whatever the workers and readers do, the rest stays for the
agents. Leases are no one's but the admin's (no other role may grant one).

An identity other than admin also has one reply in the making at a time (`Shares.turn`):
a page of a prefix read, a watch event, a multi_get. However many reads and watches it
runs, a call of anyone else waits for one of its replies at most, not for all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field

from elasticrun.store.credentials import ADMIN, Grant, Role, grant_of_certificate, grant_of_token

#: What each role other than admin may call, by service.
_ALLOWED: Mapping[Role, Mapping[str, frozenset[str] | None]] = {
    Role.READER: {"Store": frozenset({"Range", "RangePages", "Watch"})},
    Role.WORKER: {"C10dStore": None},  # None: every method
}
_MAY = {
    Role.READER: "read keys (Range, Watch)",
    Role.WORKER: "use the c10d operations on its job's own keys",
}


@dataclass(frozen=True, slots=True)
class Caller:
    """The caller of one call: what it may do, and who its share is counted as."""

    grant: Grant
    identity: str
    #: it presented a token to a store that has none (it is told: the token protects nothing)
    needless_token: bool = False

    @property
    def limited(self) -> bool:
        """Whether it has a fair share to keep to (every role but admin)."""
        return self.grant.role is not Role.ADMIN


def identify(
    *, bearer: str | None, token: str | None, certificate: bytes | None, uris: Iterable[str], host: str
) -> Caller | None:
    """The caller of a call, from its `bearer` and, over mutual TLS, its `certificate`; None if refused.

    `bearer` is None without a token; the PEM `certificate` comes with its URI names
    `uris`. None when the store has a `token` and `bearer` is neither it nor a
    credential derived from it."""
    grant, identity = ADMIN, f"host {host}"
    if token is not None:
        by_token = grant_of_token(bearer, token) if bearer is not None else None
        if by_token is None:
            return None
        grant, identity = by_token, _token_identity(by_token, host)
    if certificate is not None:
        by_certificate = grant_of_certificate(uris)
        if token is None or by_certificate.role is not Role.ADMIN or grant.role is Role.ADMIN:
            identity = "certificate " + hashlib.sha256(certificate).hexdigest()[:16]
        grant &= by_certificate
    return Caller(grant, identity, needless_token=token is None and bool(bearer))


def _token_identity(grant: Grant, host: str) -> str:
    """Names the credential without quoting it (identities reach messages).

    A store has one of each but the workers', one per job. Every reader holds the one
    reader credential, so a reader's share is counted by its host as well: one `status
    --watch` user's abuse takes its own host's share, not every reader's."""
    if grant.role is Role.WORKER:
        return f"worker credential of job {grant.job!r}"
    return "admin token" if grant.role is Role.ADMIN else f"reader credential on host {host}"


def permits(grant: Grant, service: str, method: str) -> bool:
    """Whether `grant` may call `service.method`."""
    if grant.role is Role.ADMIN:
        return True
    if grant.role is None:
        return False
    methods = _ALLOWED[grant.role].get(service, frozenset())
    return methods is None or method in methods


def refusal(grant: Grant, service: str, method: str) -> str:
    """The one line that refuses `grant` the call `service.method`."""
    may = _MAY.get(grant.role, "nothing") if grant.role is not None else "nothing"
    return f"this store credential is a {grant.describe()}: it may {may}, not call {service}.{method}"


@dataclass(frozen=True, slots=True)
class FairShare:
    """What each identity other than admin may hold at once, and all of them together.

    The defaults leave a job's workers room for a c10d store of a few thousand ranks (a
    waiting get is a call in progress) and readers a few dozen `logs --follow`.
    """

    #: calls in progress (watches and waits included)
    calls: int = 2_000
    #: open Watch streams
    watches: int = 100
    #: keys and bytes (keys and values) a worker credential may make its job's namespace hold
    keys: int = 10_000
    bytes: int = 64 << 20
    #: the part of the store's calls, keys and bytes that all of them together may take
    share: float = 0.25

    def of(self, total: int) -> int:
        """All limited identities' part of one of the store's totals."""
        return max(1, int(total * self.share))


DEFAULT_FAIR_SHARE = FairShare()


@dataclass(slots=True)
class Counter:
    """What the limited identities hold of one thing (calls, watches), each and in all."""

    what: str
    #: per identity, and all limited identities together
    each: int
    together: int
    held: dict[str, int] = field(default_factory=dict)  # no entry at zero
    total: int = 0

    def take(self, caller: Caller) -> str | None:
        """Take one for `caller`; the refusal's words if that would pass a limit."""
        if not caller.limited:
            return None
        mine = self.held.get(caller.identity, 0)
        if mine >= self.each:
            return f"the {caller.identity} holds its maximum of {self.each} {self.what} (its fair share)"
        if self.total >= self.together:
            return (
                f"workers and readers hold their maximum of {self.together} {self.what} together "
                "(the rest is kept for the agents)"
            )
        self.held[caller.identity] = mine + 1
        self.total += 1
        return None

    def give_back(self, caller: Caller) -> None:
        if not caller.limited:
            return
        left = self.held.pop(caller.identity) - 1
        if left:
            self.held[caller.identity] = left
        self.total -= 1


class Shares:
    """The fair shares of one server: calls and watches held, and turns for replies."""

    def __init__(self, fair: FairShare, max_calls: int) -> None:
        self.fair = fair
        self.calls = Counter("calls in progress", fair.calls, fair.of(max_calls))
        self.watches = Counter("open watches", fair.watches, fair.of(max_calls))
        self._turns: dict[str, tuple[asyncio.Lock, int]] = {}  # lock, holders and waiters

    @contextlib.asynccontextmanager
    async def turn(self, caller: Caller) -> AsyncIterator[None]:
        """Wait until `caller` has no other reply in the making (admin: at once)."""
        if not caller.limited:
            yield
            return
        lock, users = self._turns.get(caller.identity, (asyncio.Lock(), 0))
        self._turns[caller.identity] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._turns[caller.identity]
            if users == 1:
                del self._turns[caller.identity]
            else:
                self._turns[caller.identity] = (lock, users - 1)
