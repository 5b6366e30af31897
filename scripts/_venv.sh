# Sourced by demo.sh and test.sh: create .venv once and install stepvault with its dev extras.
# torch is pinned by constraints.txt (the CPU build; an unpinned torch pulls a CUDA build).
set -euo pipefail
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check \
    -c constraints.txt -e ".[dev]" 2> >(grep -v "^WARNING: Location" >&2)
