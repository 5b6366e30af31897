"""A store this process may not write: reads work, and a save or a manager says which store
and what to do with a ReadOnlyError (a StepvaultError and a PermissionError), not a bare
``PermissionError: [Errno 13] Permission denied`` that named no file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

import stepvault

SCRIPT = textwrap.dedent(
    """
    import os, sys, tempfile, torch, stepvault
    from stepvault.errors import ReadOnlyError, StepvaultError
    root = sys.argv[1]
    model = torch.nn.Linear(8, 8)
    with tempfile.TemporaryDirectory() as warm:  # every import done while we may read them
        with stepvault.CheckpointManager(warm, "w", async_save=False) as mgr:
            mgr.save(1, {"model": model})
    if os.geteuid() == 0:  # root writes anywhere: be nobody
        os.setgid(65534)
        os.setuid(65534)
    assert stepvault.restore(root, {"model": model}, run="r").step == 1  # reads work
    for attempt in (
        lambda: stepvault.save(root, {"model": model}, run="r", step=2),
        lambda: stepvault.CheckpointManager(root, "r"),
    ):
        try:
            attempt()
        except ReadOnlyError as exc:
            assert isinstance(exc, StepvaultError) and isinstance(exc, PermissionError)
            print("refused:", exc)
        else:
            raise SystemExit("a write to a read-only store went through")
    """
)


def test_a_read_only_store_is_read_and_a_save_says_what_to_do() -> None:
    # Not under pytest's tmp_path: its parent is private to root, and the check runs as
    # nobody when the tests run as root.
    tmp_path = Path(tempfile.mkdtemp(prefix="sv-read-only-"))
    try:
        _check(tmp_path)
    finally:
        for dirpath, _, _ in os.walk(tmp_path):
            os.chmod(dirpath, 0o755)
        shutil.rmtree(tmp_path, ignore_errors=True)


def _check(tmp_path: Path) -> None:
    root = tmp_path / "store"
    stepvault.save(root, {"model": torch.nn.Linear(8, 8)}, run="r", step=1)
    os.chmod(tmp_path, 0o755)
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o444)
        os.chmod(dirpath, 0o555)
    script = tmp_path / "try.py"
    script.write_text(SCRIPT)
    os.chmod(script, 0o644)
    try:
        proc = subprocess.run(
            [sys.executable, str(script), str(root)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
    finally:
        for dirpath, _, _ in os.walk(root):
            os.chmod(dirpath, 0o755)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("refused:")]
    assert len(lines) == 2
    for line in lines:
        assert f"the store {root} is not writable" in line and "save to another store" in line
    assert stepvault.open(root).steps("r") == [1]
