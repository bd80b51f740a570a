"""A `torch.distributed.Store` backed by the built-in store server.

    store = C10dStore("node0:29400")
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=n)

Unlike TCPStore it needs no extra port, speaks to a server that can require a token and
TLS, and loads nothing but bytes from the wire.

Under an elasticrun agent whose store has a token, a worker finds its credential without
being told: the agent writes a worker credential of its job (never the store's token)
to a file only its user can read, named by `$ELASTICRUN_STORE_TOKEN_FILE`, which
`C10dStore` reads when no `token` is passed; nothing goes through the environment,
where whatever a script logs or sends to an experiment tracker would carry it. With
that credential the store serves the c10d operations only, on keys of the job's own
(the server keeps them under the job's worker namespace, and `num_keys` counts those),
so a process group works as with any store while the job's records stay out of reach.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from elasticrun.errors import StoreSettingError
from elasticrun.store.client.c10d import C10dClient
from elasticrun.store.wire import DEFAULT_TIMEOUT, TOKEN_FILE_ENV, TlsKeyPair, is_loopback

logger = logging.getLogger("elasticrun")

#: torch's default store timeout: how long get/wait wait for a key.
DEFAULT_WAIT = datetime.timedelta(seconds=300)


def _as_bytes(value: str | bytes) -> bytes:
    # torch hands values over as bytes from C++ and as str from some Python callers.
    return value.encode() if isinstance(value, str) else bytes(value)


def agent_token() -> str | None:
    """The store credential the agent left for its workers.

    The content of the file `$ELASTICRUN_STORE_TOKEN_FILE` names; None when it names
    none (a store without a token)."""
    path = os.environ.get(TOKEN_FILE_ENV)
    if not path:
        return None
    try:
        return Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not text"
        raise StoreSettingError(f"${TOKEN_FILE_ENV}", f"cannot read the store token file {path}: {why}") from None


class C10dStore(dist.Store):
    """The c10d operations of the store server at `endpoint` (host:port).

    `token` is the store's token or a credential derived from it; without one, the
    worker credential the agent left for its workers (`agent_token`) is used, if any.
    `timeout` is how long get/wait wait for keys (torch's store timeout);
    `connect_timeout` bounds reaching the server for each call. `tls_ca` (PEM) makes
    it speak TLS trusting that CA; `client_tls` is the certificate it presents to a
    store that requires one (`client_ca`):
    `TlsKeyPair(cert=Path("node.crt").read_bytes(), key=Path("node.key").read_bytes())`.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        token: str | None = None,
        tls_ca: bytes | None = None,
        client_tls: TlsKeyPair | None = None,
        timeout: datetime.timedelta = DEFAULT_WAIT,
        connect_timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__()
        self.set_timeout(timeout)
        if token is None:
            token = agent_token()
        if token is not None and tls_ca is None and not is_loopback(endpoint.rpartition(":")[0]):
            logger.warning(
                "the store credential goes to %s in plaintext: anyone on the network path can read it and "
                "use the store as this worker; serve the store with TLS and pass C10dStore(..., tls_ca=<its CA>)",
                endpoint,
            )
        self._client = C10dClient(
            endpoint, token=token, tls_ca=tls_ca, client_tls=client_tls, timeout=connect_timeout
        )

    def _wait_seconds(self, timeout: datetime.timedelta | None = None) -> float:
        # torch's Store has `timeout` (what set_timeout set); its type stubs leave it out
        default: datetime.timedelta = self.timeout  # type: ignore[attr-defined]  # see above
        return (timeout if timeout is not None else default).total_seconds()

    def set(self, key: str, value: str | bytes) -> None:
        self._client.set(key, _as_bytes(value))

    def get(self, key: str) -> bytes:
        return self._client.get(key, self._wait_seconds())

    def add(self, key: str, amount: int) -> int:
        return self._client.add(key, amount)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._client.compare_set(key, _as_bytes(expected), _as_bytes(desired))

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        self._client.wait(list(keys), self._wait_seconds(timeout))

    def check(self, keys: Sequence[str]) -> bool:
        return self._client.check(list(keys))

    def num_keys(self) -> int:
        return self._client.num_keys()

    def delete_key(self, key: str) -> bool:
        return self._client.delete_key(key)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self._client.multi_get(list(keys), self._wait_seconds())

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self._client.multi_set(list(keys), [_as_bytes(v) for v in values])

    def has_extended_api(self) -> bool:
        return True

    def close(self) -> None:
        """Close the connection to the server."""
        self._client.close()
