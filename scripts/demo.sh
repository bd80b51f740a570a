#!/usr/bin/env bash
# Set up (when needed) and run the local elastic training demo (about two minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 examples/elastic_demo.py
