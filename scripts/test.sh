#!/usr/bin/env bash
# Set up (when needed), lint everything and type-check the package, then run the whole test suite,
# all in the checkout's own environment (.venv, made by scripts/setup.sh --test, which also
# installs the etcd and Slurm the tests start).
# Extra arguments go to pytest. (The import contracts run inside it: tests/test_layers.py.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/python -m ruff check elasticrun tests bench scripts examples
# mypy (its files and settings: [tool.mypy] in pyproject.toml) runs beside the suite, in
# the CPU the suite leaves idle while its tests wait (about 20 s on a fresh clone); its
# report comes after the suite's, and either failing fails the run
mypy_report=$(mktemp)
trap 'rm -f "$mypy_report"' EXIT
.venv/bin/python -m mypy >"$mypy_report" 2>&1 &
mypy=$!
# two processes, each taking whole files (module fixtures such as the Slurm cluster run
# once): the tests wait on leases and rounds as much as they compute. Files are handed
# out in collection order, the longest first (tests/conftest.py), not xdist's default
# of the most tests first, which left files of few long tests to run last, alone
status=0
# Tests marked `slow` (pyproject.toml) are left out, to keep this under 15 minutes on 2
# cores; `-m slow` runs only them (a later -m wins), and CI runs both (.ci/run)
.venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow" "$@" || status=$?
wait "$mypy" || status=1
cat "$mypy_report"
exit "$status"
