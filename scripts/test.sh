#!/usr/bin/env bash
# Lint and run the test suite (fast tests by default; pass -m slow, or any pytest args).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh dev    # lint, types, tests and the integrations
.venv/bin/ruff check src tests examples benchmarks
.venv/bin/ruff format --check src tests examples benchmarks
.venv/bin/lint-imports
.venv/bin/mypy  # config and files in pyproject.toml [tool.mypy]
exec .venv/bin/python -m pytest "$@"
