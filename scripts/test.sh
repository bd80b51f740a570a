#!/usr/bin/env bash
# Set up (when needed), lint everything and type-check the package, then run the whole test suite,
# all in the checkout's own environment (.venv, made by scripts/setup.sh --test, which also
# installs the etcd and Slurm the tests start).
# Extra arguments go to pytest. (The import contracts run inside it: tests/test_layers.py.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/python -m ruff check elasticrun tests bench scripts examples
.venv/bin/python -m mypy  # its files and settings: [tool.mypy] in pyproject.toml
# two processes, each taking whole files (module fixtures such as the Slurm cluster run
# once): the tests wait on leases and rounds as much as they compute
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
