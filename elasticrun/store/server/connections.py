"""Which connections the store keeps: room kept for authenticated callers.

gRPC's Python server shows Python a connection only through its calls (`context.peer()`)
and has no way to close one, and its cap (`grpc.max_allowed_incoming_connections`) is
blind: past it, it closes each new connection at accept, whoever it is. A connection
shows who it is only with its first call, so the store decides what to keep from the
calls it sees, and ends the connections it does not keep itself: it finds their
sockets among its own descriptors and shuts them down (`socket.shutdown`), and gRPC,
reading the end of the stream, closes the connection and drops the calls it had queued
for it and not yet handed to Python.

- A connection that makes a call without a valid credential (UNAUTHENTICATED) is shut
  once the refusal is sent (or at the next scan, if it connected since the last): a
  flood of anonymous calls costs the store the calls that reach Python before that (a
  few hundred a connection on a loaded host), not all it can send, and the flood must
  connect again.
- A connection that made an authenticated call is never shut by this: agents keep their
  connections however full the store is.
- The others, connected and not yet authenticated (a joining agent before its first
  call, an idle flood), may hold the cap less the reserve (`anonymous_share`); past
  it, the oldest of them, once given `FIRST_CALL_GRACE` for their first call, are shut
  (`sweep`, every `SWEEP_EVERY`). So connections held open, with calls or without, never
  hold the reserve for long, and a new connection finds room to make its first call.

What this cannot do: tell a new connection from a flood's before its first call. A
flood that opens new connections faster than the store shuts them takes the free slots
as fast as they free (each for `FIRST_CALL_GRACE` at least): that is the firewall's
part (docs/deployment.md, "Connection floods").

Linux only (/proc/self/fd); elsewhere nothing is shut and the cap stays blind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import stat
import time
from dataclasses import dataclass

from elasticrun.descriptors import EXHAUSTED

logger = logging.getLogger(__name__)

#: The part of the connection cap kept for connections that authenticated: a not yet
#: authenticated connection may hold the rest. An eighth: 64 of a cap of 512 (a store
#: of 1,024 descriptors), 6,250 of 50,000.
RESERVE_FRACTION = 8
#: How long a new connection may go without an authenticated call before it may be
#: shut to keep the reserve free: a client makes its first call as soon as it connects.
FIRST_CALL_GRACE = 1.0
#: How long a shut connection's peer is remembered: calls gRPC queued for it before it
#: was shut reach Python for a while after (on a loaded host, a second or more).
SHUT_MEMORY = 10.0
#: How often the connections past the anonymous share are looked for.
SWEEP_EVERY = 1.0
#: The least time between two scans of the descriptors, and the most between two counts
#: of the connections (to forget the peers that are gone).
SCAN_GAP = 0.05
FULL_COUNT_EVERY = 60.0
#: How often shutting connections past the share is said, at most.
SAY_EVERY = 60.0

_FD_DIR = "/proc/self/fd"

#: a peer as gRPC and the socket both name it: (address, port), v4-mapped v6 as v4
Peer = tuple[str, int]


def reserve_of(cap: int) -> int:
    """The connections of `cap` kept for callers that authenticated."""
    return max(cap // RESERVE_FRACTION, 1)


def peer_of(grpc_peer: str) -> Peer | None:
    """gRPC's peer string ("ipv4:10.0.0.5:41234", "ipv6:[::1]:5000"), or None (unix socket)."""
    kind, _, address = grpc_peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = address.rpartition(":")
    try:
        return _normal(host.strip("[]"), int(port))
    except ValueError:
        return None


def _descriptors() -> int:
    """How many descriptors the process holds (0 if it cannot list them now)."""
    try:
        return len(os.listdir(_FD_DIR))
    except OSError:  # out of descriptors itself: counted at the next sweep
        return 0


def _normal(host: str, port: int) -> Peer:
    address = ipaddress.ip_address(host.partition("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address), port


@dataclass
class _Socket:
    """One of the server's connections, as found among the process's descriptors."""

    fd: int
    inode: int
    #: when it was first found (monotonic)
    seen: float


class Connections:
    """The connections of the server listening on `port`, and which of them it keeps.

    `cap` is the connections gRPC serves at once at most; a not yet authenticated
    connection may hold `anonymous_share` of them. Finding the connections reads every
    descriptor's kind (`_find`: ~5 ms per thousand descriptors), so it is done at most
    once per `SCAN_GAP` and never for more than a tenth of the loop's time
    (`_scanned`): refusals wait for the next scan, all of them served by it."""

    def __init__(self, port: int, cap: int) -> None:
        self.port = port
        self.anonymous_share = cap - reserve_of(cap)
        self.enabled = os.path.isdir(_FD_DIR)
        self._sockets: dict[Peer, _Socket] = {}
        #: inodes of descriptors looked at and not the server's connections (pipes, clients)
        self._others: set[int] = set()
        self._authenticated: set[Peer] = set()
        #: peers shut, or gone before they could be, and when: the calls gRPC had queued for
        #: them still come through Python, and must not each look for the connection again
        self._shut: dict[Peer, float] = {}
        #: refused peers not found at the last scan (connected since), and the scan due for them
        self._pending: set[Peer] = set()
        self._scan: asyncio.TimerHandle | None = None
        #: no scan before this (monotonic), and the last full count
        self._next_scan = 0.0
        self._counted_at = 0.0
        #: connections shut past the share and not yet said (`sweep` says it once a minute)
        self._unsaid = 0
        self._said_at = -SAY_EVERY
        #: connections shut, all told; the server's connections at the last scan; scans made
        self.shut_count = 0
        self.found = 0
        self.scans = 0

    @property
    def shut(self) -> frozenset[Peer]:
        """The peers of the connections shut in the last `SHUT_MEMORY` seconds."""
        return frozenset(self._shut)

    def authenticated(self, grpc_peer: str) -> None:
        """The connection of `grpc_peer` made an authenticated call: never shut it."""
        peer = peer_of(grpc_peer)
        if peer is not None:
            self._authenticated.add(peer)

    def refused(self, grpc_peer: str) -> None:
        """The connection of `grpc_peer` made a call without a valid credential: shut it now.

        Not if it authenticated before (a client whose credential just expired). One
        found since the last scan is shut at once; the others at the next scan."""
        peer = peer_of(grpc_peer)
        if not self.enabled or peer is None or peer in self._authenticated or peer in self._shut:
            return
        found = self._sockets.get(peer)
        if found is not None:
            self._shut_down(peer, found)
            return
        self._pending.add(peer)
        if self._scan is None:
            delay = max(self._next_scan - time.monotonic(), 0.0)
            self._scan = asyncio.get_running_loop().call_later(delay, self._scan_pending)

    def _scan_pending(self) -> None:
        self._scan = None
        self._find()
        now = time.monotonic()
        for peer in self._pending:
            found = self._sockets.get(peer)
            if found is not None:
                self._shut_down(peer, found)
            else:  # closed already
                self._shut[peer] = now
        self._pending.clear()

    def close(self) -> None:
        """Stop: no scan is left pending."""
        if self._scan is not None:
            self._scan.cancel()
            self._scan = None

    def sweep(self) -> int:
        """Past the anonymous share, shut the oldest connections not authenticated; how many.

        The connections are counted only when the process has more descriptors than the
        share (a listing of their names, without reading each), or once a `FULL_COUNT_EVERY`
        (to forget the peers that are gone)."""
        if not self.enabled:
            return 0
        now = time.monotonic()
        forgotten = now - SHUT_MEMORY
        self._shut = {peer: when for peer, when in self._shut.items() if when > forgotten}
        if now < self._next_scan:
            return 0
        if now - self._counted_at < FULL_COUNT_EVERY and _descriptors() <= self.anonymous_share:
            return 0
        self._find()
        self._counted_at = now
        self._authenticated &= self._sockets.keys()
        waiting = sorted(
            (found.seen, peer) for peer, found in self._sockets.items()
            if peer not in self._authenticated and peer not in self._shut
        )
        old_enough = now - FIRST_CALL_GRACE
        shut = 0
        for seen, peer in waiting[:max(len(waiting) - self.anonymous_share, 0)]:
            if seen > old_enough:
                break
            self._shut_down(peer, self._sockets[peer])
            shut += 1
        self._unsaid += shut
        if self._unsaid and now - self._said_at >= SAY_EVERY:
            logger.warning(
                "the store shut %d connections that had made no authenticated call, past %d such connections "
                "(the rest of its connection cap is kept for agents and workers; said at most once a minute)",
                self._unsaid, self.anonymous_share,
            )
            self._unsaid, self._said_at = 0, now
        return shut

    def _find(self) -> None:
        """Find the server's connections among the process's descriptors (only new ones are asked who they are)."""
        now, cpu = time.monotonic(), time.thread_time()
        try:
            self._read_descriptors(now)
        finally:  # never more than a tenth of the loop's time (its CPU: a loaded host's waits are no cost)
            self._next_scan = now + max(SCAN_GAP, 9 * (time.thread_time() - cpu))

    def _read_descriptors(self, now: float) -> None:
        found: dict[Peer, _Socket] = {}
        by_inode = {s.inode: (peer, s) for peer, s in self._sockets.items()}
        others: set[int] = set()
        try:
            names = os.listdir(_FD_DIR)
        except OSError as e:  # out of descriptors: counted at the next sweep
            if e.errno not in EXHAUSTED:
                raise
            return
        for name in names:
            fd = int(name)
            try:
                info = os.fstat(fd)
            except OSError:  # closed meanwhile (the listing's own descriptor among them)
                continue
            if not stat.S_ISSOCK(info.st_mode):
                continue
            if info.st_ino in self._others:
                others.add(info.st_ino)
                continue
            known = by_inode.get(info.st_ino)
            if known is not None and known[1].fd == fd:
                found[known[0]] = known[1]
                continue
            peer = self._served_peer(fd)
            if peer is None:
                others.add(info.st_ino)
            else:
                found[peer] = _Socket(fd, info.st_ino, known[1].seen if known is not None else now)
        self._sockets, self._others = found, others
        self.found = len(found)
        self.scans += 1

    def _served_peer(self, fd: int) -> Peer | None:
        """The peer of descriptor `fd` if it is a TCP connection to the server's port, else None."""
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # a kind of socket Python does not know, or closed meanwhile
            return None
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                return None
            if sock.getsockname()[1] != self.port:
                return None
            host, port = sock.getpeername()[:2]
            return _normal(host, port)
        except OSError:  # the listener itself (no peer), or closed meanwhile
            return None
        finally:
            sock.detach()  # the descriptor stays gRPC's

    def _shut_down(self, peer: Peer, found: _Socket) -> None:
        """Shut the connection down, on a copy of its descriptor checked to be the same socket.

        gRPC may have closed it and reused its number meanwhile."""
        try:
            copy = os.dup(found.fd)
        except OSError:  # closed meanwhile, or out of descriptors: the next sweep tries again
            return
        try:
            if os.fstat(copy).st_ino == found.inode:
                with socket.socket(fileno=copy) as sock:
                    copy = -1
                    with contextlib.suppress(OSError):  # already ended by the peer
                        sock.shutdown(socket.SHUT_RDWR)
                self._shut[peer] = time.monotonic()
                self.shut_count += 1
        finally:
            if copy >= 0:
                os.close(copy)
