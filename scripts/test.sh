#!/usr/bin/env bash
# Set up (when needed), lint and type-check the package, then run the whole test suite.
# Extra arguments go to pytest. (The import contracts run inside it: tests/test_layers.py.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m ruff check elasticrun
python3 -m mypy  # its files and settings: [tool.mypy] in pyproject.toml
exec python3 -m pytest -q "$@"
