"""Write what this worker was started as to <out_dir>/rank<RANK>.json: its argv, __name__,
interpreter and LOCAL_RANK/CUDA_VISIBLE_DEVICES (plain python; also run as a folder's
__main__.py under --run-path)."""

import json
import os
import sys
from pathlib import Path

out = Path(sys.argv[1])
path = out / f"rank{os.environ['RANK']}.json"
tmp = path.with_suffix(".tmp")
tmp.write_text(json.dumps({
    "argv": sys.argv,
    "name": __name__,
    "path0": sys.path[0],
    "wrapped": os.environ.get("WRAPPED_BY", ""),
    "local_rank": os.environ["LOCAL_RANK"],
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
}))
tmp.rename(path)
