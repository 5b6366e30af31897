"""CLI commands of the manager layer: gc (dry run, keep rules), pin/unpin, events."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

import stepvault
from stepvault.cli.main import app


def _fill(root, steps=range(1, 7)):
    model = torch.nn.Linear(64, 64)
    with stepvault.CheckpointManager(root, "r") as mgr:
        for step in steps:
            with torch.no_grad():
                model.weight.add_(1)
            mgr.save(step, {"model": model}, metrics={"val_loss": abs(step - 3) + 0.5})


def test_gc_dry_run_then_real(tmp_path):
    _fill(tmp_path)
    runner = CliRunner()
    base = ["--root", str(tmp_path)]
    out = runner.invoke(app, [*base, "gc", "r", "--keep-last", "2", "--dry-run", "--grace", "0"])
    assert out.exit_code == 0, out.output
    assert "delete" in out.output and "newest" in out.output
    assert stepvault.open(tmp_path).steps("r") == [1, 2, 3, 4, 5, 6]  # dry run
    out = runner.invoke(
        app,
        [
            *base,
            "gc",
            "r",
            "--keep-last",
            "2",
            "--keep-best",
            "1",
            "--metric",
            "val_loss",
            "--grace",
            "0",
            "--json",
        ],
    )
    doc = json.loads(out.output)
    assert doc["deleted_checkpoints"] == [1, 2, 4]
    assert doc["deleted_objects"] > 0 and doc["freed_bytes"] > 0
    assert stepvault.open(tmp_path).steps("r") == [3, 5, 6]
    assert stepvault.ops.verify(tmp_path, deep=True).ok
    assert stepvault.ops.usage(tmp_path).unreferenced_objects == 0


def test_gc_respects_grace_and_needs_run_for_rules(tmp_path):
    _fill(tmp_path)
    runner = CliRunner()
    out = runner.invoke(app, ["--root", str(tmp_path), "gc", "--keep-last", "1"])
    assert out.exit_code == 2 and "one run" in out.output
    out = runner.invoke(app, ["--root", str(tmp_path), "gc", "r", "--keep-last", "1", "--json"])
    doc = json.loads(out.output)
    assert doc["deleted_checkpoints"] == [1, 2, 3, 4, 5]
    assert doc["deleted_objects"] == 0 and doc["kept_in_grace"] > 0  # default grace: 15 min


def test_pin_unpin_and_events(tmp_path):
    _fill(tmp_path)
    runner = CliRunner()
    base = ["--root", str(tmp_path)]
    assert runner.invoke(app, [*base, "pin", "r@2", "--note", "paper"]).exit_code == 0
    out = runner.invoke(app, [*base, "gc", "r", "--keep-last", "1", "--json", "--grace", "0"])
    assert json.loads(out.output)["deleted_checkpoints"] == [1, 3, 4, 5]
    assert stepvault.open(tmp_path).steps("r") == [2, 6]
    assert runner.invoke(app, [*base, "unpin", "r@2"]).exit_code == 0
    out = runner.invoke(app, [*base, "pin", "r@99"])
    assert out.exit_code == 2 and "no committed checkpoint" in out.output
    out = runner.invoke(app, [*base, "events", "r", "--json"])
    events = [e["event"] for e in json.loads(out.output)]
    assert events.count("save") == 6 and "pin" in events and "unpin" in events
    assert events.count("delete") == 4
    out = runner.invoke(app, [*base, "events", "r", "--tail", "3"])
    assert out.exit_code == 0 and "unpin" in out.output
