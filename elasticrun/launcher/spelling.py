"""Misspellings: which known name a user most likely meant."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(given: str, known: Iterable[str]) -> str | None:
    """The one of `known` that `given` is most likely a misspelling of, if any."""
    close = difflib.get_close_matches(given, list(known), n=1, cutoff=0.75)
    return close[0] if close else None


def did_you_mean(given: str, known: Iterable[str]) -> str:
    """'; did you mean X?' for the one of `known` closest to `given`, or ''."""
    match = closest(given, known)
    return f"; did you mean {match}?" if match else ""
