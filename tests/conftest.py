"""Shared fixtures: a real S3 server, one intra-op thread, a size-limited tmpfs.

Plain helper functions (tiny states, running the training script) live in
``tests/helpers.py``; fixtures live here so every module gets the same ones.
"""

from __future__ import annotations

import subprocess
import uuid

import pytest


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on 127.0.0.1, one per module (``s3_server.MotoS3``).

    Skips the test, not the module, where moto or s3fs is not installed: the other tests of
    a module that also talks to S3 still run.
    """
    pytest.importorskip("s3fs", reason="S3 tests need s3fs: pip install 'stepvault[s3]'")
    pytest.importorskip("moto.server", reason="S3 tests need moto: pip install 'moto[server]'")
    from s3_server import MotoS3

    server = MotoS3().start()
    yield server
    server.stop()


@pytest.fixture
def bucket(s3) -> str:
    """A new, empty bucket on the ``s3`` server."""
    return s3.new_bucket()


@pytest.fixture
def s3_env(monkeypatch):
    """The fake AWS credentials and region of ``s3_server.ENV`` in the environment, for a
    test that opens an ``s3://`` URL without a server (skips where s3fs is missing)."""
    pytest.importorskip("s3fs", reason="S3 tests need s3fs: pip install 'stepvault[s3]'")
    from s3_server import ENV

    for k, v in ENV.items():
        monkeypatch.setenv(k, v)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module's tests: the trainer integrations run tiny models
    that are faster, and far steadier on a shared machine, without thread fan-out."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
