"""A flag's value checked: seconds, whole numbers, ratios, sizes, each refused in one line naming the flag."""

from __future__ import annotations

import math
import re

from elasticrun.errors import UsageError
from elasticrun.store.interface import MAX_LEASE_TTL

#: The longest a timing may be, in seconds: etcd's longest lease (`MaxLeaseTTL`, about
#: 285 years), for every timing alike. Two of them become leases (heartbeat_timeout,
#: closed_ttl), where no store takes longer; the others become deadlines, which a
#: number past this no longer is (1e300 s from now is no time at all in floating point).
MAX_SECONDS = MAX_LEASE_TTL


def positive_seconds(value: str | None, flag: str, default: float) -> float:
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not (number > 0 and math.isfinite(number)):
        raise UsageError(f"{flag} must be a positive number of seconds, got {value!r}")
    return within_max_seconds(number, flag, repr(value))


def within_max_seconds(seconds: float, flag: str, shown: str) -> float:
    """A timing already known to be a finite number, refused past MAX_SECONDS."""
    if seconds > MAX_SECONDS:
        raise UsageError(
            f"{flag} must be at most {MAX_SECONDS:.0f} seconds (etcd's longest lease, about 285 years), got {shown}"
        )
    return seconds


def digits_only(text: str) -> bool:
    """Whether int() reads `text` as a plain decimal.

    ASCII digits only (str.isdigit() also takes '²', which int() refuses)."""
    return text.isascii() and text.isdigit()


def ratio_above_one(value: str | None, flag: str, default: float) -> float:
    """A factor above 1 (how many times slower)."""
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not (number > 1 and math.isfinite(number)):
        raise UsageError(f"{flag} must be a number above 1 (how many times slower), got {value!r}")
    return number


def count_from_one(value: str | None, flag: str, default: int) -> int:
    """A whole number >= 1."""
    if value is None:
        return default
    if not (value.strip().isascii() and value.strip().isdigit() and int(value) >= 1):
        raise UsageError(f"{flag} must be a whole number >= 1, got {value!r}")
    return int(value)


def whole_number(value: str | None, flag: str, default: int) -> int:
    if value is None:
        return default
    if not (value.strip().isascii() and value.strip().isdigit()):
        raise UsageError(f"{flag} must be a whole number >= 0 (0 turns it off), got {value!r}")
    return int(value)


_SIZE = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]+)?)(?P<unit>[KMGT]?)", re.IGNORECASE)


def byte_size(value: str, flag: str) -> int:
    """A size in bytes: a whole number, or a number with K, M, G or T (powers of 1024)."""
    match = _SIZE.fullmatch(value.strip())
    if match is None:
        raise UsageError(f"{flag} must be a size such as 512M, 8G or 0 (bytes; K, M, G, T are powers of 1024), "
                         f"got {value!r}")
    return int(float(match["number"]) * 1024 ** " KMGT".index(match["unit"].upper() or " "))
