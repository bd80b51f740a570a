"""DTensors in a commit: each kept as this rank's shard, and made a DTensor again when restored.

FSDP2 (`fully_shard`) and tensor parallelism over a DeviceMesh hold parameters, and so
their optimizers' states, as DTensors: each rank's part is its local tensor, and that is
what a ShardedState keeps of it. A DTensor's own bytes cannot be copied into host memory
as they are (its `data_ptr()` is 0, and torch refuses to copy a DTensor into a plain
tensor), so a commit takes its local tensor (a view: nothing is gathered).

What comes back from host memory is plain tensors. FSDP2's modules load only DTensors,
and an optimizer holding plain states for DTensor parameters fails at its next step; so
each tensor read back is made a DTensor again where the object in the state holds one
there: a module's tensors take the mesh, placements, global shape and stride of the
module's own state dict, an optimizer's states those of the parameter they belong to.

torch.distributed.tensor is never imported here: while nothing has imported it, no
tensor can be a DTensor.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def _dtensor_type() -> Any:
    """DTensor's class, or None while torch.distributed.tensor is not imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: its local tensor if it is a DTensor, else itself."""
    dtensor = _dtensor_type()
    return tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor) else tensor


def _like(template: Any, loaded: Any) -> Any:
    """`loaded` (a plain tensor read back) as a DTensor laid out as `template`, where `template` is one of its shape."""
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(template, dtensor) or not isinstance(loaded, torch.Tensor):
        return loaded
    mine = template.to_local()
    if isinstance(loaded, dtensor) or loaded.shape != mine.shape:
        return loaded
    return dtensor.from_local(
        loaded.to(mine.device), template.device_mesh, template.placements,
        run_check=False, shape=template.shape, stride=template.stride(),
    )


def as_module_holds(loaded: dict[str, Any], module: torch.nn.Module) -> dict[str, Any]:
    """A module's state dict read back, its tensors DTensors where the module's are."""
    current = module.state_dict()
    return {name: _like(current.get(name), value) for name, value in loaded.items()}


def as_optimizer_holds(loaded: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's state dict read back, each state tensor a DTensor where its parameter is one.

    (Its states are keyed by the parameters' order in its groups, as `state_dict()` numbers them.)"""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {
        index: {key: _like(params[index], value) for key, value in per_param.items()}
        if isinstance(index, int) and 0 <= index < len(params) and isinstance(per_param, dict)
        else per_param
        for index, per_param in loaded.get("state", {}).items()
    }
    return {**loaded, "state": state}
