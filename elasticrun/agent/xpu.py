"""Intel GPUs (torch's XPUs), counted for `--nproc-per-node=xpu` as torchrun counts them.

torchrun asks `torch.xpu.device_count()`; the launcher must not import torch, so the
count comes from what the kernel shows instead: the cards under /sys/class/drm whose
PCI vendor is Intel, or, when ZE_AFFINITY_MASK narrows what Level Zero exposes, its
entries. Only the count is needed: workers pick their device by LOCAL_RANK, as under
torchrun.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

DRM_ROOT = Path("/sys/class/drm")
INTEL_VENDOR = "0x8086"
AFFINITY_ENV = "ZE_AFFINITY_MASK"


def intel_xpus(environ: Mapping[str, str], root: Path = DRM_ROOT) -> int:
    """How many XPUs this node's workers would see (0 without any)."""
    mask = environ.get(AFFINITY_ENV)
    if mask is not None:
        return len([entry for entry in mask.split(",") if entry.strip()])
    count = 0
    for card in root.glob("card[0-9]*"):
        if "-" in card.name:  # card0-DP-1: a connector of card0, not a device
            continue
        try:
            vendor = (card / "device" / "vendor").read_text().strip()
        except OSError:
            continue
        count += vendor == INTEL_VENDOR
    return count
