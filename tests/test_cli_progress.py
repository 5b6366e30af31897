"""Progress of long commands: the operations report (done, total) through their
``progress`` callback, and the CLI draws rich bars from it on a terminal only (never with
--json, never into a pipe)."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

import stepvault
from stepvault.cli import progress as progress_mod
from stepvault.cli.main import app
from stepvault.engine.gc import sweep
from stepvault.ops import collect_garbage, export_weights, verify_store
from stepvault.ops.migrate import import_checkpoints
from stepvault.store import Store
from stepvault.tiers.copy import copy_checkpoint


@pytest.fixture
def store(tmp_path):
    root = tmp_path / "s"
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    for step in (1, 2, 3):
        with torch.no_grad():
            model[0].weight.add_(1)
        stepvault.save(root, {"model": model}, run="r", step=step)
    return root


class Calls(list):
    def __call__(self, done, total):
        self.append((done, total))


def _monotonic_to_the_end(calls: Calls) -> None:
    assert calls, "progress was never reported"
    dones = [d for d, _ in calls]
    assert dones == sorted(dones)
    last_done, last_total = calls[-1]
    if last_total is not None:
        assert last_done == last_total > 0


def test_operations_report_progress(store, tmp_path):
    s = Store.open(store)
    calls = Calls()
    report = verify_store(s, deep=True, progress=calls)
    _monotonic_to_the_end(calls)
    assert calls[-1][0] == report.bytes_checked and len(calls) == report.objects_checked
    calls = Calls()
    stats = copy_checkpoint(s, Store.open(tmp_path / "cold", create=True), "r", 3, progress=calls)
    _monotonic_to_the_end(calls)
    assert stats.copied_objects == len(calls)
    calls = Calls()
    sweep(s, grace_seconds=0, dry_run=True, progress=calls)
    _monotonic_to_the_end(calls)
    assert calls[-1][1] == len(list(s.iter_objects()))
    calls = Calls()
    collect_garbage(s, dry_run=True, progress=calls)
    _monotonic_to_the_end(calls)
    calls = Calls()
    pytest.importorskip("safetensors")
    out = export_weights(s, "r", 3, tmp_path / "w.safetensors", progress=calls)
    assert calls[-1] == (out.total_bytes, out.total_bytes)  # the total is known: an ETA
    calls = Calls()
    src = tmp_path / "w.pt"
    torch.save({"w": torch.ones(1000)}, src)
    import_checkpoints(tmp_path / "imported", src, run="imp", step=1, progress=calls)
    assert calls[0] == (0, src.stat().st_size) and calls[-1] == (src.stat().st_size,) * 2


@pytest.fixture
def terminal(monkeypatch):
    """The CLI's stderr console as if it were a terminal, recorded."""
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    monkeypatch.setattr(progress_mod, "err_console", console)
    return buf


def test_bars_on_a_terminal_and_not_with_json(store, terminal):
    runner = CliRunner()
    res = runner.invoke(app, ["--root", str(store), "verify", "--deep"])
    assert res.exit_code == 0, res.output
    drawn = terminal.getvalue()
    assert "verify --deep" in drawn and "100%" in drawn and "KiB" in drawn
    terminal.seek(0)
    terminal.truncate()
    res = runner.invoke(app, ["--root", str(store), "verify", "--deep", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["ok"]
    assert terminal.getvalue() == ""
    res = runner.invoke(app, ["--root", str(store), "gc", "--dry-run", "--grace", "0s"])
    assert res.exit_code == 0 and "gc: objects examined" in terminal.getvalue()


def test_no_bars_when_not_a_terminal(store):
    res = CliRunner().invoke(app, ["--root", str(store), "verify", "--deep"])
    assert res.exit_code == 0 and "verify --deep" not in res.stderr and "━" not in res.output
