"""Telling a dead agent from a slow one in about a second: a liveness port per node.

Every agent listens on a small TCP port of its own (published in its `NodeInfo`) for as
long as it runs, and closes each connection as soon as it is accepted. When the leader
suspects a member (a survivor's workers failed, as they do at once when a peer dies), it
connects to that port:

- **refused** (an RST): the host is up and nothing listens there any more, so the agent
  process is gone; the kernel closed its socket when it died. That is a death, known
  now rather than a lease TTL later.
- **accepted**: something listens. A SIGSTOPped or swapping agent's kernel still
  completes the handshake, so this proves nothing more than a process that holds the
  socket; the lease TTL judges it, as before.
- **no answer** (a timeout, an unreachable host, a partition): the TTL judges too.

Only a refusal is acted on, and only from a node whose port once accepted the leader's
connection (checked when it registers): a firewall that rejects the port, or an address
the leader cannot reach, never makes a live node look dead; such nodes are judged by the
TTL alone. No data crosses the connection: there is nothing to authenticate or parse.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import socket

log = logging.getLogger("elasticrun.rendezvous")

#: how long the leader waits for a suspect's liveness port to answer
PROBE_TIMEOUT = 1.0
#: connections a port holds before it accepts them: every node of a job connects to a
#: new leader's port at once (asyncio's default, 100, dropped most of 10,000, and each
#: dropped one waited out the probe timeout)
_BACKLOG = 4096


class Verdict(enum.Enum):
    """What one connection to a node's liveness port showed."""

    LISTENING = "listening"
    #: connection refused: the agent process is gone
    GONE = "gone"
    #: no answer in time, or a network error: the lease TTL decides
    UNKNOWN = "unknown"


class LivenessPort:
    """This agent's liveness port: accepts and closes, for the agent's whole life."""

    def __init__(self, server: asyncio.Server, port: int) -> None:
        self._server = server
        self.port = port

    @classmethod
    async def open(cls, addr: str) -> LivenessPort | None:
        """Listen on `addr` (the address the others reach this node at), any port.

        None when that cannot be done (the node is then judged by its lease TTL alone)."""
        try:
            # one socket on one address: a name that resolves to several would get a
            # port on each, and the leader could be refused on a port of another
            infos = await asyncio.get_running_loop().getaddrinfo(addr, 0, type=socket.SOCK_STREAM)
            server = await asyncio.start_server(
                _close_at_once, host=str(infos[0][4][0]), port=0, backlog=_BACKLOG
            )
        except OSError as e:
            log.warning("no liveness port on %s (%s): a death of this node is noticed by its lease TTL", addr, e)
            return None
        port = server.sockets[0].getsockname()[1]
        return cls(server, port)

    async def close(self) -> None:
        self._server.close()
        with contextlib.suppress(OSError):
            await self._server.wait_closed()


async def _close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def probe(addr: str, port: int, timeout: float = PROBE_TIMEOUT) -> Verdict:
    """Connect to a node's liveness port once."""
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(addr, port)
    except ConnectionRefusedError:
        return Verdict.GONE
    except (OSError, TimeoutError):
        return Verdict.UNKNOWN
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return Verdict.LISTENING
