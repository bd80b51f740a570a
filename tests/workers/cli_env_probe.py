"""Write this worker's environment as JSON to <out_dir>/rank<RANK>.json (plain python)."""

import json
import os
import sys
from pathlib import Path

out = Path(sys.argv[1])
path = out / f"rank{os.environ['RANK']}.json"
tmp = path.with_suffix(".tmp")
tmp.write_text(json.dumps(dict(os.environ)))
tmp.rename(path)
