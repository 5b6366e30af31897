"""The torchtitan test environment, ``.venv-torchtitan`` in the repository root.

torchtitan cannot share the dev environment (its ``datasets`` needs a huggingface-hub that
breaks transformers), so its tests run in a venv of their own, built once: a stamp keyed on
the pins and the Python version makes later runs reuse it. A file lock makes a second
build (``python tests/torchtitan_env.py`` beside the tests) wait for the first and reuse it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv-torchtitan"
#: What the environment holds; the stamp is keyed on these and on stepvault's core deps.
PINS = ["torch==2.13.0", "torchtitan==0.3.0"]
CORE = ["numpy", "zstandard", "blake3", "typer", "rich", "xxhash"]
#: pip's words when the registry cannot be reached (then the tests skip, saying so).
UNREACHABLE = (
    "Could not find a version that satisfies",
    "No matching distribution found",
    "Failed to establish a new connection",
    "Network is unreachable",
    "Temporary failure in name resolution",
)


class RegistryUnreachable(Exception):
    """pip could not reach the package registry to build the environment."""


def _pip(python: Path, *args: str) -> None:
    out = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "-c", str(REPO / "constraints.txt"), *args],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if out.returncode != 0:
        text = out.stdout + out.stderr
        if any(words in text for words in UNREACHABLE):
            raise RegistryUnreachable(
                f"pip cannot reach the registry to build {VENV.name}: {text[-800:]}"
            )
        raise RuntimeError(f"building {VENV.name} failed:\n{text[-4000:]}")


def _key() -> str:
    return hashlib.sha256(json.dumps([PINS, CORE, sys.version_info[:2]]).encode()).hexdigest()


def ready() -> Path | None:
    """The environment's python when it is built and current, else None (nothing built:
    benchmarks/run_all.py's quick run skips torchtitan rather than spend minutes on pip)."""
    python, stamp = VENV / "bin" / "python", VENV / ".stepvault-stamp"
    if python.exists() and stamp.exists() and stamp.read_text() == _key():
        return python
    return None


def build() -> Path:
    """The environment's python, built first when its stamp is missing or stale."""
    python = VENV / "bin" / "python"
    key = _key()
    stamp = VENV / ".stepvault-stamp"
    with open(REPO / ".venv-torchtitan.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; a waiter then reuses it
        if python.exists() and stamp.exists() and stamp.read_text() == key:
            return python
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
        _pip(python, *PINS, *CORE)
        # stepvault from this checkout (its dependencies are above): the code under test.
        _pip(python, "--no-deps", "-e", str(REPO))
        stamp.write_text(key)
    return python


if __name__ == "__main__":
    try:
        print(build())
    except RegistryUnreachable as exc:  # the tests skip, saying so
        print(exc, file=sys.stderr)
