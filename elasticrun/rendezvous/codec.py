"""The one JSON codec of the rendezvous's records: `encode` and `decode`.

Everything stored is versioned JSON (never pickle), so any tool (`elasticrun status`,
`etcdctl get`) can read it, and a newer agent can refuse a record it does not understand.

`encode` and `decode` are the only JSON codec, and `JobRecords.apply`
(`rendezvous/job_records.py`) the only place a key becomes its record.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeVar

from elasticrun.errors import RendezvousError, SpecMismatchError
from elasticrun.rendezvous.records import JOB_SPEC_VERSION, JobSpec, Record

FORMAT_VERSION = 1

R = TypeVar("R", bound=Record)


def encode(record: Record) -> bytes:
    """A record as versioned JSON bytes."""
    body = asdict(record)
    body["v"] = FORMAT_VERSION
    return json.dumps(body, separators=(",", ":")).encode()


def decode(kind: type[R], raw: bytes) -> R:
    """A record of type `kind` from what `encode` wrote, its nested records included."""
    what = kind.__name__
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise RendezvousError(f"unreadable {what} record in the store: {e}") from None
    if not isinstance(body, dict) or body.pop("v", None) != FORMAT_VERSION:
        raise RendezvousError(
            f"the {what} record in the store has another format version; "
            "is another elasticrun version using the same --rdzv-id?"
        )
    # The spec's own version comes first: another version's fields may mean other things.
    if kind is JobSpec and body.get("version") != JOB_SPEC_VERSION:
        raise SpecMismatchError(
            f"the running job's spec has version {body.get('version')!r}, this node's {JOB_SPEC_VERSION} "
            "(its nodes run another elasticrun version); start this node with that version, or use another --rdzv-id"
        )
    try:
        record: R = _build(kind, body)
    except (KeyError, TypeError) as e:  # a field missing, unknown, or of another shape
        raise RendezvousError(f"unreadable {what} record in the store: {e}") from None
    return record


def _build(kind: type, body: dict[str, Any]) -> Any:
    """`kind(**body)`, each value first made what its field's type says."""
    made = _converters(kind)
    return kind(**{name: made[name](value) if name in made else value for name, value in body.items()})


@functools.cache
def _converters(kind: type) -> dict[str, Callable[[Any], Any]]:
    """How each field of a record type that is not plain JSON is made from its JSON value.

    A tuple or a record is not. Worked out once per type from its annotations (strings):
    decoding is most of what a large job's nodes and leader spend their CPU on (a
    round's shard holds 64 records), and resolving type hints per value tripled it."""
    hints = typing.get_type_hints(kind)
    return {name: made for name, hint in hints.items() if (made := _converter(hint)) is not None}


def _converter(hint: Any) -> Callable[[Any], Any] | None:
    """A list as a tuple (of what its items' type says), an object as a record.

    None for a value that JSON gives as the field holds it."""
    if typing.get_origin(hint) is tuple:
        item = _converter(typing.get_args(hint)[0])
        if item is None:
            return lambda value: tuple(value) if isinstance(value, list) else value
        return lambda value: tuple(item(v) for v in value) if isinstance(value, list) else value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return lambda value: _build(hint, value) if isinstance(value, dict) else value
    return None
