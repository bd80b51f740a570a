#!/usr/bin/env bash
# Set up (when needed) and run the local elastic training demo (about a minute and a half on two cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 examples/elastic_demo.py
