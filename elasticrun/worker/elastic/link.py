"""The worker's end of the line to its agent in in-process mode (no torch here).

The agent tells each of its workers, over a Unix socket named in
`ELASTICRUN_AGENT_SOCKET`, where it stands: `assign` (the worker's rank, world size and
master for a round, as the environment variables torchrun would have set) and `change`
(the round the worker is in is superseded; `interrupt` when a peer is gone, so any
collective in flight must be broken now rather than left to hang). The worker says
`hello` when the script imports the API, `ready` when it first asks for a round (its
start-up is done: the agent of a node joining a running job joins only then), and
`broken` when its training failed with no change announced, so the
agent can ask the rendezvous for a restart (a failure the budget pays for), unless the
round ends meanwhile (a collective that a peer's re-formation broke).

One JSON object per line in both directions. A reader thread keeps the latest word of
the agent, so the training loop only ever reads memory: `commit()` costs no syscall.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

#: the agent's socket; set only in in-process mode
SOCKET_VAR = "ELASTICRUN_AGENT_SOCKET"


class AgentGoneError(RuntimeError):
    """The agent closed the line: it is stopping this worker or has died."""


@dataclass(frozen=True, slots=True)
class WorkerAssignment:
    """This worker's place in one round: torchrun's variables for that round."""

    round: int
    env: Mapping[str, str]

    @property
    def rank(self) -> int:
        return int(self.env["RANK"])

    @property
    def world_size(self) -> int:
        return int(self.env["WORLD_SIZE"])

    @property
    def master_addr(self) -> str:
        return self.env["MASTER_ADDR"]

    @property
    def master_port(self) -> int:
        return int(self.env["MASTER_PORT"])


class AgentLink:
    """A connected line to this worker's agent."""

    def __init__(self, path: str, local_rank: int) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._assignment: WorkerAssignment | None = None
        self._superseded = 0  # the newest round the agent said is over
        self._lost = 0  # the newest round the agent said lost a peer
        self._gone = False
        self._on_change: Callable[[int, bool], None] | None = None
        self._said_ready = False
        self._send({"hello": local_rank, "pid": os.getpid()})
        threading.Thread(target=self._read, name="elasticrun-agent-link", daemon=True).start()

    @classmethod
    def from_env(cls) -> AgentLink | None:
        """The link when this worker runs in in-process mode, else None."""
        path = os.environ.get(SOCKET_VAR)
        if not path:
            return None
        # the real local rank: LOCAL_RANK is 0 for every worker under --isolate-gpus
        return cls(path, int(os.environ.get("ELASTICRUN_LOCAL_RANK", os.environ.get("LOCAL_RANK", "0"))))

    def on_change(self, callback: Callable[[int, bool], None] | None) -> None:
        """Call `callback(round, interrupt)` (from the reader thread) when the agent says a round is over.

        `interrupt` is set when a peer is gone."""
        with self._cond:
            self._on_change = callback

    def next_assignment(self, after: int) -> WorkerAssignment:
        """Block until the agent assigns a round newer than `after`."""
        if not self._said_ready:
            self._said_ready = True
            self._send({"ready": True})
        with self._cond:
            while self._assignment is None or self._assignment.round <= after:
                if self._gone:
                    raise AgentGoneError("the agent closed the line to this worker")
                self._cond.wait()
            return self._assignment

    def superseded(self, round_number: int) -> bool:
        """Whether the agent said round `round_number` is over (read from memory)."""
        return self._superseded >= round_number or (
            self._assignment is not None and self._assignment.round > round_number
        )

    def peer_lost(self, round_number: int) -> bool:
        """Whether the agent said round `round_number` lost a peer (read from memory)."""
        return self._lost >= round_number

    def report_broken(self, round_number: int, error: str, *, by_peer: bool) -> None:
        """Training failed in `round_number` with no change announced: tell the agent.

        `by_peer`: it failed in a collective, which a peer's re-formation breaks too."""
        self._send({"broken": round_number, "error": error, "by_peer": by_peer})

    def _send(self, message: Mapping[str, object]) -> None:
        data = (json.dumps(message) + "\n").encode()
        with self._send_lock:
            try:
                self._sock.sendall(data)
            except OSError as e:
                raise AgentGoneError(f"the agent closed the line to this worker: {e}") from e

    def _read(self) -> None:
        with self._sock.makefile("rb") as lines:
            for line in lines:
                message = json.loads(line)
                callback = None
                with self._cond:
                    if "assign" in message:
                        self._assignment = WorkerAssignment(message["assign"], message["env"])
                    elif "change" in message:
                        self._superseded = max(self._superseded, int(message["change"]))
                        if message.get("interrupt"):
                            self._lost = max(self._lost, int(message["change"]))
                        callback = self._on_change
                    self._cond.notify_all()
                if callback is not None:
                    callback(int(message["change"]), bool(message.get("interrupt")))
        with self._cond:
            self._gone = True
            self._cond.notify_all()
