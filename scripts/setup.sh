#!/usr/bin/env bash
# Set up a fresh machine for elasticrun: etcd (for the etcd backend and its tests), then
# the package with its test extras (torch pinned to 2.13.0, the CPU build on these
# machines). Idempotent: a second run changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_etcd.sh
python3 -m pip install --quiet --disable-pip-version-check -e '.[test]'
