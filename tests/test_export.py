"""Export of weights to safetensors: single file, sharded set, cast, filter, strip."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import stepvault
from stepvault.cli.main import app


@pytest.fixture
def store(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    stepvault.save(tmp_path / "s", {"model": model, "optimizer": opt, "step": 1}, run="r", step=1)
    return tmp_path / "s", model


def test_export_single_file_is_bitwise(store, tmp_path):
    root, model = store
    out = tmp_path / "w.safetensors"
    res = CliRunner().invoke(app, ["--root", str(root), "export", "r@1", "-o", str(out)])
    assert res.exit_code == 0, res.output
    loaded = load_file(out)
    expected = model.state_dict()
    assert loaded.keys() == expected.keys()  # weights only: no optimizer state
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


def test_export_sharded_with_cast_filter_and_strip(store, tmp_path):
    root, model = store
    out = tmp_path / "hf"
    report = stepvault.ops.export_weights(
        stepvault.open(root).store,
        "r",
        1,
        out,
        dtype="bfloat16",
        include=r"weight",
        strip_prefix="0.",
        max_shard_size=5_000,
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"weight", "2.weight"}
    assert len(set(index["weight_map"].values())) == 2  # 8 KiB + 1 KiB in bf16 > 5 kB
    merged = {}
    for f in set(index["weight_map"].values()):
        merged.update(load_file(out / f))
    assert merged["weight"].dtype == torch.bfloat16
    assert torch.equal(merged["weight"], model[0].weight.detach().to(torch.bfloat16))
    assert report.tensors == 2 and report.cast == "bfloat16"
    assert index["metadata"]["total_size"] == report.total_bytes


def test_export_errors(store, tmp_path):
    root, _ = store
    runner = CliRunner()
    res = runner.invoke(
        app, ["--root", str(root), "export", "r@1", "-o", str(tmp_path / "x"), "--module", "nope"]
    )
    assert res.exit_code == 2 and "no module 'nope'" in res.output
    res = runner.invoke(
        app, ["--root", str(root), "export", "r@1", "-o", str(tmp_path / "x"), "--include", "^zzz"]
    )
    assert res.exit_code == 2 and "nothing to export" in res.output
