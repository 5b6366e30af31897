"""Progress of restores (a bar when reading from a slow tier) and of exports (with a total,
so the bar has an ETA)."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

import stepvault
from stepvault import CheckpointManager
from stepvault import _progress as progress_mod
from stepvault.format import parse_manifest
from stepvault.store import Store


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))


def test_restore_reports_every_verified_byte(tmp_path):
    stepvault.save(tmp_path, {"model": _model()}, run="r", step=1)
    m = parse_manifest(Store.open(tmp_path).read_manifest("r", 1))
    stored = sum(e.size for e in m.objects.values())
    calls: list[tuple[int, int | None]] = []
    model = _model(1)
    stepvault.restore(
        tmp_path, {"model": model}, run="r", progress=lambda d, t: calls.append((d, t))
    )
    assert calls and calls[-1] == (stored, stored)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), _model().state_dict().values())
    )
    calls.clear()
    with CheckpointManager(tmp_path, "r", lineage=False) as mgr:
        mgr.restore({"model": _model(2)}, progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (stored, stored)


@pytest.fixture
def terminal(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(
        progress_mod,
        "Console",
        lambda stderr=True: Console(file=buf, force_terminal=True, width=100),
    )
    return buf


def test_a_bar_by_default_only_when_reading_from_a_remote_store(tmp_path, terminal):
    stepvault.save(tmp_path, {"model": _model()}, run="r", step=1)
    stepvault.restore(tmp_path, {"model": _model(1)}, run="r")  # local disk: no bar
    assert terminal.getvalue() == ""
    stepvault.restore(tmp_path, {"model": _model(1)}, run="r", progress=True)
    assert "restore r" in terminal.getvalue()
    terminal.seek(0)
    terminal.truncate()
    remote = "memory://restore-progress-test/store"
    stepvault.save(remote, {"model": _model()}, run="r", step=1)
    stepvault.restore(remote, {"model": _model(1)}, run="r")  # an object store: a bar
    assert "restore r" in terminal.getvalue()
    terminal.seek(0)
    terminal.truncate()
    stepvault.restore(remote, {"model": _model(1)}, run="r", progress=False)
    assert terminal.getvalue() == ""


def test_export_progress_knows_its_total(tmp_path):
    pytest.importorskip("safetensors")
    stepvault.save(tmp_path, {"model": _model()}, run="r", step=1)
    calls: list[tuple[int, int | None]] = []
    stepvault.ops.export_weights(
        Store.open(tmp_path),
        "r",
        1,
        tmp_path / "w.safetensors",
        progress=lambda d, t: calls.append((d, t)),
    )
    total = sum(p.numel() * p.element_size() for p in _model().parameters())
    assert calls[-1] == (total, total) and all(t == total for _, t in calls)
