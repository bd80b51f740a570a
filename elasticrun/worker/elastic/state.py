"""Training state that survives membership changes without a checkpoint file.

    state = State(model=model, optimizer=optimizer, step=0)
    state.step += 1
    state.commit()

`commit()` keeps an in-memory copy (the point a failed step rolls back to) and is where
a pending membership change is noticed; `restore()` rolls back to it; `sync()` makes
every rank of a new group hold the newest commit any rank has, by broadcast: new
workers get the model from a survivor, never from disk.

Each named object is kept by what it is: a `torch.nn.Module` by its tensors (broadcast
as tensors, so nccl moves them GPU to GPU), anything else with `state_dict()` and
`load_state_dict()` (an optimizer, an LR scheduler, a GradScaler) by its state dict,
and plain values by value. Both of the latter travel in one pickled broadcast.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from elasticrun.worker.elastic.session import flag_device


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

    @torch.no_grad()
    def broadcast(self, root: int) -> None:
        for tensor in self.value.state_dict().values():
            dist.broadcast(tensor, src=root)


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
        #: set by the elastic wrapper: raises MembershipChanged when the round is over
        object.__setattr__(self, "_check", None)
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

    def commit(self) -> None:
        """Keep a copy of the state; then leave the loop if the membership changed.

        Cheap (an in-memory copy, plus one one-element all_reduce under the elastic
        wrapper so that every rank notices a change at the same commit).
        """
        for slot in self._slots.values():
            slot.snapshot()
        object.__setattr__(self, "commits", self.commits + 1)
        if self._check is not None:
            self._check()

    def restore(self) -> None:
        """Roll back to the last commit."""
        for slot in self._slots.values():
            slot.restore()

    def sync(self) -> None:
        """Give every rank of the current group the newest commit any rank holds.

        Collective: every rank calls it (the elastic wrapper does, after each re-forming).
        The source is the lowest rank among those with the most commits.
        """
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        counts = [torch.zeros(1, dtype=torch.int64, device=flag_device()) for _ in range(dist.get_world_size())]
        dist.all_gather(counts, torch.tensor([self.commits], dtype=torch.int64, device=flag_device()))
        newest = max(int(c.item()) for c in counts)
        root = next(r for r, c in enumerate(counts) if int(c.item()) == newest)
        objects: dict[str, Any] = {}
        for name, slot in self._slots.items():
            if isinstance(slot, _ModuleSlot):
                slot.broadcast(root)
            else:
                objects[name] = slot.payload()
        box = [objects if dist.get_rank() == root else None]
        dist.broadcast_object_list(box, src=root)
        if dist.get_rank() != root:
            for name, payload in box[0].items():  # type: ignore[union-attr]
                self._slots[name].load(payload)  # type: ignore[union-attr]
        object.__setattr__(self, "commits", newest)
        for slot in self._slots.values():
            slot.snapshot()

    def _attach(self, check: Callable[[], None] | None) -> None:
        object.__setattr__(self, "_check", check)
