"""The round's MASTER_PORT, held by the agent until the round is over.

Picking a port by binding port 0 and closing the socket again (as torchrun does) leaves
it free for anyone during the seconds before the rank-0 worker binds it (python and
torch still have to start): another process's bind to port 0, or the source port of any
outgoing connection (a gRPC client's), can take it, and the worker's TCPStore then fails
with EADDRINUSE. A `PortReservation` keeps the port bound instead, so the kernel gives
it to no one else, while the worker can still listen on it.

On Linux a bound socket that does not listen keeps its port from every other bind that
might conflict and from the ephemeral ports of connect(); one bind that sets
SO_REUSEADDR, as TCPStore's server does (both backends), is allowed beside it. The
reservation is on the wildcard address, IPv4 and IPv6 together where the host has both,
because that is where TCPStore's server binds whatever MASTER_ADDR says: the port must
be free, and kept, on every address, not only on this node's.
"""

from __future__ import annotations

import socket


class PortReservation:
    """A TCP port nobody else on this host is given until `close()`.

    The socket is bound with SO_REUSEADDR and never listens: a server that sets
    SO_REUSEADDR itself (torch's TCPStore) can bind and listen on the port meanwhile.
    """

    def __init__(self) -> None:
        dual = socket.has_dualstack_ipv6()
        family, address = (socket.AF_INET6, "::") if dual else (socket.AF_INET, "0.0.0.0")
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if dual:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, 0))
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self.port: int = sock.getsockname()[1]

    def close(self) -> None:
        """Give the port back (idempotent)."""
        self._sock.close()
