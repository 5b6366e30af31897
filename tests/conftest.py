"""Shared fixtures."""

from __future__ import annotations

import subprocess
import uuid

import pytest


@pytest.fixture
def make_tmpfs(tmp_path):
    """Factory for a size-limited tmpfs (needs root); skips cleanly where it cannot mount."""
    mounted = []

    def make(size: str):
        mnt = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
        mnt.mkdir()
        res = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
            capture_output=True,
        )
        if res.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {res.stderr.decode().strip()}")
        mounted.append(mnt)
        return mnt

    yield make
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
