"""The test workers' all_reduce: gloo (torch), or the same contract over plain sockets.

Why two. `import torch` costs about 2.5 s of CPU in every worker process on the 2-core
test machine, and the end-to-end tests start hundreds of workers: it was three quarters
of the suite's CPU. What those tests need of the collective is what the agent must
provide for any collective to work, not gloo itself: every rank of a round meets the
others at the round's MASTER_ADDR:MASTER_PORT (rank 0 listens there beside the agent's
port reservation, as TCPStore does), each step sums a vector over exactly WORLD_SIZE
ranks, and a peer that dies or is stopped by its agent breaks the step at once. The
socket group ("tcp") does that as a star through rank 0, importing nothing heavy. The
tests pick it through ELASTICRUN_TEST_COLLECTIVE (tests/support/elastic_cluster.py sets "tcp"
unless the variable is already set); workers started without it use gloo, and so do the
example, parity, in-process and framework tests, and `scripts/reliability.py`.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any, Protocol

TIMEOUT_S = 60.0  # gloo's timeout in these workers: a step that waits longer has failed


class CollectiveFailed(Exception):
    """A peer vanished or the step timed out (gloo raises RuntimeError for the same)."""


class Group(Protocol):
    def all_reduce(self, values: list[float]) -> list[float]: ...

    def close(self) -> None: ...


class GlooGroup:
    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))

    def all_reduce(self, values: list[float]) -> list[float]:
        t = self._torch.tensor(values)
        try:
            self._dist.all_reduce(t)
        except RuntimeError as e:
            raise CollectiveFailed(str(e)) from e
        return [float(v) for v in t]

    def close(self) -> None:
        self._dist.destroy_process_group()


class TcpGroup:
    """A star: ranks 1..N-1 connect to rank 0, send their vector, get the sums back.
    Rank 0 closes every connection when one breaks, so the others fail at once too."""

    def __init__(self, rank: int, world: int, addr: str, port: int) -> None:
        self.rank, self.world = rank, world
        self._peers: list[socket.socket] = []
        self._files: list[Any] = []
        if rank == 0:
            self._accept(port)
        else:
            self._connect(addr, port)

    def _accept(self, port: int) -> None:
        dual = socket.has_dualstack_ipv6()
        server = socket.socket(socket.AF_INET6 if dual else socket.AF_INET, socket.SOCK_STREAM)
        if dual:
            server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # beside the reservation
        server.bind(("::" if dual else "0.0.0.0", port))
        server.listen(self.world)
        server.settimeout(TIMEOUT_S)
        by_rank: dict[int, tuple[socket.socket, Any]] = {}
        try:
            while len(by_rank) < self.world - 1:
                conn, _ = server.accept()
                conn.settimeout(TIMEOUT_S)
                f = conn.makefile("rw")  # one reader per connection: it reads ahead
                rank, world = (int(x) for x in f.readline().split())
                if world != self.world or rank in by_rank or not 0 < rank < world:
                    raise CollectiveFailed(f"a peer says rank {rank} of {world}; this group is {self.world}")
                by_rank[rank] = conn, f
        except (OSError, ValueError) as e:
            raise CollectiveFailed(f"the group did not form: {e}") from e
        finally:
            server.close()
        self._peers = [by_rank[r][0] for r in sorted(by_rank)]
        self._files = [by_rank[r][1] for r in sorted(by_rank)]

    def _connect(self, addr: str, port: int) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            try:
                conn = socket.create_connection((addr, port), timeout=TIMEOUT_S)
                break
            except OSError as e:  # rank 0 is not listening yet
                if time.monotonic() > deadline:
                    raise CollectiveFailed(f"rank 0 at {addr}:{port} never answered: {e}") from e
                time.sleep(0.05)
        self._peers = [conn]
        self._files = [conn.makefile("rw")]
        self._send(self._files[0], f"{self.rank} {self.world}")

    @staticmethod
    def _send(f: Any, line: str) -> None:
        f.write(line + "\n")
        f.flush()

    @staticmethod
    def _receive(f: Any) -> list[float]:
        line = f.readline()
        if not line:
            raise CollectiveFailed("a peer closed the connection")
        return [float(x) for x in line.split()]

    def all_reduce(self, values: list[float]) -> list[float]:
        try:
            if self.rank != 0:
                self._send(self._files[0], " ".join(map(repr, values)))
                return self._receive(self._files[0])
            total = list(values)
            for f in self._files:
                total = [a + b for a, b in zip(total, self._receive(f), strict=True)]
            for f in self._files:
                self._send(f, " ".join(map(repr, total)))
            return total
        except (OSError, ValueError, CollectiveFailed) as e:
            self.close()  # the other ranks see their connection end and fail now too
            raise CollectiveFailed(f"tcp all_reduce failed: {e}") from e

    def close(self) -> None:
        for f in self._files:  # a socket's fd closes once its files are closed too
            try:
                f.close()
            except OSError:
                pass
        for p in self._peers:
            p.close()
        self._files, self._peers = [], []


def join_group(rank: int, world: int) -> Group:
    """The group of this round's workers, as the environment says to build it."""
    if os.environ.get("ELASTICRUN_TEST_COLLECTIVE", "gloo") == "tcp":
        return TcpGroup(rank, world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    return GlooGroup()
