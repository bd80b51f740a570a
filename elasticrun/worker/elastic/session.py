"""One round's process group inside a long-lived worker, and how to break it.

`GroupSession.join()` makes the round's group the way torchrun's workers do (a TCPStore
hosted by rank 0 at the round's MASTER_ADDR:MASTER_PORT, then `init_process_group`),
and `leave()` destroys it so the next round can make a new one in the same process.

`interrupt()` is the reason this module exists. When a peer dies or freezes in the
middle of a collective, the survivors would wait for it until the group's timeout
(30 minutes by default). The agent sees the peer's lease expire and says so; the
worker's link then calls `interrupt()` from its reader thread, and the collective in
flight raises at once:

- nccl: `ProcessGroup.abort()` (ncclCommAbort) is made for this.
- gloo: its `abort()` does not wake a thread blocked in a collective (checked on torch
  2.13), so the group's own TCP connections are shut down instead. They are the
  sockets this process opened while joining (found in /proc/self/fd); listening
  sockets are left alone (gloo's listener aborts the process on an accept error).
  Shutting down, not closing, keeps the descriptors valid, so nothing else can reuse
  them before torch closes them in `destroy_process_group()`.

Only the default group is covered: groups a script makes later with `new_group()` are
not interrupted (their collectives fail once the default group's peers are gone).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
import time

import torch
import torch.distributed as dist

from elasticrun.worker.elastic.link import WorkerAssignment

#: how often a rank polls for rank 0's store while joining (a refused connect is
#: answered at once), and how long one probe may wait for a slow network's answer
_PROBE_INTERVAL = 0.005
_PROBE_CONNECT_LIMIT = 5.0


class SupersededError(RuntimeError):
    """The round was superseded while this worker was joining it."""


def _socket_inodes() -> set[str]:
    """The sockets this process has open, by inode (e.g. 'socket:[1234]')."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:"):
                found.add(link)
    return found


def _shut_down(inodes: set[str]) -> None:
    """Shut down the connected TCP sockets among `inodes`; leave listeners be."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") not in inodes:
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        with sock, contextlib.suppress(OSError):
            if sock.family in (socket.AF_INET, socket.AF_INET6) and not sock.getsockopt(
                socket.SOL_SOCKET, socket.SO_ACCEPTCONN
            ):
                sock.shutdown(socket.SHUT_RDWR)


class GroupSession:
    """The process group of one round, for one worker."""

    def __init__(self, assignment: WorkerAssignment, backend: str | None, timeout: datetime.timedelta) -> None:
        self.assignment = assignment
        self._backend = backend
        self._timeout = timeout
        self._lock = threading.Lock()
        self._interrupted = False
        self._before: set[str] | None = None  # sockets open before joining began
        self._sockets: set[str] | None = None  # the group's own, once joined
        self._joining = False
        self._store: dist.TCPStore | None = None

    def join(self) -> None:
        """Make this round's group; raises SupersededError if interrupted meanwhile."""
        a = self.assignment
        os.environ.update(a.env)  # scripts that read RANK etc. see this round's values
        with self._lock:
            if self._interrupted:
                raise SupersededError(f"round {a.round} was superseded before it began")
            self._before = _socket_inodes()
            self._joining = True
        try:
            if a.rank != 0:
                self._await_master(a.master_addr, a.master_port)
            self._store = dist.TCPStore(
                a.master_addr,
                a.master_port,
                a.world_size,
                is_master=a.rank == 0,
                timeout=self._timeout,
                wait_for_workers=False,
            )
            dist.init_process_group(
                self._backend,
                store=dist.PrefixStore(f"elasticrun/round/{a.round}", self._store),
                rank=a.rank,
                world_size=a.world_size,
                timeout=self._timeout,
            )
        finally:
            with self._lock:
                self._joining = False
                self._sockets = _socket_inodes() - self._before
                interrupted = self._interrupted
        if interrupted:
            raise SupersededError(f"round {a.round} was superseded while joining it")

    def _await_master(self, host: str, port: int) -> None:
        """Wait until rank 0's store accepts connections.

        A TCPStore client that finds the port closed backs off for about half a
        second before it tries again, and in a re-forming survivors reach the round a
        moment after a waiting newcomer: probing every few ms keeps the group's start
        at the few ms the store needs, not the client's back-off.
        """
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            if self._interrupted:
                raise SupersededError(f"round {self.assignment.round} was superseded while joining it")
            try:
                left = max(deadline - time.monotonic(), _PROBE_INTERVAL)
                socket.create_connection((host, port), timeout=min(left, _PROBE_CONNECT_LIMIT)).close()
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"round {self.assignment.round}: rank 0's store at {host}:{port} did not "
                        f"accept connections within {self._timeout.total_seconds():g}s ({e})"
                    ) from e
            time.sleep(_PROBE_INTERVAL)

    def round_over(self, round_number: int, interrupt: bool) -> None:
        """The agent said `round_number` is over (any thread); news of an earlier round is stale.

        A lost peer (`interrupt`) breaks this round's group, joining or joined. A change
        without it (nodes joined) leaves a formed group be until the next commit, where
        every rank notices it together; but a group still forming is abandoned: the
        rounds were opened back to back, some peers never heard of this one, and the
        others would wait for them here until the group's timeout. Every agent of the
        round says it is over, so all of its joining ranks leave it.
        """
        if round_number < self.assignment.round:
            return
        with self._lock:
            forming = self._sockets is None  # joining, or not yet begun
        if interrupt or forming:
            self.interrupt()

    def interrupt(self) -> None:
        """Break whatever collective is in flight (thread-safe, any thread).

        While the group forms, its sockets are those opened since the join began, and
        the C++ join retries what fails (a TCPStore client reconnects, gloo dials its
        peers again): they are shut down again as they appear, until the join gives up.
        """
        with self._lock:
            self._interrupted = True
            if self._before is None:
                return  # not joining yet: join() will refuse
            if self._joining:
                threading.Thread(target=self._break_join, name="elasticrun-break-join", daemon=True).start()
                return
            sockets = self._sockets or set()
        _shut_down(sockets)
        world = dist.group.WORLD if dist.is_initialized() else None
        if world is not None and "nccl" in str(dist.get_backend()):
            with contextlib.suppress(RuntimeError):
                world.abort()

    def _break_join(self) -> None:
        while True:
            with self._lock:
                if not self._joining or self._before is None:
                    return  # the join is over: joined (join() raises, interrupted) or failed
                sockets = _socket_inodes() - self._before
            _shut_down(sockets)
            time.sleep(_PROBE_INTERVAL)

    def leave(self) -> None:
        """Destroy the group (whatever state it is in) so a new one can be made."""
        if dist.is_initialized():
            with contextlib.suppress(RuntimeError, ValueError):
                dist.destroy_process_group()
        else:
            _forget_failed_join()
        self._store = None


def _forget_failed_join() -> None:
    """Give back the group name that a failed `init_process_group` took.

    torch names each group it makes by a process-wide count, and gives the count back
    only when the default group is destroyed: after a join that broke inside
    `init_process_group` (its round superseded, a peer lost), this process would name
    its next round's group "1" while its peers name theirs "0", and each would wait
    for the other's keys under another prefix until the timeout. torch has no public
    call for this; `destroy_process_group` resets the same counter."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0


def flag_device() -> torch.device:
    """Where a small tensor must live for a collective on the default group."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
