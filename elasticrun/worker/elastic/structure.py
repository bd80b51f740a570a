"""The wire format of a state's structure: plain data only, never pickle.

`State.sync()` sends tensors as tensors and the rest of a state (the shape of the state
dicts, step counters, learning rates, plain values) as one message in this format. It is
JSON with tagged containers, read back by a decoder that only builds None, booleans,
numbers, strings, bytes, lists, tuples, dicts and tensor holes: nothing a peer sends can
name a class or a function to run, as a pickle can. Anything else is refused on the
sending side, with its type, so a state with an object of its own fails loudly at its
first sync, not silently on a peer.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from typing import Any

import torch

from elasticrun.errors import StateTransferError
from elasticrun.state_layout import MAX_STRUCTURE_BYTES

#: the largest structure a rank accepts: far above any optimizer's, far below harm
MAX_BYTES = MAX_STRUCTURE_BYTES

_DTYPE_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True, slots=True)
class TensorHole:
    """Where a tensor was in a state dict: what the receivers allocate."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_cpu: bool


def encode(obj: Any) -> bytes:
    """`obj` (plain data and TensorHoles) as bytes; StateTransferError names what is not."""
    return json.dumps(_tagged(obj), separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """What `encode` made, rebuilt; anything else is a StateTransferError, never code."""
    if len(data) > MAX_BYTES:
        raise StateTransferError(f"a peer sent a state structure of {len(data)} bytes (at most {MAX_BYTES})")
    try:
        return _untagged(json.loads(data))
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise StateTransferError(
            f"a peer sent something that is not a state structure ({type(e).__name__}: {e}); "
            "refused: state travels as plain data and tensors, never as pickle"
        ) from None


def _tagged(obj: Any) -> Any:
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, TensorHole):
        return {"h": [obj.index, list(obj.shape), str(obj.dtype).removeprefix("torch."), obj.on_cpu]}
    if isinstance(obj, dict):
        return {"d": [[_tagged(k), _tagged(v)] for k, v in obj.items()]}
    if isinstance(obj, list):
        return {"l": [_tagged(v) for v in obj]}
    if isinstance(obj, tuple):
        return {"t": [_tagged(v) for v in obj]}
    if isinstance(obj, bytes):
        return {"b": base64.b64encode(obj).decode()}
    raise StateTransferError(
        f"a {type(obj).__module__}.{type(obj).__qualname__} in the state cannot be sent to other ranks: "
        "keep tensors, numbers, strings, bytes, None and lists, tuples and dicts of them"
    )


def _untagged(node: Any) -> Any:
    if node is None or isinstance(node, bool | int | float | str):
        return node
    if not (isinstance(node, dict) and len(node) == 1):
        raise ValueError(f"an untagged {type(node).__name__}")
    ((tag, body),) = node.items()
    if tag == "b":
        return base64.b64decode(_of(body, str), validate=True)
    items = _of(body, list)
    if tag == "l":
        return [_untagged(v) for v in items]
    if tag == "t":
        return tuple(_untagged(v) for v in items)
    if tag == "d":
        return {_untagged(k): _untagged(v) for k, v in (_of(pair, list) for pair in items)}
    if tag == "h":
        index, shape, dtype_name, on_cpu = items
        dims = tuple(_count(n) for n in _of(shape, list))
        return TensorHole(_count(index), dims, _dtype(dtype_name), _of(on_cpu, bool))
    raise ValueError(f"unknown tag {tag!r}")


def _of(value: Any, kind: type) -> Any:
    if not isinstance(value, kind):
        raise ValueError(f"expected a {kind.__name__}, got a {type(value).__name__}")
    return value


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a count, got {value!r}")
    return value


def _dtype(name: Any) -> torch.dtype:
    if not (isinstance(name, str) and _DTYPE_NAME.fullmatch(name)):
        raise ValueError(f"not a dtype name: {name!r}")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype: {name!r}")
    return dtype
