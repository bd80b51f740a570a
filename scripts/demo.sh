#!/usr/bin/env bash
# Set up (when needed) and run the local elastic training demo (about a minute and a half
# on two cores), in the checkout's own environment (.venv, made by scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/elastic_demo.py
