"""Read a file while another process appends to it (`tail -f`), woken by Linux inotify.

A worker writes its log files itself (see elasticrun.agent.output), and the agent reads
them as they grow, for the console, the stderr tail of failure reports and the job's
`logs`. Waiting for growth must be an event, not a polling loop: a poll interval would
delay every console line by up to that interval, and a stat per file per interval, for
every worker of every node, for the whole job, is CPU spent on nothing. The kernel says
when a file was written to (inotify's IN_MODIFY); the standard library has no binding,
so ctypes calls libc's three functions. Linux only, like the rest of the agent.

One inotify instance per event loop serves every followed file: the kernel allows each
user 128 instances by default (fs.inotify.max_user_instances), shared with editors and
everything else, while watches are plentiful (one per followed file).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import struct
from pathlib import Path

_IN_MODIFY = 0x00000002
#: the kernel dropped events (its queue was full): every follower must look
_IN_Q_OVERFLOW = 0x00004000
# struct inotify_event: wd, mask, cookie, len (then `len` bytes of name, none for files)
_EVENT = struct.Struct("iIII")
#: room for many events per read; a file watch's events carry no name
_EVENTS_BUFFER = 64 * _EVENT.size

_libc = ctypes.CDLL(None, use_errno=True)
_libc.inotify_init1.argtypes = [ctypes.c_int]
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
_libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]


def _checked(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


class _Inotify:
    """The event loop's inotify instance: wakes the followers of each written file."""

    _of_loop: dict[asyncio.AbstractEventLoop, _Inotify] = {}

    @classmethod
    def of_running_loop(cls) -> _Inotify:
        """The running loop's instance, made on first use."""
        loop = asyncio.get_running_loop()
        inotify = cls._of_loop.get(loop)
        if inotify is None:
            inotify = cls._of_loop[loop] = cls(loop)
        return inotify

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._fd = _checked(
            _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC), "inotify_init1"
        )
        #: watch descriptor -> the events of its followers (a file followed twice has
        #: one watch: the kernel gives one per inode)
        self._watches: dict[int, set[asyncio.Event]] = {}
        loop.add_reader(self._fd, self._on_events)

    def watch(self, path: Path, wake: asyncio.Event) -> int:
        """Set `wake` whenever `path` is written to; returns the watch for `unwatch`."""
        try:
            wd = _checked(
                _libc.inotify_add_watch(self._fd, os.fsencode(path), _IN_MODIFY),
                "inotify_add_watch",
            )
        except OSError:
            self._close_if_idle()
            raise
        self._watches.setdefault(wd, set()).add(wake)
        return wd

    def unwatch(self, wd: int, wake: asyncio.Event) -> None:
        """Undo `watch`; the instance closes with its last watch."""
        followers = self._watches[wd]
        followers.discard(wake)
        if not followers:
            del self._watches[wd]
            # fails only when the kernel already dropped the watch: nothing to undo
            _libc.inotify_rm_watch(self._fd, wd)
        self._close_if_idle()

    def _close_if_idle(self) -> None:
        if self._watches:
            return
        del self._of_loop[self._loop]
        self._loop.remove_reader(self._fd)
        os.close(self._fd)

    def _on_events(self) -> None:
        try:
            data = os.read(self._fd, _EVENTS_BUFFER)
        except BlockingIOError:
            return  # the loop calls again when there is more
        offset = 0
        while offset < len(data):
            wd, mask, _, name_len = _EVENT.unpack_from(data, offset)
            offset += _EVENT.size + name_len
            if mask & _IN_Q_OVERFLOW:
                woken = [w for followers in self._watches.values() for w in followers]
            else:
                woken = list(self._watches.get(wd, ()))  # none: a watch just removed
            for wake in woken:
                wake.set()


class FileTail:
    """Reads one file from its start as it grows, until `finish()` and the end.

    Open it inside the event loop that reads it, and `close()` it there.
    """

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._grown = asyncio.Event()
        try:
            self._inotify = _Inotify.of_running_loop()
            self._wd = self._inotify.watch(path, self._grown)
        except BaseException:
            os.close(self._fd)
            raise
        self._offset = 0
        #: set by finish(): read() stops at this offset
        self._end: int | None = None

    async def read(self, n: int) -> bytes:
        """Up to `n` more bytes, waiting while there are none.

        B"" at the end (after `finish()`), as a pipe's reader returns when the pipe
        closes."""
        while True:
            # Cleared before reading: a write after this read sets it again.
            self._grown.clear()
            size = n if self._end is None else min(n, self._end - self._offset)
            data = os.read(self._fd, size) if size > 0 else b""
            self._offset += len(data)
            if data or self._end is not None:
                return data
            await self._grown.wait()

    def finish(self) -> None:
        """The writer is done: read() returns what the file holds now, then b"".

        What is appended later (by a process that outlived the writer) is in the file
        only.
        """
        self._end = os.fstat(self._fd).st_size
        self._grown.set()

    def close(self) -> None:
        """Stop watching and close the file."""
        self._inotify.unwatch(self._wd, self._grown)
        os.close(self._fd)
