"""elasticrun: an elastic launcher for distributed PyTorch training, used like torchrun."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """`elasticrun.launch` and its errors (elasticrun.api), imported on first use only.

    Every module of the package imports this one first, and neither they nor a training
    script that imports `elasticrun.worker` may load the API and the launcher under it
    (the api-on-top contract; hence import_module, which import-linter does not follow)."""
    if name in ("launch", "LaunchFailed", "WorkersFailed"):
        return getattr(importlib.import_module("elasticrun.api"), name)
    raise AttributeError(f"module 'elasticrun' has no attribute {name!r}")
