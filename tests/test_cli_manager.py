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


def test_a_misspelt_best_metric_is_refused_and_deletes_nothing(tmp_path):
    """A best-by rule on a metric no checkpoint records keeps nothing: with --keep-best 2
    --metric val_los, gc used to delete every checkpoint but the newest, exit code 0."""
    import warnings

    import pytest

    from stepvault.errors import InvalidNameError
    from stepvault.policy import KeepBest, KeepLast

    _fill(tmp_path)
    runner = CliRunner()
    base = ["--root", str(tmp_path), "gc", "r", "--keep-best", "2", "--metric", "val_los"]
    for extra in ([], ["--dry-run"]):
        out = runner.invoke(app, [*base, *extra, "--grace", "0"])
        assert out.exit_code == 2, out.output
        assert "unknown metric 'val_los'" in out.output and "'val_loss'" in out.output
    assert stepvault.open(tmp_path).steps("r") == [1, 2, 3, 4, 5, 6]
    with pytest.raises(InvalidNameError, match=r"unknown metric 'vl'.*recorded: val_loss"):
        stepvault.ops.collect_garbage(
            stepvault.store.Store.open(tmp_path), run="r", keep=KeepLast(1) | KeepBest(1, "vl")
        )
    assert stepvault.open(tmp_path).steps("r") == [1, 2, 3, 4, 5, 6]
    # The manager cannot refuse (a run may record the metric later), so it warns once.
    model = torch.nn.Linear(4, 4)
    keep = KeepLast(2) | KeepBest(1, "val_los")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with stepvault.CheckpointManager(tmp_path / "m", "m", keep=keep, async_save=False) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, {"model": model}, metrics={"val_loss": 1.0 / step})
    typo = [w for w in seen if "'val_los'" in str(w.message)]
    assert len(typo) == 1 and "'val_loss'" in str(typo[0].message), [str(w.message) for w in seen]


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


def test_damaged_data_exits_1_with_the_way_out_a_typo_exits_2(tmp_path):
    """``diff`` and ``export`` of a damaged checkpoint exited 2 (documented for usage
    errors) and named no next step; damage now exits 1, as ``verify`` does, and says how to
    find and take out every damaged checkpoint."""
    _fill(tmp_path, steps=(1, 2))
    manifest = stepvault.open(tmp_path).manifest("r", 2)
    digest = next(iter(manifest.objects))
    path = tmp_path / "objects" / digest[:2] / digest
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    runner = CliRunner()
    base = ["--root", str(tmp_path)]
    out_dir = tmp_path / "out.safetensors"
    for args in (["diff", "r@1", "r@2"], ["export", "r@2", "-o", str(out_dir)]):
        res = runner.invoke(app, [*base, *args])
        assert res.exit_code == 1, (args, res.output)
        assert "does not match its hash" in res.output and "stepvault repair" in res.output
    res = runner.invoke(app, [*base, "export", "r@7", "-o", str(out_dir)])
    assert res.exit_code == 2 and "no committed checkpoint" in res.output


def test_show_says_what_protects_a_checkpoint_and_its_annotated_metrics(tmp_path):
    """``show`` printed the metrics saved with the manifest only and nothing of pins or
    holds, while ``ls`` and KeepBest used the annotated values."""
    _fill(tmp_path, steps=(1, 2))
    runner = CliRunner()
    base = ["--root", str(tmp_path)]
    assert runner.invoke(app, [*base, "pin", "r@1"]).exit_code == 0
    assert runner.invoke(app, [*base, "hold", "r@1", "--owner", "evaljob"]).exit_code == 0
    assert runner.invoke(app, [*base, "annotate", "r@1", "val_loss=0.125"]).exit_code == 0
    res = runner.invoke(app, [*base, "show", "r@1"])
    assert res.exit_code == 0, res.output
    assert "val_loss=0.125 (annotated later: val_loss)" in res.output
    assert "protected: pinned; reader hold of evaljob" in res.output
    doc = json.loads(runner.invoke(app, [*base, "show", "r@1", "--json"]).output)
    assert doc["metrics"]["val_loss"] == 0.125 and doc["saved_metrics"]["val_loss"] == 2.5
    assert doc["protected"][0] == "pinned"
    res = runner.invoke(app, [*base, "show", "r@2"])
    assert "protected:" not in res.output and "annotated later" not in res.output


def test_show_takes_a_registry_reference(tmp_path):
    """``show m@stable`` said "bad checkpoint reference" while lineage, promote and the
    dashboard take registry references."""
    from stepvault.registry import Registry

    _fill(tmp_path, steps=(1, 2))
    Registry(tmp_path).promote("m", "r@1", "stable")
    res = CliRunner().invoke(app, ["--root", str(tmp_path), "show", "m@stable"])
    assert res.exit_code == 0 and res.output.startswith("r@1"), res.output
    res = CliRunner().invoke(app, ["--root", str(tmp_path), "show", "nomodel@stable"])
    assert res.exit_code == 2 and "bad checkpoint reference" in res.output
