"""``stepvault diff`` / ``ops.diff`` on real checkpoints: per-tensor change, exact and light
bytes, the JSON schema, bad refs, and reading across tiers."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import stepvault
from stepvault import ops
from stepvault.cli.main import app
from stepvault.errors import CheckpointNotFoundError, InvalidNameError
from stepvault.store import Store
from stepvault.tiers import Tiers, TierSpec, add_tier, copy_checkpoint

ROW_KEYS = {
    "name", "status", "equal", "dtype", "shape", "max_abs", "mean_abs", "rel",
    "exact_bytes", "light_bytes",
}  # fmt: skip


@pytest.fixture()
def two_steps(tmp_path):
    """r@1 and r@2 of a real AdamW run; r@2 after one more step with the bias frozen."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 4))
    net[1].bias.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    x, y = torch.randn(16, 300), torch.randn(16, 4)
    states = {}
    for step in (1, 2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        stepvault.save(tmp_path / "s", {"model": net, "optim": opt}, run="r", step=step)
        states[step] = {k: v.clone() for k, v in net.state_dict().items()}
    return tmp_path / "s", states


def test_diff_reports_change_and_cost_per_tensor(two_steps):
    root, states = two_steps
    report = ops.diff(root, "r@1", "r@2")
    rows = {t.name: t for t in report.tensors}
    w = rows["model/0.weight"]
    d = (states[2]["0.weight"].double() - states[1]["0.weight"].double()).abs()
    assert w.status == "changed" and not w.equal
    assert w.max_abs == pytest.approx(float(d.max())) and w.mean_abs == pytest.approx(
        float(d.mean())
    )
    assert 0 < w.rel < 1
    assert w.exact_bytes == 300 * 300 * 4  # every chunk new
    assert 0 < w.light_bytes < w.exact_bytes / 3  # int8 + scales
    frozen = rows["model/1.bias"]
    # Equal bytes, no light payload; as a small tensor it lives in a bundle whose other
    # members changed, so an exact checkpoint rewrites its 16 bytes with the bundle.
    assert frozen.equal and frozen.light_bytes == 0 and frozen.exact_bytes <= 16
    assert report.exact_bytes == sum(t.exact_bytes for t in report.tensors)
    same = ops.diff(root, "r@2", "r@2")
    assert all(t.equal for t in same.tensors) and same.exact_bytes == 0


def test_diff_cli_json_schema_and_table(two_steps):
    root, _ = two_steps
    runner = CliRunner()
    out = runner.invoke(app, ["--root", str(root), "diff", "r@1", "r@latest", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert {
        "attachments",
        "tensors",
        "counts",
        "exact_bytes",
        "light_bytes",
        "before",
        "after",
    } <= set(doc)
    assert doc["after"] == "r@2"
    for row in doc["tensors"]:
        assert set(row) >= ROW_KEYS
        assert row["status"] in {"same", "changed", "added", "removed"}
        assert row["equal"] == (row["status"] == "same")
    assert doc["counts"]["changed"] >= 3 and doc["counts"]["same"] >= 1
    text = runner.invoke(app, ["--root", str(root), "diff", "r@1", "r@2"])
    assert text.exit_code == 0 and "of new chunks, a light one" in text.output


def test_diff_refuses_bad_refs_clearly(two_steps):
    root, _ = two_steps
    with pytest.raises(CheckpointNotFoundError):
        ops.diff(root, "r@1", "r@9")
    with pytest.raises(InvalidNameError, match="RUN@STEP"):
        ops.diff(root, "r@x", "r@1")
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        ops.diff(root, "nope", "r@1")
    out = CliRunner().invoke(app, ["--root", str(root), "diff", "r@1", "r@9"])
    assert out.exit_code != 0 and "r@9" in out.output


def test_diff_reads_across_tiers(two_steps, tmp_path):
    root, _ = two_steps
    hot = Store.open(root)
    add_tier(hot, TierSpec("cold", str(tmp_path / "cold"), codec="xor"))
    tiers = Tiers.of(hot)
    for s in (1, 2):
        copy_checkpoint(hot, tiers["cold"], "r", s, codec="xor")
    before = ops.diff(root, "r@1", "r@2").to_json()
    hot.delete_manifest("r", 1)  # r@1 now only in the cold tier
    after = ops.diff(root, "r@1", "r@2").to_json()
    assert after == before
