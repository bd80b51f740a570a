"""Function entrypoints for tests/test_api.py: module-level, so the workers import them."""

from __future__ import annotations

import os


def square_rank(offset: int) -> dict[str, object]:
    rank = int(os.environ["RANK"])
    return {"value": rank * rank + offset, "world": os.environ["WORLD_SIZE"], "local": os.environ["LOCAL_RANK"]}


def fail_on_rank(bad: int) -> int:
    if int(os.environ["RANK"]) == bad:
        raise ValueError(f"rank {bad} gives up")
    return 0


def fail_first_attempt() -> str:
    """Rank 1 fails in the first attempt only: the result comes from the restart."""
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    if attempt == "0" and os.environ["RANK"] == "1":
        raise SystemExit(3)
    return f"attempt {attempt}"
