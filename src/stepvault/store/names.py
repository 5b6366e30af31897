"""Validation of names that become parts of storage keys (run names, steps)."""

from __future__ import annotations

import re

from ..errors import InvalidNameError

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}\Z")  # \Z: "$" allows a final "\n"


def validate_run_name(run: str) -> str:
    """Return ``run`` if it is a safe run name, else raise :class:`InvalidNameError`.

    A run name becomes a directory name, so it may only use letters, digits, ``. _ + -``,
    must start with a letter or digit, must not contain ``..`` and is at most 128 characters.
    """
    if not isinstance(run, str):
        raise InvalidNameError(f"run name must be a str, got {type(run).__name__}")
    if not _RUN_NAME.match(run) or ".." in run:
        raise InvalidNameError(
            f"invalid run name {run!r}: use 1-128 characters from letters, digits and '._+-', "
            "starting with a letter or digit, without '/' or '..' (e.g. 'exp1', 'llama-7b.v2')"
        )
    return run


def validate_step(step: object) -> int:
    """Return ``step`` as int if it is a non-negative integer, else raise InvalidNameError."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise InvalidNameError(f"step must be a non-negative int, got {step!r}")
    if step < 0 or step >= 10**18:
        raise InvalidNameError(f"step must be in [0, 10**18), got {step}")
    return int(step)


def check_key(key: str) -> str:
    """Defence in depth: refuse keys that are absolute or walk out of the store root."""
    parts = key.split("/")
    if not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise InvalidNameError(f"unsafe storage key {key!r}")
    if any(p in ("", ".", "..") for p in parts):
        raise InvalidNameError(f"unsafe storage key {key!r}")
    return key
