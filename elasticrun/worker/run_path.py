"""`--run-path`: the worker runs its script with `runpy.run_path`, as torchrun's does.

torchrun's `--run-path` starts each worker as a fresh interpreter that calls
`runpy.run_path(script, run_name="__main__")` with `sys.argv = [script, *args]`: the
script may be a file, a folder or a zip archive with a `__main__.py`. The agent runs
`python -u -m elasticrun.worker.run_path <script> [args...]` for the same effect.
"""

from __future__ import annotations

import runpy
import sys


def main() -> None:
    sys.argv = sys.argv[1:]
    if not sys.argv:
        sys.exit("usage: python -m elasticrun.worker.run_path <script> [args...]")
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
