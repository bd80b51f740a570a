"""Training state that survives membership changes without a checkpoint file.

    state = State(model=model, optimizer=optimizer, step=0)
    state.step += 1
    state.commit()

`commit()` keeps an in-memory copy (the point a failed step rolls back to) and is where
a pending membership change is noticed; `restore()` rolls back to it; `sync()` makes
every rank of a new group hold the newest commit any rank has: new workers get it from
a survivor, never from disk, and survivors move nothing among themselves.

In restart mode (the wrapper outside in-process mode, under elasticrun) `commit()`
copies the state into host memory the agent keeps for the worker instead (host_copy.py),
and the wrapper restores the newest whole commit from there when a restarted worker
starts: `restored`, `restored_from`. `ShardedState` is a State whose values are each
rank's own: nothing is sent between ranks, and a restart resumes from a commit every
rank holds.

Each commit carries its lineage: how many commits led to it and the round it was made
in. Two ranks hold the same state only if their lineages are equal; a count alone is
not enough: a node that froze just after committing one step more than the
others, and came back when the others had committed as often in a later round without
it, holds another state under the same count. `sync()` thus copies to every rank whose
lineage is not the newest, whatever its count.

Each named object is kept by what it is: a `torch.nn.Module` by its tensors, anything else with `state_dict()` and
`load_state_dict()` (an optimizer, an LR scheduler, a GradScaler) by its state dict,
and plain values by value. `sync()` sends every tensor among them as a tensor (in
buckets, so nccl moves GPU tensors GPU to GPU) and what is left, the structure of the
state dicts and the plain values, as plain data (`structure`): nothing is pickled, so
nothing a peer sends can run code here.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from elasticrun.errors import StateTransferError
from elasticrun.worker.elastic.buddy_pins import BuddyPins
from elasticrun.worker.elastic.dtensors import as_module_holds, as_optimizer_holds, local
from elasticrun.worker.elastic.host_copy import HostCopy, Record
from elasticrun.worker.elastic.session import flag_device
from elasticrun.worker.elastic.structure import MAX_BYTES, TensorHole, decode, encode
from elasticrun.worker.steptime import mark as mark_step


class MembershipChanged(BaseException):
    """Raised by `commit()` when the job's membership changed: the wrapper re-forms.

    A BaseException, like KeyboardInterrupt, so a script's `except Exception` does not
    swallow it.
    """


class _Slot(Protocol):
    def snapshot(self) -> None: ...
    def restore(self) -> None: ...


class _ModuleSlot:
    def __init__(self, module: torch.nn.Module) -> None:
        self.value = module
        self._copy: dict[str, torch.Tensor] = {}

    def snapshot(self) -> None:
        self._copy = {k: v.detach().clone() for k, v in self.value.state_dict().items()}

    def restore(self) -> None:
        self.value.load_state_dict(self._copy)

    def tensors(self) -> list[torch.Tensor]:
        """The module's tensors, sharing storage with it (a broadcast into them loads it)."""
        return list(self.value.state_dict().values())

    def payload(self) -> Any:
        return self.value.state_dict()

    def load(self, payload: Any) -> None:
        self.value.load_state_dict(payload)


class _StatefulSlot:
    """An object with state_dict() / load_state_dict(), e.g. an optimizer."""

    def __init__(self, obj: Any) -> None:
        self.value = obj
        self._copy: Any = None

    def snapshot(self) -> None:
        self._copy = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._copy))

    def payload(self) -> Any:
        return self.value.state_dict()

    def load(self, payload: Any) -> None:
        self.value.load_state_dict(payload)


class _ValueSlot:
    def __init__(self, value: Any) -> None:
        self.value = value
        self._copy: Any = None

    def snapshot(self) -> None:
        self._copy = copy.deepcopy(self.value)

    def restore(self) -> None:
        self.value = copy.deepcopy(self._copy)

    def payload(self) -> Any:
        return self.value

    def load(self, payload: Any) -> None:
        self.value = payload


def _as_held(slot: _ModuleSlot | _StatefulSlot | _ValueSlot, payload: Any) -> Any:
    """A payload read back from host memory, its tensors DTensors where the slot's object holds them (dtensors.py)."""
    if isinstance(slot, _ModuleSlot):
        return as_module_holds(payload, slot.value)
    if isinstance(slot.value, torch.optim.Optimizer):
        return as_optimizer_holds(payload, slot.value)
    return payload


def _slot(value: Any) -> _ModuleSlot | _StatefulSlot | _ValueSlot:
    if isinstance(value, torch.nn.Module):
        return _ModuleSlot(value)
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return _StatefulSlot(value)
    return _ValueSlot(value)


class State:
    """Named training objects, committed, restored and synced together.

    Read and set them as attributes (`state.step += 1`); only plain values can be
    replaced, models and optimizers are changed in place.
    """

    def __init__(self, **objects: Any) -> None:
        if not objects:
            raise ValueError("State() needs at least one object, e.g. State(model=model, step=0)")
        slots = {name: _slot(value) for name, value in objects.items()}
        object.__setattr__(self, "_slots", slots)
        object.__setattr__(self, "commits", 0)
        #: the round of the group the last commit was made in (0: none, or outside the
        #: elastic wrapper): with `commits`, the commit's lineage
        object.__setattr__(self, "committed_in", 0)
        #: the round of the group this process is in now (the elastic wrapper sets it)
        object.__setattr__(self, "_round", 0)
        #: set by the elastic wrapper: raises MembershipChanged when the round is over
        object.__setattr__(self, "_check", None)
        #: whether this process's state came out of a sync (see sync())
        object.__setattr__(self, "_synced_before", False)
        #: whether the wrapper found a commit to resume from, and where: "own memory"
        #: (this worker's copy the agent kept, restart mode), "buddy" (the copy another
        #: node kept of this rank), "a peer" (sent by another rank, see sync()) or
        #: "nothing" (the script starts from what it built)
        object.__setattr__(self, "restored", False)
        object.__setattr__(self, "restored_from", "nothing")
        #: restart mode: the host memory the commits are copied to (set by the wrapper)
        object.__setattr__(self, "_host", None)
        #: whether the last commit's copy is the newest in `_host` rather than in the
        #: slots: a commit copied out of the process needs no second copy in it
        object.__setattr__(self, "_rollback_in_host", False)
        #: commit() calls since the group's start (commit(every=...) counts them), and
        #: when the last commit was made (commit(seconds=...))
        object.__setattr__(self, "_calls", 0)
        object.__setattr__(self, "_committed_at", time.monotonic())
        for slot in slots.values():
            slot.snapshot()

    def __getattr__(self, name: str) -> Any:
        try:
            return self._slots[name].value
        except KeyError:
            raise AttributeError(f"State has no {name!r}; it holds {', '.join(self._slots)}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        slot = self._slots.get(name)
        if not isinstance(slot, _ValueSlot):
            what = "holds no" if slot is None else "cannot replace its"
            raise AttributeError(f"State {what} {name!r}: give every object to State(...) at the start")
        slot.value = value

    def commit(self, *, every: int | None = None, seconds: float | None = None) -> None:
        """Keep a copy of the state; then leave the loop if the membership changed.

        Called once a step. Each call ends a step for the step timing
        (`elasticrun.worker.steptime`) and, under the elastic wrapper in in-process mode,
        runs one one-element all_reduce so that every rank notices a change at the same
        call. A commit is a copy of the state: in the process, or in restart mode in host
        memory the agent keeps (then not also in the process), from which a worker
        restarted after a failure resumes.

        Every call commits, or, when copying the state is costly, every `every`-th call
        (counted from the group's start), or the first call once `seconds` have passed
        since the last commit (with both, whichever comes first); every rank commits at
        the same calls. A failure rolls back to the last commit.
        """
        if every is not None and every < 1:
            raise ValueError(f"commit(every=...) must be a count >= 1, got {every!r}")
        if seconds is not None and not seconds > 0:
            raise ValueError(f"commit(seconds=...) must be > 0, got {seconds!r}")
        mark_step("commit")
        object.__setattr__(self, "_calls", self._calls + 1)
        if self._due(every, seconds):
            object.__setattr__(self, "commits", self.commits + 1)
            object.__setattr__(self, "committed_in", self._round)
            copied = self._host is not None
            if self._host is not None:
                self._copy_out(self._host)  # the rollback point too: no copy in the process
            else:
                for slot in self._slots.values():
                    slot.snapshot()
            object.__setattr__(self, "_rollback_in_host", copied)
            object.__setattr__(self, "_committed_at", time.monotonic())
        if self._check is not None:
            self._check()

    def _due(self, every: int | None, seconds: float | None) -> bool:
        if every is None and seconds is None:
            return True
        due = every is not None and self._calls % every == 0
        if seconds is not None and not due:
            due = time.monotonic() - self._committed_at >= seconds
            if dist.is_initialized() and dist.get_world_size() > 1:  # clocks differ: agree
                flag = torch.tensor([int(due)], device=flag_device())
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                due = bool(flag.item())
        return due

    def _copy_out(self, host: HostCopy) -> None:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        named = ((name, slot.payload()) for name, slot in self._slots.items())
        host.write(named, self.commits, self.committed_in, rank, world, self._stepped())

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [s.value for s in self._slots.values() if isinstance(s.value, torch.optim.Optimizer)]

    def _stepped(self) -> frozenset[int]:
        """The tensors that only the state's optimizers change, in their step(), by `data_ptr()`.

        The parameters they update and their own state: a commit copies these while the
        next step runs (host_copy.py), and the rest of the state (buffers, which a forward
        may change, and plain tensors) before it returns."""
        ptrs: set[int] = set()
        for optimizer in self._optimizers():
            for group in optimizer.param_groups:
                ptrs.update(local(p).data_ptr() for p in group["params"])
            for per_param in optimizer.state.values():
                ptrs.update(local(v).data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor))
        return frozenset(ptrs)

    def _keep_in(self, host: HostCopy | None) -> None:
        """Restart mode: resume from the last commit `host` holds, and copy commits there from now on.

        Called by the wrapper on every rank (a ShardedState agrees with the others on
        the commit), before sync()."""
        record = self._choose(host.held() if host is not None else [])
        if host is not None and record is not None:
            self._load(host, record)
            object.__setattr__(self, "commits", record.commits)
            object.__setattr__(self, "committed_in", record.round)
            object.__setattr__(self, "restored", True)
            object.__setattr__(self, "restored_from", host.source(record))
            object.__setattr__(self, "_rollback_in_host", record == host.held()[-1])
            if not self._rollback_in_host:  # an older commit (a ShardedState's agreement)
                for slot in self._slots.values():
                    slot.snapshot()
        object.__setattr__(self, "_host", host)
        if host is not None:  # a commit's copy in flight ends before an optimizer changes what it copies
            for optimizer in self._optimizers():
                optimizer.register_step_pre_hook(lambda *_: host.guard())

    def _load(self, host: HostCopy, record: Record) -> None:
        # tensors that were on a GPU go back to this process's current one
        gpu = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        payloads = host.read(record, gpu or torch.device("cpu"))
        for name, payload in payloads.items():
            slot = self._slots[name]
            # A module copies the tensors into its own; anything else may keep them
            # (an optimizer keeps its state's): those get copies of their own.
            slot.load(_as_held(slot, payload if isinstance(slot, _ModuleSlot) else _cloned(payload)))

    def _choose(self, held: list[Record]) -> Record | None:
        """The commit to resume from, of those this rank's host copy holds: the newest.

        (sync() then gives every rank the newest any rank holds.)"""
        return held[-1] if held else None

    def restore(self) -> None:
        """Roll back to the last commit."""
        if self._rollback_in_host:
            assert self._host is not None  # set with it
            self._host.settle()
            self._load(self._host, self._host.held()[-1])
            return
        for slot in self._slots.values():
            slot.restore()

    def sync(self) -> None:
        """Give every rank of the current group the newest commit any rank holds.

        Collective: every rank calls it (the elastic wrapper does, after each re-forming).
        The newest commit is the one with the most commits, of the latest round among
        those. Ranks that hold it, by its lineage (as many commits, the last made in
        the same round), and have synced before (they trained in the same rounds, so
        their commits are the same) are current and keep their state; each other rank
        receives it from one of them, newcomers spread over the current ranks, whatever
        its own count. A node leaving moves no state at all; a node joining moves one
        copy per newcomer. In a group where no one has synced yet (a job's first round),
        the lowest rank with the newest commit is the one source.
        """
        object.__setattr__(self, "_calls", 0)  # every rank counts commit() calls afresh
        if not dist.is_initialized():
            return
        if dist.get_world_size() == 1:
            object.__setattr__(self, "_synced_before", True)
            return
        device = flag_device()
        mine = torch.tensor(
            [self.commits, self.committed_in, int(self._synced_before)], dtype=torch.int64, device=device
        )
        gathered = [torch.zeros(3, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        held = [((int(t[0].item()), int(t[1].item())), bool(t[2].item())) for t in gathered]
        newest = max(lineage for lineage, _ in held)
        candidates = [r for r, (lineage, _) in enumerate(held) if lineage == newest]
        current = [r for r in candidates if held[r][1]] or candidates[:1]
        behind = [r for r in range(len(held)) if r not in current]
        rank = dist.get_rank()
        if rank in current:
            for i, receiver in enumerate(behind):
                if current[i % len(current)] == rank:
                    self._send_to(receiver)
        else:
            self._receive_from(current[behind.index(rank) % len(current)])
            if newest[0] > 0:
                object.__setattr__(self, "restored", True)
                object.__setattr__(self, "restored_from", "a peer")
        object.__setattr__(self, "commits", newest[0])
        object.__setattr__(self, "committed_in", newest[1])
        object.__setattr__(self, "_synced_before", True)
        if rank in current and self._rollback_in_host:
            return  # unchanged, and its last commit is in host memory
        object.__setattr__(self, "_rollback_in_host", False)
        for slot in self._slots.values():
            slot.snapshot()

    def _module_tensors(self) -> list[torch.Tensor]:
        return [t for slot in self._slots.values() if isinstance(slot, _ModuleSlot) for t in slot.tensors()]

    def _send_to(self, receiver: int) -> None:
        others: list[torch.Tensor] = []
        payloads = {n: s.payload() for n, s in self._slots.items() if not isinstance(s, _ModuleSlot)}
        _send_structure(_hollow(payloads, others), receiver)
        _send_tensors(self._module_tensors() + others, receiver)

    def _receive_from(self, sender: int) -> None:
        others: list[torch.Tensor] = []
        payloads = _fill(_receive_structure(sender), others)
        _receive_tensors(self._module_tensors() + others, sender)
        for name, payload in payloads.items():
            self._slots[name].load(payload)

    def _attach(self, check: Callable[[], None] | None, round_number: int | None = None) -> None:
        """Take the elastic wrapper's membership check, and the round of the group this process is now in.

        The round (when given) is what the commits made from now on carry."""
        object.__setattr__(self, "_check", check)
        if round_number is not None:
            object.__setattr__(self, "_round", round_number)


class ShardedState(State):
    """A State whose values are each rank's own (its shard): never sent to another rank.

    For what differs from rank to rank: FSDP's, tensor or pipeline parallel parameters
    and optimizer state (DTensors are kept as their local shards and made DTensors
    again on restore: dtensors.py), per-rank RNG states, data-loader positions. sync()
    moves nothing. In restart mode a restarted group resumes from the last commit that every
    rank holds, made at the same rank and world size (each host copy keeps its last two
    commits, and ranks that commit in step are at most one apart, so a worker killed
    during a commit costs one step). Where no such commit exists (the world size
    changed, ranks moved, a rank's copy is gone) no rank restores: `restored` is False on all, since
    shards of different steps would not make one model, and `earlier` offers the last
    commit the group's workers hold, made at its own world size: every shard of it to
    re-shard from (`EarlierShards.gather`), or the ranks whose shard is gone
    (`EarlierShards.lost`), when the script starts from its own checkpoint instead.
    Commits are also kept by a buddy node, those every rank agreed on (buddy_pins.py), and
    every rank keeps the last of them that every buddy holds: so a node's loss loses no
    shard where a newcomer takes its place (`restored_from` "buddy"), and costs the steps
    since that commit.
    """

    def __init__(self, **objects: Any) -> None:
        super().__init__(**objects)
        #: set when the group starts: the last commit held, made at another world size or
        #: with ranks elsewhere, when there is no commit to resume from (see the class doc)
        object.__setattr__(self, "earlier", None)
        #: the copies of other nodes' ranks this worker was handed, to offer in `earlier`
        object.__setattr__(self, "_replicas", [])
        #: restart mode, in a group of two ranks or more: which commits the buddies are to hold
        object.__setattr__(self, "_pins", None)

    def sync(self) -> None:
        """Nothing moves: each rank's values are its own."""
        object.__setattr__(self, "_calls", 0)  # every rank counts commit() calls afresh
        object.__setattr__(self, "_synced_before", True)

    def _keep_in(self, host: HostCopy | None) -> None:
        """As State's, and where the last commit was made at this world size, each rank takes its own shard.

        That commit's ranks are elsewhere now (a fixed-size job whose replacement node came
        in at another node rank): each rank takes its own rank's shard of it from whoever
        holds it, a collective."""
        super()._keep_in(host)
        if host is not None and dist.is_initialized() and dist.get_world_size() > 1:
            object.__setattr__(self, "_pins", BuddyPins(host))
        earlier = self.earlier
        if earlier is None or earlier.lost or earlier.world != dist.get_world_size():
            return
        rank = dist.get_rank()
        source = earlier.source_of(rank)
        for name, payload in earlier.gather([rank])[rank].items():
            self._slots[name].load(_as_held(self._slots[name], payload))
            self._slots[name].snapshot()
        object.__setattr__(self, "commits", earlier.commits)
        object.__setattr__(self, "committed_in", earlier.round)
        object.__setattr__(self, "restored", True)
        object.__setattr__(self, "restored_from", source)
        object.__setattr__(self, "_rollback_in_host", False)
        object.__setattr__(self, "earlier", None)

    def _copy_out(self, host: HostCopy) -> None:
        """As State's, between the steps of the agreement on what the buddy nodes hold (buddy_pins)."""
        if self._pins is not None:
            self._pins.before_write()
        super()._copy_out(host)
        if self._pins is not None:
            self._pins.after_write()

    def _choose(self, held: list[Record]) -> Record | None:
        """The newest commit every rank holds for its own rank and world size (a collective).

        Where there is none, `earlier` is set to what the group holds of an earlier one:
        in the workers' own files, and in the copies of other nodes' ranks that their
        agents keep (local rank 0 is handed its node's)."""
        object.__setattr__(self, "earlier", None)
        if not dist.is_initialized():
            return held[-1] if held else None
        rank, world = dist.get_rank(), dist.get_world_size()
        replicas = HostCopy.replicas_from_env()
        object.__setattr__(self, "_replicas", replicas)
        rows = [(r.commits, r.round, r.rank, r.world, 1) for r in held]
        rows += [(r.commits, r.round, r.rank, r.world, 0) for kept in replicas for r in kept.held()]
        everyone = _all_gathered(rows, 5)
        mine = {r.commits: r for r in held if (r.rank, r.world) == (rank, world)}
        common = set.intersection(
            *({c for c, _, r, w, own in records if own and (r, w) == (q, world)} for q, records in enumerate(everyone))
        )
        if common:
            return mine[max(common)]
        earlier = EarlierShards.of([[row[:4] for row in records] for records in everyone], self)
        object.__setattr__(self, "earlier", earlier)
        if earlier is not None and earlier.lost and rank == 0:
            print(
                f"elasticrun: no shard of ranks {list(earlier.lost)} of the last commit ({earlier.commits}, made at "
                f"world size {earlier.world}) is left: lost with their workers' memory; the state starts from what "
                "the script built",
                file=sys.stderr, flush=True,
            )
        return None

    def _read_own(self, commits: int, round_number: int, rank: int, world: int) -> dict[str, Any]:
        """The payloads of a commit this worker's host copy, or a replica handed to it, holds.

        Views of the file: valid until it is overwritten."""
        for kept in [c for c in (self._host, *self._replicas) if c is not None]:
            for record in kept.held():
                if (record.commits, record.round, record.rank, record.world) == (commits, round_number, rank, world):
                    payloads: dict[str, Any] = kept.read(record, torch.device("cpu"))
                    return payloads
        raise StateTransferError(f"commit {commits} of rank {rank} is no longer in this worker's host memory")


class EarlierShards:
    """The last commit a ShardedState's new group holds, made at another world size or with ranks elsewhere.

    `world` is the world size it was made at, `commits` its count, and `lost` the ranks
    of it whose shard no worker of the group holds (a node lost with its memory). Read
    it at the top of the function, before the round's first commits: a worker's host
    copy keeps only its last two commits and the two pinned for the buddies, and the new
    round's commits overwrite the earlier one.
    """

    def __init__(
        self, world: int, commits: int, round_number: int, holders: dict[int, int], state: ShardedState
    ) -> None:
        self.world = world
        self.commits = commits
        #: the round it was made in
        self.round = round_number
        #: each rank of the commit's world -> the rank of the new group that holds its shard
        self._holders = holders
        self._state = state
        self.lost = tuple(r for r in range(world) if r not in holders)

    @classmethod
    def of(cls, everyone: list[list[tuple[int, ...]]], state: ShardedState) -> EarlierShards | None:
        """The newest commit whose every shard some rank holds; else the newest held at all (its `lost` said).

        `everyone`: each rank's records, as (commits, round, rank, world size)."""
        holders: dict[tuple[int, int, int], dict[int, int]] = {}
        for holder, records in enumerate(everyone):
            for commits, round_number, rank, world in records:
                holders.setdefault((commits, round_number, world), {}).setdefault(rank, holder)
        if not holders:
            return None
        whole = [key for key, held in holders.items() if len(held) == key[2]]
        # the newest: of the latest round (a script that started afresh counts its commits from 1 again)
        commits, round_number, world = max(whole or holders, key=lambda key: (key[1], key[0]))
        return cls(world, commits, round_number, holders[(commits, round_number, world)], state)

    def source_of(self, rank: int) -> str:
        """Where this worker would get `rank`'s shard from.

        "a peer" (another worker), "own memory" (its own file) or "buddy" (a copy its
        agent kept of another node's rank)."""
        if self._holders.get(rank) != dist.get_rank():
            return "a peer"
        own = self._state._host.held() if self._state._host is not None else []
        mine = any((r.commits, r.round, r.rank, r.world) == (self.commits, self.round, rank, self.world) for r in own)
        return "own memory" if mine else "buddy"

    def gather(self, ranks: list[int]) -> dict[int, dict[str, Any]]:
        """The shards of `ranks` (ranks of the commit's world), each as its named values.

        Collective: every rank of the new group calls it, each with the ranks it needs
        (none is fine). A module's shard comes as its state dict, an optimizer's as its
        state dict, a plain value as itself, each in a copy of its own. Each shard moves
        once per rank that asks for it, from the worker that holds it."""
        asked = sorted(set(ranks))
        if any(not 0 <= r < self.world for r in asked):
            raise ValueError(f"gather({ranks}): the commit was made at world size {self.world}")
        gone = [r for r in asked if r in self.lost]
        if gone:
            raise StateTransferError(
                f"the shards of ranks {gone} of commit {self.commits} (world size {self.world}) are gone "
                "with their workers' memory: start from the script's own checkpoint"
            )
        me = dist.get_rank()
        wanted = _all_gathered([(r,) for r in asked], 1)
        got: dict[int, dict[str, Any]] = {}
        for rank in range(self.world):  # every rank goes through the transfers in one order: none waits on another
            holder = self._holders.get(rank)
            for asker, wants in enumerate(wanted):
                if (rank,) not in wants or me not in (holder, asker) or holder is None:
                    continue
                if holder == asker:
                    got[rank] = _cloned(self._state._read_own(self.commits, self.round, rank, self.world))
                elif holder == me:
                    tensors: list[torch.Tensor] = []
                    payloads = self._state._read_own(self.commits, self.round, rank, self.world)
                    _send_structure(_hollow(payloads, tensors), asker)
                    _send_tensors(tensors, asker)
                else:
                    received: list[torch.Tensor] = []
                    got[rank] = _fill(_receive_structure(holder), received)
                    _receive_tensors(received, holder)
        return got


def _all_gathered(rows: Sequence[tuple[int, ...]], width: int) -> list[list[tuple[int, ...]]]:
    """Each rank's `rows` (tuples of `width` ints, none negative), as every rank sees them.

    A collective: one all_gather of the row counts, then one of a table of the largest
    count's size, rows left empty marked -1."""
    device = flag_device()
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([len(rows)], dtype=torch.int64, device=device))
    table = torch.full((max(1, *(int(c.item()) for c in counts)), width), -1, dtype=torch.int64)
    for i, row in enumerate(rows):
        table[i] = torch.tensor(row, dtype=torch.int64)
    table = table.to(device)
    gathered = [torch.empty_like(table) for _ in counts]
    dist.all_gather(gathered, table)
    return [[tuple(row) for row in t.cpu().tolist() if row[0] >= 0] for t in gathered]


#: the most bytes of tensors copied into one buffer for one broadcast
_BUCKET_BYTES = 64 << 20


def _send_structure(obj: Any, receiver: int) -> None:
    """One message: its length, then its bytes (as uint8 tensors, so nccl carries them)."""
    data = encode(obj)
    device = flag_device()
    dist.send(torch.tensor([len(data)], dtype=torch.int64, device=device), dst=receiver)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), dst=receiver)


def _receive_structure(sender: int) -> Any:
    device = flag_device()
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src=sender)
    length = int(size.item())
    if not 0 < length <= MAX_BYTES:
        raise StateTransferError(f"rank {sender} announced a state structure of {length} bytes (1..{MAX_BYTES})")
    data = torch.empty(length, dtype=torch.uint8, device=device)
    dist.recv(data, src=sender)
    return decode(bytes(data.cpu().tolist()))


def _hollow(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """`obj` with each tensor replaced by a TensorHole; the tensors go to `tensors`."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return TensorHole(len(tensors) - 1, tuple(obj.shape), obj.dtype, obj.device.type == "cpu")
    if isinstance(obj, dict):
        return {k: _hollow(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_hollow(v, tensors) for v in obj)
    return obj


def _cloned(obj: Any) -> Any:
    """`obj` with each tensor replaced by a copy of its own."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _cloned(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cloned(v) for v in obj)
    return obj


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of _hollow on a receiver: new, empty tensors in the holes."""
    if isinstance(obj, TensorHole):
        device = torch.device("cpu") if obj.on_cpu else flag_device()
        tensors.append(torch.empty(obj.shape, dtype=obj.dtype, device=device))
        return tensors[-1]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors grouped for transfer: one dtype per bucket, at most _BUCKET_BYTES (or one bigger tensor).

    Sender and receiver hold tensors of the same shapes and dtypes in the same order, so
    both make the same buckets.

    Small tensors travel together, so an optimizer with thousands of small states costs
    a few messages, not thousands, and a big model is never copied whole.
    """
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for tensor in sorted(tensors, key=lambda t: str(t.dtype)):
        if not buckets or buckets[-1][0].dtype != tensor.dtype or size + tensor.nbytes > _BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += tensor.nbytes
    return buckets


def _lone(bucket: list[torch.Tensor], device: torch.device) -> bool:
    """Whether the bucket is one tensor that can travel as it is (no copy)."""
    return len(bucket) == 1 and bucket[0].device == device and bucket[0].is_contiguous()


@torch.no_grad()
def _send_tensors(tensors: list[torch.Tensor], receiver: int) -> None:
    device = flag_device()
    for bucket in _buckets(tensors):
        flat = bucket[0].view(-1) if _lone(bucket, device) else torch.cat([t.reshape(-1).to(device) for t in bucket])
        dist.send(flat, dst=receiver)


@torch.no_grad()
def _receive_tensors(tensors: list[torch.Tensor], sender: int) -> None:
    device = flag_device()
    for bucket in _buckets(tensors):
        if _lone(bucket, device):
            dist.recv(bucket[0].view(-1), src=sender)  # straight into the tensor
            continue
        flat = torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=device)
        dist.recv(flat, src=sender)
        for tensor, part in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
            tensor.copy_(part.view_as(tensor))
