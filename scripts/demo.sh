#!/usr/bin/env bash
# Train a small model, kill it, damage its newest checkpoint, resume, show the store.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh core   # the core only: the demo needs nothing more
exec .venv/bin/python examples/demo.py --store "${1:-demo-store}"
