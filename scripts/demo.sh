#!/usr/bin/env bash
# Set up (when needed) and run the local elastic training demo (about a minute and a half
# on two cores), in the checkout's own environment: .venv with the package and torch only
# (scripts/setup.sh --demo; the tests' servers and tools are scripts/test.sh's).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --demo
exec .venv/bin/python examples/elastic_demo.py
