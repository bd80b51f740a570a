"""Which of a ShardedState's commits every rank keeps for the buddy nodes: agreed at its commits.

In restart mode each agent copies its workers' commits to a buddy node
(elasticrun.agent.state_replicas) at its own pace. Were each to copy its newest, ranks'
buddies would hold different commits, and the ranks themselves keep only their last
few: a node lost while commits outpace the copies (a commit every step, a copy that
takes seconds) would leave its ranks' shards at one commit and every other rank's at a
later one, and no step to resume from. Agreeing on what to copy needs no agent: the
workers commit in lockstep already. So:

- each rank pins two commits in its file (elasticrun.state_layout): the *candidate*,
  which its agent copies to the buddy node, and the *safe* one, which every rank's
  buddy holds;
- after each commit every rank puts in whether its buddy holds its candidate (the
  agent's ack in the file), in one one-element all-reduce (MIN), started then and read
  at the next commit, so it never holds a step up;
- when every buddy holds the candidate, every rank, at the same commit, makes it the
  safe one, and that commit the next candidate.

The candidates thus have the same count on every rank, and the safe commit is at every
moment in every rank's file and with every rank's buddy (which keeps the last two it
was sent). When copies keep up, the candidate moves every few commits; when they lag,
it waits for them, and a node lost meanwhile costs the steps since the safe commit,
never the shards.

The all-reduce goes through a gloo group of its own: the flag lives on the CPU, so
reading it never waits for a GPU's queue, and it is ordered apart from the training's
collectives. A new group starts with no pins: until its first candidate is with every
buddy (a look of the agent and a copy), a node lost holds no commit in common (as when
the ring of nodes changes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from elasticrun.worker.elastic.host_copy import HostCopy


class BuddyPins:
    """One rank's side of the agreement, for the life of its group."""

    def __init__(self, host: HostCopy) -> None:
        """Collective: every rank of the group makes its BuddyPins at the group's start."""
        self._host = host
        self._group = dist.new_group(backend="gloo")
        #: the generations pinned in this rank's file (0: none yet)
        self._candidate = 0
        self._safe = 0
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._pending: dist.Work | None = None
        host.pin(0, 0)

    def before_write(self) -> None:
        """At a commit, before its write: take the last agreement; a first or a confirmed candidate moves on."""
        everyone = False
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
            everyone = bool(self._flag.item())
        if everyone or not self._candidate:
            self._safe = self._candidate if everyone else self._safe
            self._candidate = self._host.next_generation
            self._host.pin(self._candidate, self._safe)

    def after_write(self) -> None:
        """Start the agreement the next commit reads: does every rank's buddy hold its candidate?"""
        self._flag[0] = int(self._host.buddy_holds(self._candidate))
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MIN, group=self._group, async_op=True)
