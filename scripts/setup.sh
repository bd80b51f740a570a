#!/usr/bin/env bash
# Set up a fresh machine for elasticrun: etcd (for the etcd backend and its tests), Slurm
# with munge and MariaDB (for tests/test_slurm.py, which is skipped where they cannot be
# installed), then a virtual environment in this checkout, .venv, holding the package
# (editable) with its test extras (torch pinned to 2.13.0; pip takes the wheel from
# wherever pip's own configuration points, the CPU build on these machines). Nothing is installed into the
# Python that creates it, so this works where that Python refuses installs (PEP 668,
# "externally managed") and never mixes the pinned test tools into it.
# Idempotent: a second run changes nothing. PYTHON=... picks the interpreter (3.11+).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_etcd.sh
bash scripts/install_slurm.sh || echo "setup.sh: Slurm is not installed; tests/test_slurm.py will be skipped" >&2
if [ ! -x .venv/bin/python ]; then
    if ! "${PYTHON:-python3}" -m venv .venv; then
        rm -rf .venv
        echo "setup.sh: cannot create .venv with ${PYTHON:-python3}; on Debian or Ubuntu install" \
             "python3-venv (apt-get install python3-venv), or name another Python: PYTHON=python3.12" >&2
        exit 1
    fi
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
