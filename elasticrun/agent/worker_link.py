"""The agent's end of the lines to its workers in in-process mode.

In in-process mode (`--elastic-mode=in-process`) workers outlive rounds, so what
torchrun puts in their environment once (RANK, WORLD_SIZE, MASTER_ADDR, ...) changes
while they run. The agent serves a Unix socket in a private folder and names it in each
worker's environment; `elasticrun.worker.elastic` connects to it. Messages are JSON
lines:

    worker -> agent   {"hello": <local rank>, "pid": <pid>}
                      {"ready": true}
                      {"broken": <round>, "error": "<traceback>", "by_peer": <bool>}
    agent -> worker   {"assign": <round>, "env": {"RANK": ..., ...}}
                      {"change": <round>, "interrupt": <bool>}

`hello` comes when the script imports the worker API (it can be re-formed in place),
`ready` when it first asks for a round (its model is built, its data loaded): a node
that joins a running job joins only then, so the job never waits for a newcomer's
start-up. `change` says the worker's round is over: it leaves at its next `commit()`, or at
once when `interrupt` is set (a peer is gone, so a collective may never finish). Workers
import none of this; the protocol is the contract (see elasticrun/worker/elastic/link.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import tempfile
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("elasticrun.agent")

#: the environment variable that names the socket (read by elasticrun.worker.elastic)
SOCKET_VAR = "ELASTICRUN_AGENT_SOCKET"
#: the longest line a worker may send (a traceback), bounded so a bad client cannot
#: make the agent buffer without end
_LINE_LIMIT = 1 << 20
#: the longest exception line a status line quotes
_LAST_LINE_CHARS = 160


@dataclass(frozen=True, slots=True)
class BrokenReport:
    """A worker's training failed in `round` with no change announced."""

    local_rank: int
    round: int
    error: str
    #: the failure came out of a collective, which a peer's re-formation breaks too
    by_peer: bool = False

    def last_line(self) -> str:
        """The exception's line, shortened (gloo's run to several hundred characters)."""
        last = next((ln.strip() for ln in reversed(self.error.splitlines()) if ln.strip()), "an error")
        return textwrap.shorten(last, _LAST_LINE_CHARS, placeholder=" ...")


class WorkerChannel:
    """A Unix socket server that talks to this node's long-lived workers."""

    def __init__(self) -> None:
        # A private folder (0700): only this user's processes can reach the socket.
        self._dir = Path(tempfile.mkdtemp(prefix="elasticrun-"))
        self.path = str(self._dir / "agent.sock")
        self._server: asyncio.AbstractServer | None = None
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self._ready: set[int] = set()  # local ranks that asked for a round
        self._assign: dict[int, bytes] = {}  # the latest assign message, per local rank
        self._broken: list[BrokenReport] = []
        self._changed = asyncio.Event()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, self.path, limit=_LINE_LIMIT)

    async def close(self) -> None:
        self.disconnect()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        shutil.rmtree(self._dir, ignore_errors=True)

    def connected(self, local_ranks: list[int]) -> bool:
        """Whether every one of `local_ranks` has said hello (uses the worker API)."""
        return all(r in self._writers for r in local_ranks)

    def ready(self, local_ranks: list[int]) -> bool:
        """Whether every one of `local_ranks` has asked for a round."""
        return all(r in self._ready for r in local_ranks)

    async def wait_connected(self, local_ranks: list[int]) -> None:
        """Wait until every one of `local_ranks` has said hello."""
        await self._wait(lambda: self.connected(local_ranks))

    async def wait_ready(self, local_ranks: list[int]) -> None:
        """Wait until every one of `local_ranks` has asked for a round."""
        await self._wait(lambda: self.ready(local_ranks))

    async def _wait(self, done: Callable[[], bool]) -> None:
        while not done():
            self._changed.clear()
            await self._changed.wait()

    def assign(self, round_number: int, envs: Mapping[int, Mapping[str, str]]) -> None:
        """Give each worker its place in `round_number` (now, or when it says hello)."""
        self._broken.clear()
        for local_rank, env in envs.items():
            self._assign[local_rank] = _line({"assign": round_number, "env": dict(env)})
            self._send(local_rank, self._assign[local_rank])

    def change(self, round_number: int, *, interrupt: bool) -> None:
        """Tell every worker that `round_number` is over."""
        message = _line({"change": round_number, "interrupt": interrupt})
        for local_rank in list(self._writers):
            self._send(local_rank, message)

    async def broken(self, round_number: int) -> BrokenReport:
        """Wait for a worker to report a failure in `round_number`."""
        while (report := self.broken_in(round_number)) is None:
            await self._wait(lambda: self.broken_in(round_number) is not None)
        return report

    def broken_in(self, round_number: int) -> BrokenReport | None:
        """The first failure a worker reported in `round_number`, if any."""
        return next((r for r in self._broken if r.round == round_number), None)

    def disconnect(self) -> None:
        """Forget the current workers (they are being stopped): new ones say hello anew."""
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
        self._ready.clear()
        self._assign.clear()
        self._broken.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        local_rank: int | None = None
        try:
            while line := await reader.readline():
                message = json.loads(line)
                if "hello" in message:
                    local_rank = int(message["hello"])
                    self._writers[local_rank] = writer
                    self._changed.set()
                    if local_rank in self._assign:
                        self._send(local_rank, self._assign[local_rank])
                elif "ready" in message and local_rank is not None:
                    self._ready.add(local_rank)
                    self._changed.set()
                elif "broken" in message and local_rank is not None:
                    self._broken.append(
                        BrokenReport(
                            local_rank, int(message["broken"]), str(message.get("error", "")),
                            by_peer=bool(message.get("by_peer")),
                        )
                    )
                    self._changed.set()
        except (ValueError, TypeError, ConnectionError, asyncio.LimitOverrunError) as e:
            logger.warning("dropping a bad line from worker local rank %s: %s", local_rank, e)
        finally:
            if local_rank is not None and self._writers.get(local_rank) is writer:
                del self._writers[local_rank]
                self._ready.discard(local_rank)
            writer.close()

    def _send(self, local_rank: int, data: bytes) -> None:
        writer = self._writers.get(local_rank)
        if writer is not None and not writer.is_closing():
            writer.write(data)


def _line(message: Mapping[str, object]) -> bytes:
    return (json.dumps(message) + "\n").encode()
