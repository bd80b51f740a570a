#!/usr/bin/env bash
# Set up this checkout's own virtual environment, .venv, for the demo or for the tests:
#
#   bash scripts/setup.sh --demo   the package (editable) and torch: what the demo runs
#                                  (scripts/demo.sh)
#   bash scripts/setup.sh --test   the package with its test extras (torch, the test tools,
#                                  the training frameworks of two examples), and the servers
#                                  the tests start: etcd, and Slurm with munge and MariaDB
#                                  for tests/test_slurm.py, which is skipped where they
#                                  cannot be installed (scripts/test.sh)
#
# torch is pinned to 2.13.0 (pyproject.toml's `demo` extra); pip takes the wheel from
# wherever pip's own configuration points, the CPU build on these machines. Nothing is
# installed into the Python that creates .venv, so this works where that Python refuses
# installs (PEP 668, "externally managed") and never mixes the pinned test tools into it.
# Idempotent: a second run changes nothing. PYTHON=... picks the interpreter (3.11+).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    --demo) extra=demo ;;
    --test) extra=test ;;
    *)
        echo "usage: bash scripts/setup.sh --demo | --test" >&2
        exit 2
        ;;
esac
if [ "$extra" = test ]; then
    # The system packages (apt: downloads and dpkg) install while pip installs the Python
    # ones (one core's CPU, mostly): on a fresh machine the two overlap instead of adding
    # up. Either failing fails the set-up, and neither is left cut off halfway (the EXIT
    # trap waits).
    (
        bash scripts/install_etcd.sh
        bash scripts/install_slurm.sh || echo "setup.sh: Slurm is not installed; tests/test_slurm.py will be skipped" >&2
    ) &
    system=$!
    trap wait EXIT
fi
if [ ! -x .venv/bin/python ]; then
    if ! "${PYTHON:-python3}" -m venv .venv; then
        rm -rf .venv
        echo "setup.sh: cannot create .venv with ${PYTHON:-python3}; on Debian or Ubuntu install" \
             "python3-venv (apt-get install python3-venv), or name another Python: PYTHON=python3.12" >&2
        exit 1
    fi
fi
# The pip that venv bundles with Python 3.11 (23.2) spends ~55 s choosing among the package
# index's pages; 26.2 takes ~20 s (pinned, so the installer changes only with this line).
.venv/bin/python -m pip install --quiet --disable-pip-version-check 'pip==26.2.1'
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$extra]"
# Byte-compile the checkout's own code, which pip (editable) leaves as source: where
# PYTHONDONTWRITEBYTECODE is set (as on these machines) every agent, CLI and test worker
# would otherwise compile it again at each start (a quarter of tests/test_cli.py's CPU).
# Python ignores a .pyc older than its source, so an edit never runs stale code.
.venv/bin/python -m compileall -q elasticrun tests examples bench scripts
if [ "$extra" = test ]; then
    wait "$system"
fi
