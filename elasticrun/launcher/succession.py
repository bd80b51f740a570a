"""This agent's part in who serves the built-in store: it serves, or it stands by.

The agent that serves the job's store names its successors (`name_successors`); an
agent named keeps a copy of the job's records, not served (`follow`), and serves it at
its own address once the serving agent and every successor before it are gone. The
protocol is `rendezvous/succession.py`; this module holds the server. docs/concepts.md,
"When the store's host goes".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, NoReturn

from elasticrun.errors import StoreAddressError, StoreError, StoreUnavailableError
from elasticrun.first_of import first_of
from elasticrun.loglines import HEADLINE
from elasticrun.rendezvous.elastic import REFUSED_RETRY, ElasticRendezvous
from elasticrun.rendezvous.keys import Keys
from elasticrun.rendezvous.succession import (
    endpoint_at,
    follow,
    name_successors,
    named,
    predecessors_gone,
    read_successors,
)
from elasticrun.store.interface import Store
from elasticrun.store.server.memory import MemoryStore
from elasticrun.store.settings import StoreAccess, hosted_server, open_client

if TYPE_CHECKING:
    from elasticrun.store.server.metrics import StoreMetrics
    from elasticrun.store.server.store_server import StoreServer

log = logging.getLogger("elasticrun")

#: seconds before a standby that met a store error reads again
_STANDBY_RETRY = 1.0


class Succession:
    """Serve the store and name successors, or stand by until this agent's turn to serve.

    `server` is the store this agent serves (None: it stands by); `store` the agent's
    own client, whose endpoint follows the store as it moves (the rendezvous turns it)."""

    def __init__(
        self,
        access: StoreAccess,
        membership: ElasticRendezvous,
        store: Store,
        *,
        node_id: str,
        addr: str,
        server: StoreServer | None,
        metrics: StoreMetrics | None = None,
    ) -> None:
        self._access = access
        self._membership = membership
        self._store = store
        self._node_id = node_id
        self._addr = addr
        self._port = int(access.endpoints[0].rpartition(":")[2])
        self._keys = Keys(membership.run_id)
        self._metrics = metrics
        self.server = server

    async def run(self) -> NoReturn:
        """Never returns: the standby's wait (if any), then serving and naming successors."""
        if self.server is None:
            self.server = await self._stand_by()
        await name_successors(self.server.engine, self._keys, self._node_id, self._port)

    async def stop(self) -> None:
        """Stop serving (when this agent serves), at the agent's end."""
        server, self.server = self.server, None
        if server is not None:
            await server.stop()
            await server.engine.close()  # a successor's copy: the server does not own it

    async def _stand_by(self) -> StoreServer:
        """While named, follow the serving store; serve once every node before this one is gone."""
        while True:
            successors = self._membership.job.successors
            if not named(successors, self._node_id):
                await self._membership.changed()
                continue
            copy = MemoryStore()
            client = open_client(replace(self._access, endpoints=(self._store.endpoint,)))
            try:
                await first_of(follow(client, copy, self._keys), self._until_unnamed())
            except StoreUnavailableError:
                # refused (its agent died), or silent for the client's whole timeout, longer
                # than a lease: this node's own lease there has lapsed, it is out of that job
                if not self._job_ended() and await self._my_turn(copy):
                    server = await self._serve(copy)
                    if server is not None:
                        return server
                await copy.close()
                await asyncio.sleep(REFUSED_RETRY)  # one before us lives: the rendezvous turns to it
            except StoreError as e:
                await copy.close()
                log.debug("the store's standby copy broke (%s); reading again", e)
                await asyncio.sleep(_STANDBY_RETRY)
            else:
                await copy.close()  # no longer named
            finally:
                await client.close()

    def _job_ended(self) -> bool:
        """Whether the job had ended when its store went: then nobody takes it over.

        Its serving agent leaves once the others are done; a successor that served a
        copy then would keep an ended job alive at another address."""
        head = self._membership.job.head
        return head is not None and bool(head.closed)

    async def _until_unnamed(self) -> None:
        while named(self._membership.job.successors, self._node_id):
            await self._membership.changed()

    async def _my_turn(self, copy: MemoryStore) -> bool:
        """The serving store refused us: whether every successor before this node is gone too."""
        successors = self._membership.job.successors
        with contextlib.suppress(StoreError):
            successors = await read_successors(copy, self._keys) or successors
        return successors is not None and await predecessors_gone(successors, self._node_id)

    async def _serve(self, copy: MemoryStore) -> StoreServer | None:
        """Serve `copy` at this node's address; None where it cannot listen there.

        Then this node stands by again, and the job's nodes turn to the next successor
        or wait for a store at the endpoint, as if this one had not been named."""
        endpoint = endpoint_at(self._addr, self._port)
        server = hosted_server(self._access, endpoint, engine=copy, metrics=self._metrics)
        try:
            await server.start()
        except StoreAddressError as e:
            log.warning("cannot take the job's store over: %s", e)
            return None
        log.info(
            "serving the job's store on %s: the agent that served it at %s is gone or cut off, and no successor "
            "before this node answers", endpoint, self._store.endpoint, extra=HEADLINE,
        )
        return server
