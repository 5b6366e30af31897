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
    # A cast to an integer or bool type truncated every weight (int8: all zeros), exit 0.
    for dtype in ("int8", "bool"):
        for fmt in (
            ["-o", str(tmp_path / "c.safetensors")],
            ["-o", str(tmp_path / "hf"), "--format", "folder"],
        ):
            res = runner.invoke(app, ["--root", str(root), "export", "r@1", *fmt, "--dtype", dtype])
            assert res.exit_code == 2 and "--quantize int8" in res.output, res.output
    assert not (tmp_path / "c.safetensors").exists() and not (tmp_path / "hf").exists()


def test_int8_export_is_marked_lossy_and_within_its_error_bound(tmp_path):
    from safetensors import safe_open

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.LayerNorm(128))
    with torch.no_grad():
        model[0].weight[3] = 0.0  # an all-zero channel must not divide by zero
    stepvault.save(tmp_path / "s", {"model": model}, run="q", step=1)
    out = tmp_path / "q.safetensors"
    res = CliRunner().invoke(
        app, ["--root", str(tmp_path / "s"), "export", "q@1", "-o", str(out), "--quantize", "int8"]
    )
    assert res.exit_code == 0, res.output
    assert "LOSSY" in res.output and "relative error" in res.output
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["lossy"] == "true" and meta["stepvault_quantization"].startswith("int8")
    loaded = load_file(out)
    w = model[0].weight.detach()
    q, scale = loaded["0.weight"], loaded["0.weight.scale"]
    assert q.dtype == torch.int8 and scale.shape == (128,) and scale.dtype == torch.float32
    deq = stepvault.ops.dequantize_int8(loaded)
    # Round-to-nearest with scale = max|row| / 127: every element within half a step.
    assert ((deq["0.weight"] - w).abs() <= scale[:, None] / 2 + 1e-7).all()
    assert torch.equal(deq["0.weight"][3], torch.zeros(256))
    rel = float(torch.linalg.vector_norm(deq["0.weight"] - w) / torch.linalg.vector_norm(w))
    assert rel < 0.01
    # 1-D tensors (bias, LayerNorm) are not quantized: bitwise as trained.
    for name in ("0.bias", "1.weight", "1.bias"):
        assert torch.equal(deq[name], model.state_dict()[name])
    report = stepvault.ops.export_weights(
        stepvault.open(tmp_path / "s").store, "q", 1, tmp_path / "dir", quantize="int8"
    )
    assert report.quantization["tensors"] == 1 and report.quantization["lossy"] is True
    assert report.quantization["max_rel_error"] == pytest.approx(rel, rel=1e-5)
    with pytest.raises(ValueError, match="quantize"):
        stepvault.ops.export_weights(
            stepvault.open(tmp_path / "s").store, "q", 1, tmp_path / "x", quantize="int4"
        )


def test_export_of_a_run_at_step_reference_logs_on_the_run(store, tmp_path):
    """``export_weights(store, "r@1", None)`` (the reference as one string, as the API
    takes it from users) exports step 1 and records the event on run ``r``."""
    from stepvault.catalog.events import read_events
    from stepvault.ops.export import export_weights
    from stepvault.store import Store

    root, model = store
    out = tmp_path / "ref.safetensors"
    report = export_weights(Store.open(root), "r@1", None, out)
    assert report.step == 1
    loaded = load_file(out)
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    exports = [e for e in read_events(Store.open(root), "r") if e["event"] == "export"]
    assert [(e["step"], e["output"]) for e in exports] == [(1, str(out))]
