"""One-line adapters for training frameworks: a callback that calls `heartbeat()` per step.

    trainer = pl.Trainer(..., callbacks=[elasticrun.worker.callbacks.lightning()])
    trainer = transformers.Trainer(..., callbacks=[elasticrun.worker.callbacks.huggingface()])

Each step then counts as progress for the hang watchdog (`--progress-timeout`) and ends a
step for the step timing (`elasticrun.worker.steptime`), whatever optimizer the framework
drives (the automatic optimizer hook sees only `torch.optim` optimizers). The framework
is imported only when its adapter is asked for; Lightning's callback is made for the
package the script imported (`lightning.pytorch` or `pytorch_lightning`), since
Lightning accepts only callbacks of its own class.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

from elasticrun.worker.progress import heartbeat


def lightning() -> Any:
    """A Lightning `Callback` that calls `heartbeat()` after every training batch."""
    return _lightning_class(_lightning_package())()


def huggingface() -> Any:
    """A Hugging Face `transformers.TrainerCallback` that calls `heartbeat()` after every optimizer step."""
    return _huggingface_class()()


def _lightning_package() -> str:
    """The Lightning the script uses: the one it imported, else whichever is installed."""
    for name in ("lightning.pytorch", "pytorch_lightning"):
        if name in sys.modules:
            return name
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        return name
    raise ImportError("elasticrun.worker.callbacks.lightning() needs lightning or pytorch_lightning")


@functools.cache
def _lightning_class(package: str) -> type:
    base = importlib.import_module(package).Callback

    class ElasticrunHeartbeat(base):  # type: ignore[misc, valid-type] # the framework's own class
        """Calls `elasticrun.worker.heartbeat()` after every training batch."""

        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            heartbeat()

    return ElasticrunHeartbeat


@functools.cache
def _huggingface_class() -> type:
    base = importlib.import_module("transformers").TrainerCallback

    class ElasticrunHeartbeat(base):  # type: ignore[misc, valid-type] # the framework's own class
        """Calls `elasticrun.worker.heartbeat()` after every optimizer step."""

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            heartbeat()

    return ElasticrunHeartbeat
