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

And when that is not enough: gloo sometimes closes a pair's socket on a peer's shutdown
and leaves a send or receive posted on it waiting (seen in `UnboundBuffer::waitSend` of
a ring all-reduce, in the store-stall tests): nothing is left to shut down, and the
collective would wait out the group's timeout while the other ranks wait for this one
in the next round. So the waits of torch.distributed's Python collectives (`Work.wait`)
wait in slices while a group is formed, and a collective still in flight
`_ABANDON_AFTER` seconds after an interrupt is abandoned: the wait raises
`CollectiveAbandonedError`, and a thread of its own keeps the group until gloo's own
timeout has ended the operation (a process group's destructor joins its threads: on the
main thread it would wait for that timeout too). That thread sleeps in Python, never in
torch: a daemon thread inside a torch call that lets go of the GIL aborts the process
at its exit ("terminate called without an active exception") when it takes the GIL back.

Only the default group is covered: groups a script makes later with `new_group()` are
not interrupted (their collectives fail once the default group's peers are gone), and a
wait inside C++ (DDP's reducer) is not sliced.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elasticrun.worker.elastic.link import WorkerAssignment

#: how often a rank polls for rank 0's store while joining (a refused connect is
#: answered at once), and how long one probe may wait for a slow network's answer
_PROBE_INTERVAL = 0.005
_PROBE_CONNECT_LIMIT = 5.0
#: the longest pause between two reads of a forming round's verdict
_VERDICT_POLL_LIMIT = 0.05
#: how long a collective may go on after an interrupt before it is abandoned, and the
#: slices a wait is cut into meanwhile (a slice ends at once when the work completes)
_ABANDON_AFTER = 1.0
_WAIT_SLICE = datetime.timedelta(milliseconds=200)


class CollectiveAbandonedError(RuntimeError):
    """A collective of an interrupted round that did not break by itself was left behind."""


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
        self.timeout = timeout
        self._lock = threading.Lock()
        self._interrupted = False  # a peer lost: the group is broken, joining or formed
        self._interrupted_at = 0.0  # when (time.monotonic())
        self._over = False  # the round is over (nodes joined): a group still forming is left
        self._before: set[str] | None = None  # sockets open before joining began
        self._sockets: set[str] | None = None  # the group's own, once joined
        self._joining = False
        self._formed = False
        self._store: dist.TCPStore | None = None

    def join(self) -> None:
        """Make this round's group; raises SupersededError if interrupted meanwhile."""
        a = self.assignment
        os.environ.update(a.env)  # scripts that read RANK etc. see this round's values
        with self._lock:
            if self._interrupted or self._over:
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
                timeout=self.timeout,
                wait_for_workers=False,
            )
            if not self._agree(self._store):
                raise SupersededError(f"round {a.round} was superseded while its group formed: its ranks left it")
            dist.init_process_group(
                self._backend,
                store=dist.PrefixStore(f"elasticrun/round/{a.round}", self._store),
                rank=a.rank,
                world_size=a.world_size,
                timeout=self.timeout,
            )
        finally:
            with self._lock:
                self._joining = False
                self._sockets = _socket_inodes() - self._before
                interrupted = self._interrupted
        # Formed. A round over without a lost peer is left at the first commit, by every
        # rank together; one rank leaving now would strand the others in their first
        # collective (a gloo peer that left is not always seen at once).
        self._formed = True
        _watch_waits(self)
        if interrupted:
            raise SupersededError(f"round {a.round} was superseded while joining it")

    def _agree(self, store: dist.TCPStore) -> bool:
        """Whether every rank of the round goes on to make its group, as the round's store says.

        A round can be superseded while its group forms (rounds opened back to back):
        some of its ranks never come, and the others must leave it, all of them, or
        one that went on would wait in `init_process_group` for one that left. So the
        ranks decide once, in the store: the last to arrive says "go"; a rank told
        that the round is over before that says "abandon"; the first word stands
        (compare-and-set) and every rank reads it. After "go" nobody leaves before
        the group has formed."""
        a = self.assignment
        verdict = dist.PrefixStore(f"elasticrun/verdict/{a.round}", store)
        if verdict.add("arrived", 1) >= a.world_size:
            verdict.compare_set("verdict", "", "go")
        # a check per rank every few ms while the group forms; fewer for a large world
        interval = min(_VERDICT_POLL_LIMIT, _PROBE_INTERVAL * (1 + a.world_size // 256))
        while not verdict.check(["verdict"]):
            if self._interrupted or self._over:
                verdict.compare_set("verdict", "", "abandon")
            else:
                time.sleep(interval)
        return verdict.get("verdict") == b"go"

    def _await_master(self, host: str, port: int) -> None:
        """Wait until rank 0's store accepts connections.

        A TCPStore client that finds the port closed backs off for about half a
        second before it tries again, and in a re-forming survivors reach the round a
        moment after a waiting newcomer: probing every few ms keeps the group's start
        at the few ms the store needs, not the client's back-off.
        """
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            if self._interrupted or self._over:
                raise SupersededError(f"round {self.assignment.round} was superseded while joining it")
            try:
                left = max(deadline - time.monotonic(), _PROBE_INTERVAL)
                socket.create_connection((host, port), timeout=min(left, _PROBE_CONNECT_LIMIT)).close()
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"round {self.assignment.round}: rank 0's store at {host}:{port} did not "
                        f"accept connections within {self.timeout.total_seconds():g}s ({e})"
                    ) from e
            time.sleep(_PROBE_INTERVAL)

    def round_over(self, round_number: int, interrupt: bool) -> None:
        """The agent said `round_number` is over (any thread); news of an earlier round is stale.

        A lost peer (`interrupt`) breaks this round's group, joining or joined. A change
        without it (nodes joined) leaves a formed group be until the next commit, where
        every rank notices it together; a group still forming is left by all its ranks
        together, or made and then left, as they agree in the store (`_agree`).
        """
        if round_number < self.assignment.round:
            return
        if interrupt:
            self.interrupt()
            return
        with self._lock:
            if self._sockets is None:  # forming, or not yet begun
                self._over = True

    def interrupt(self) -> None:
        """Break whatever collective is in flight (thread-safe, any thread).

        While the group forms (a peer lost meanwhile), its sockets are those opened since
        the join began, and the C++ join retries what fails (a TCPStore client
        reconnects, gloo dials its peers again): they are shut down again as they
        appear, until the join gives up.
        """
        with self._lock:
            if not self._interrupted:
                self._interrupted, self._interrupted_at = True, time.monotonic()
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

    def abandons(self) -> bool:
        """Whether a collective still in flight now is to be left behind (see the module doc)."""
        return self._interrupted and time.monotonic() - self._interrupted_at >= _ABANDON_AFTER

    def _break_join(self) -> None:
        while True:
            with self._lock:
                if not self._joining or self._before is None:
                    return  # the join is over: joined (join() raises, interrupted) or failed
                sockets = _socket_inodes() - self._before
            _shut_down(sockets)
            time.sleep(_PROBE_INTERVAL)

    def leave(self) -> dist.TCPStore | None:
        """Destroy the group (whatever state it is in) so a new one can be made.

        Returns the round's store when this rank serves it and the group never formed:
        peers may still be dialing it, and a TCPStore client that finds the port
        closed retries for the whole timeout, where one that reaches it is broken at
        once by its own worker's interrupt. The caller keeps it until its next round
        has formed (by then every rank of this round has left it)."""
        _watch_waits(None)
        if dist.is_initialized():
            with contextlib.suppress(RuntimeError, ValueError):
                dist.destroy_process_group()
        else:
            _forget_failed_join()
        store, self._store = self._store, None
        return store if self.assignment.rank == 0 and not self._formed else None


#: the formed session whose collectives' waits are sliced (None: waits as torch makes them)
_watched: GroupSession | None = None


def _watch_waits(session: GroupSession | None) -> None:
    """Slice the waits of `session`'s collectives from now on (None: stop)."""
    global _watched
    _watched = session
    work = torch._C._distributed_c10d.Work
    if not getattr(work.wait, "_elasticrun_sliced", False):
        work.wait = _sliced(work.wait)  # type: ignore[method-assign]  # the class-wide wait


def _sliced(wait: Callable[..., Any]) -> Callable[..., Any]:
    """`Work.wait`, in slices while a session is formed, abandoned once it `abandons()`.

    A wait given a timeout of its own is the caller's and is left as it is."""

    @functools.wraps(wait)
    def sliced(work: Any, *args: Any, **kwargs: Any) -> Any:
        session = _watched
        if session is None or args or kwargs:
            return wait(work, *args, **kwargs)
        while True:
            try:
                return wait(work, _WAIT_SLICE)
            except RuntimeError as e:
                if "timed out" not in str(e):
                    raise  # the collective's own failure
            if session.abandons():
                group = dist.group.WORLD if dist.is_initialized() else None
                hold = session.timeout.total_seconds() + _ABANDON_AFTER
                threading.Thread(target=_hold, args=(work, group, hold), daemon=True).start()
                raise CollectiveAbandonedError(
                    f"round {session.assignment.round}'s collective did not break when its group "
                    f"was interrupted (its peers re-form): left behind"
                )

    sliced._elasticrun_sliced = True  # type: ignore[attr-defined]
    return sliced


def _hold(work: Any, group: object, seconds: float) -> None:
    """Keep an abandoned collective and its group for `seconds`, past gloo's timeout for it.

    Their last references then go here, and so does the destructor's join of the group's
    threads, which that timeout has freed."""
    time.sleep(seconds)
    del work, group


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
