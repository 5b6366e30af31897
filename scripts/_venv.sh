# Sourced by demo.sh and test.sh: create .venv once and install stepvault into it.
#   source scripts/_venv.sh core     # the core (what the demo needs): torch, numpy, zstd, ...
#   source scripts/_venv.sh dev      # the core and the dev extras (lint, types, tests, integrations)
# torch is pinned by constraints.txt (the CPU build; an unpinned torch pulls a CUDA build).
# The install is skipped when nothing it depends on changed: .venv/.stepvault-installed
# holds one line "<hash> <extras>" per install, the hash of pyproject.toml and
# constraints.txt (STEPVAULT_REINSTALL=1 forces the install). The dev set includes the
# core, so either order works and neither script reinstalls what the other installed.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
STEPVAULT_EXTRAS="${1:?usage: source scripts/_venv.sh core|dev}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
_stamp=.venv/.stepvault-installed
_hash="$(cat pyproject.toml constraints.txt | .venv/bin/python -c \
    'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
if [ -n "${STEPVAULT_REINSTALL:-}" ] || ! grep -qx -e "$_hash $STEPVAULT_EXTRAS" -e "$_hash dev" "$_stamp" 2>/dev/null; then
    if [ "$STEPVAULT_EXTRAS" = core ]; then _target="."; else _target=".[$STEPVAULT_EXTRAS]"; fi
    echo "Installing stepvault ($STEPVAULT_EXTRAS) into .venv ..." >&2
    if [ "$STEPVAULT_EXTRAS" != core ]; then
        # DeepSpeed (extras deepspeed and dev) is an sdist whose build imports torch: build
        # it against the pinned torch already in .venv (no isolation, which would fetch
        # another torch) and compile no op (DS_BUILD_OPS=0; ops are built on first use).
        .venv/bin/python -m pip install --quiet --disable-pip-version-check \
            -c constraints.txt torch setuptools wheel
        DS_BUILD_OPS=0 .venv/bin/python -m pip install --quiet --disable-pip-version-check \
            --no-build-isolation -c constraints.txt deepspeed
    fi
    .venv/bin/python -m pip install --quiet --disable-pip-version-check \
        -c constraints.txt -e "$_target" 2> >(grep -v "^WARNING: Location" >&2)
    # keep the lines of this hash (another extras set), drop stale ones
    { grep -e "^$_hash " "$_stamp" 2>/dev/null || true; echo "$_hash $STEPVAULT_EXTRAS"; } \
        > "$_stamp.new"
    mv "$_stamp.new" "$_stamp"
fi
unset _stamp _hash _target
