"""First contact with a store.

An answer in a second when nothing can be reached, and a word while reaching it takes
longer.

Every store call that finds its server unreachable is retried until the store's timeout
(`store_timeout`, 10 s): right for an agent, which rides out a store that is starting or
restarting, but a command run by hand that waits ten silent seconds to report that
nothing listens has wasted its user's time. So before its first call a command asks the
network itself: it resolves each endpoint's host and opens a TCP connection to it (and
closes it). A name that does not resolve, or a port that refuses, is an answer at once
for job control (`patient=False`); an agent (`patient=True`) tries again with the
clients' backoff until the store's timeout, as its calls always did. Either way, once a
second has passed without an answer, `say` is told once what is tried and why it has
not answered yet. Then one read through the store's own client proves that a store
answers there: the clients recognise an etcd server or another program (NotAStoreError).

Under a gRPC proxy (grpc_proxy, https_proxy, http_proxy in the environment) the clients
reach the store through the proxy, so the network is not asked directly.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
from collections.abc import Callable, Sequence

from elasticrun.errors import StoreUnavailableError
from elasticrun.store.backoff import Backoff
from elasticrun.store.interface import Store

#: after this long without an answer, a command says what it is connecting to
NOTICE_AFTER = 1.0

#: the least time a try is given, the last one too: a refusal comes back in microseconds
_LAST_TRY = 0.25

#: the variables through which grpc reaches servers by a proxy (either case)
_PROXY_ENV = ("grpc_proxy", "https_proxy", "http_proxy")

#: what to check when nothing answers, for a command run by hand
CHECK = "check --rdzv-endpoint, and that the store is up (the agent on that host, or elasticrun store serve)"


async def first_contact(
    store: Store,
    endpoints: Sequence[str],
    timeout: float,
    probe_key: str,
    *,
    patient: bool,
    say: Callable[[str], None],
) -> None:
    """Return once the store at `endpoints` has answered a read of `probe_key`.

    Raises StoreUnavailableError when nothing can be reached: at once unless `patient`,
    else after `timeout` seconds of trying; and whatever the store's client raises for
    its first call (NotAStoreError, StoreAuthError, ...).
    """
    loop = asyncio.get_running_loop()
    where = ",".join(endpoints)
    tried: list[str] = []  # why the network has not answered yet, the latest last

    def notice() -> None:
        if tried:
            say(f"connecting to the store at {where} ({tried[-1]}); trying again until store_timeout ({timeout:g} s)")
        else:
            say(f"connecting to the store at {where}...")

    handle = loop.call_later(NOTICE_AFTER, notice)
    try:
        if not _proxied():
            await _reach(endpoints, timeout, patient, tried)
        await store.get(probe_key)
    finally:
        handle.cancel()


def _proxied() -> bool:
    return any(os.environ.get(name) or os.environ.get(name.upper()) for name in _PROXY_ENV)


async def _reach(endpoints: Sequence[str], timeout: float, patient: bool, tried: list[str]) -> None:
    """Return once one endpoint takes a TCP connection (see `first_contact`)."""
    retries = Backoff(timeout, clock=asyncio.get_running_loop().time)
    while True:
        cause = await _reach_any(endpoints, max(retries.left(), _LAST_TRY))
        if cause is None:
            return
        tried.append(cause)
        if not patient:
            raise StoreUnavailableError(",".join(endpoints), f"{cause}; {CHECK}")
        left = retries.left()
        if left <= 0:
            raise StoreUnavailableError(",".join(endpoints), f"{cause} (gave up after {timeout:g} s)")
        await asyncio.sleep(min(retries.pause(), left))


async def _reach_any(endpoints: Sequence[str], timeout: float) -> str | None:
    """None when one of `endpoints` takes a connection within `timeout`, else why none did."""
    tries = [asyncio.ensure_future(_reach_one(endpoint)) for endpoint in endpoints]
    causes: dict[str, str] = {}
    try:
        async with asyncio.timeout(timeout):
            for done in asyncio.as_completed(tries):
                endpoint, cause = await done
                if cause is None:
                    return None
                causes[endpoint] = cause
    except TimeoutError:
        causes = {e: causes.get(e, f"no connection within {timeout:g} s (a host that is down, a firewall that drops "
                                            "the packets, or a program that takes no more connections)")
                  for e in endpoints}
    finally:
        for each in tries:
            each.cancel()
    if len(endpoints) == 1:
        return causes[endpoints[0]]
    return "; ".join(f"{endpoint}: {causes[endpoint]}" for endpoint in endpoints)


async def _reach_one(endpoint: str) -> tuple[str, str | None]:
    """(`endpoint`, None) when it takes a TCP connection, else why not."""
    loop = asyncio.get_running_loop()
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    try:
        addresses = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        reason = e.strerror if isinstance(e, socket.gaierror) else str(e)
        return endpoint, f"cannot resolve the host name {host!r} ({reason})"
    failures: list[OSError] = []
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, address)
            except OSError as e:
                failures.append(e)
                continue
        return endpoint, None
    if failures and all(e.errno == errno.ECONNREFUSED for e in failures):
        return endpoint, f"connection refused: nothing listens on port {port} of {host}"
    return endpoint, f"cannot connect to {host} port {port}: {failures[-1].strerror if failures else 'no address'}"
