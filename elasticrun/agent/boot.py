"""The worker boot: the sitecustomize the agent puts in front of every worker's path.

`elasticrun/worker/boot/sitecustomize.py` runs inside each worker before its script
and installs what the agent asks for through the environment (the stack dump). This
module only names the folder and puts it on the path; the agent never imports the
worker side (it would pull in nothing but this path, and the layers stay apart).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: the folder holding the boot's sitecustomize.py (not a package: nothing imports it)
BOOT_DIR = Path(__file__).resolve().parent.parent / "worker" / "boot"
#: names the boot folder in a worker's environment: the boot acts only when it is set
BOOT_ENV = "ELASTICRUN_BOOT"


def boot_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables that make a worker with environment `env` load the boot first.

    Any PYTHONPATH it had stays behind it; the boot takes itself out again."""
    before = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(BOOT_DIR)]
    return {BOOT_ENV: str(BOOT_DIR), "PYTHONPATH": os.pathsep.join([str(BOOT_DIR), *before])}
