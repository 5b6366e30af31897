"""Integrity: damage is detected by verify and never restored; restore falls back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import flip_byte, object_path
from typer.testing import CliRunner

import stepvault
from stepvault.cli.main import app


def _objects(root, run, step):
    return set(stepvault.open(root).manifest(run, step).objects)


@pytest.fixture
def two_checkpoints(tmp_path):
    """Steps 1 and 2 of run r; returns (root, objects only step 2 has, tensors of step 1)."""
    torch.manual_seed(0)
    state = {"w": torch.randn(400_000), "b": torch.randn(10), "step": 1}
    stepvault.save(tmp_path, state, run="r", step=1)
    first = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    state["w"] += 1
    state["step"] = 2
    stepvault.save(tmp_path, state, run="r", step=2)
    only2 = _objects(tmp_path, "r", 2) - _objects(tmp_path, "r", 1)
    assert only2
    return tmp_path, only2, first


def _live():
    return {"w": torch.zeros(400_000), "b": torch.zeros(10), "step": 0}


def test_flipped_byte_found_by_deep_verify_and_skipped_by_restore(two_checkpoints):
    root, only2, first = two_checkpoints
    flip_byte(object_path(root, next(iter(only2))))
    assert stepvault.ops.verify(root).ok  # sizes unchanged: quick verify cannot see a flip
    report = stepvault.ops.verify(root, deep=True)
    assert not report.ok
    assert [(c.step, c.ok) for c in report.checkpoints] == [(1, True), (2, False)]
    assert "does not match its hash" in report.damaged[0].problems[0]

    live = _live()
    info = stepvault.restore(root, live, run="r")
    assert info.step == 1
    assert [s.step for s in info.skipped] == [2]
    assert "hash" in info.skipped[0].reason
    assert torch.equal(live["w"], first["w"]) and live["step"] == 1

    with pytest.raises(stepvault.errors.IntegrityError):  # (the bad object is now quarantined)
        stepvault.restore(root, _live(), run="r", step=2)  # an explicit step never falls back


def test_truncated_and_missing_objects(two_checkpoints):
    root, only2, _ = two_checkpoints
    path = object_path(root, next(iter(only2)))
    with open(path, "r+b") as f:
        f.truncate(100)
    report = stepvault.ops.verify(root)
    assert "truncated" in report.damaged[0].problems[0]
    os.unlink(path)
    report = stepvault.ops.verify(root)
    assert report.damaged[0].step == 2 and "missing" in report.damaged[0].problems[0]
    assert stepvault.restore(root, _live(), run="r").step == 1


def test_damaged_manifest_is_skipped(two_checkpoints):
    root, _, _ = two_checkpoints
    path = os.path.join(root, "runs", "r", "checkpoints", "2.json")
    data = bytearray(Path(path).read_bytes())
    data[-10] ^= 0x20
    Path(path).write_bytes(bytes(data))
    report = stepvault.ops.verify(root)
    assert "checksum" in report.damaged[0].problems[0]
    info = stepvault.restore(root, _live(), run="r")
    assert info.step == 1 and "checksum" in info.skipped[0].reason


def test_unknown_codec_is_an_error_not_garbage(two_checkpoints):
    root, only2, _ = two_checkpoints
    path = object_path(root, next(iter(only2)))
    data = Path(path).read_bytes()
    assert b'"codec":"raw"' in data
    Path(path).write_bytes(data.replace(b'"codec":"raw"', b'"codec":"lz9"', 1))
    report = stepvault.ops.verify(root, deep=True)
    assert "unknown codec 'lz9'" in report.damaged[0].problems[0]
    assert stepvault.restore(root, _live(), run="r").step == 1


def test_newer_manifest_version_is_refused(two_checkpoints):
    root, _, _ = two_checkpoints
    path = os.path.join(root, "runs", "r", "checkpoints", "2.json")
    head, body = Path(path).read_bytes().split(b"\n", 1)
    env = json.loads(head)
    env["version"] = 99
    Path(path).write_bytes(json.dumps(env).encode() + b"\n" + body)
    with pytest.raises(stepvault.errors.StoreVersionError, match="upgrade"):
        stepvault.restore(root, _live(), run="r", step=2)
    info = stepvault.restore(root, _live(), run="r")
    assert info.step == 1 and "newer" in info.skipped[0].reason


def test_every_checkpoint_damaged(two_checkpoints):
    root, _, _ = two_checkpoints
    for digest in _objects(root, "r", 1) | _objects(root, "r", 2):
        os.unlink(object_path(root, digest))
    live = _live()
    with pytest.raises(stepvault.errors.NoValidCheckpointError) as exc:
        stepvault.restore(root, live, run="r")
    assert [s.step for s in exc.value.skipped] == [2, 1]
    assert live["step"] == 0 and float(live["w"].abs().sum()) == 0.0


def test_cli_verify_exit_codes_and_json(two_checkpoints):
    root, only2, _ = two_checkpoints
    runner = CliRunner()
    ok = runner.invoke(app, ["--root", str(root), "verify", "--deep"])
    assert ok.exit_code == 0, ok.output
    assert "0 damaged" in ok.output
    flip_byte(object_path(root, next(iter(only2))))
    bad = runner.invoke(app, ["--root", str(root), "verify", "--deep", "--json"])
    assert bad.exit_code == 1
    doc = json.loads(bad.output)
    assert doc["ok"] is False
    assert [c["step"] for c in doc["checkpoints"] if not c["ok"]] == [2]
    one = runner.invoke(app, ["verify", "r@1", "--deep", "--root", str(root)])
    assert one.exit_code == 0, one.output


def test_damaged_object_is_quarantined_and_rewritten_by_the_next_save(two_checkpoints):
    root, only2, _ = two_checkpoints
    victim = next(iter(only2))
    flip_byte(object_path(root, victim))
    info = stepvault.restore(root, _live(), run="r")
    assert info.step == 1 and "quarantine" in info.skipped[0].reason
    assert not os.path.exists(object_path(root, victim))
    assert os.path.exists(os.path.join(root, "quarantine", victim))
    # Re-saving the same content (deterministic training after a resume) writes a good copy
    # instead of deduplicating against the damaged one.
    torch.manual_seed(0)
    state = {"w": torch.randn(400_000) + 1, "b": torch.randn(10), "step": 2}
    saved = stepvault.save(root, state, run="r", step=2, overwrite=True)
    assert saved.new_bytes > 0
    assert stepvault.ops.verify(root, deep=True).ok
