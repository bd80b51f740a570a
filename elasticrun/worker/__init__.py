"""What training scripts import; the only subpackage that may import torch.

Importing `elasticrun.worker` itself imports no torch: `heartbeat()` (the hang
watchdog's progress call) is plain Python, and the torch-backed helpers live in their
own modules (`elasticrun.worker.c10d_store`), imported only when used.
"""

from elasticrun.worker.progress import heartbeat

__all__ = ["heartbeat"]
