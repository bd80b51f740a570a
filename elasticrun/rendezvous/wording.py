"""How the rendezvous words what it says: node lists, counts, durations.

The leader's reasons, the quarantine's notes and the straggler verdict are read in
logs and by `elasticrun status`; their small phrases are written here once, so that
the same thing is said the same way everywhere.
"""

from __future__ import annotations


def names(nodes: list[str], limit: int = 8) -> str:
    """`a, b, c`, or the first `limit` and how many more."""
    shown = ", ".join(nodes[:limit])
    return shown + (f", ... ({len(nodes) - limit} more)" if len(nodes) > limit else "")


def plural(n: int, word: str) -> str:
    """`1 node`, `2 nodes`."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def duration(seconds: float) -> str:
    """A wait (a quarantine's cooldown) in its largest whole unit: `45s`, `16m`, `2.0h`."""
    if seconds < 120:
        return f"{seconds:.0f}s"
    return f"{seconds / 60:.0f}m" if seconds < 7200 else f"{seconds / 3600:.1f}h"


def step_time(seconds: float) -> str:
    """A step's compute time: `250ms`, `1.25s`."""
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.2f}s"
