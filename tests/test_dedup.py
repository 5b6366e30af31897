"""Content addressing: unchanged chunks cost nothing in the next checkpoint."""

from __future__ import annotations

import torch

import stepvault


def _model(layers: int = 8, width: int = 512) -> torch.nn.Sequential:
    torch.manual_seed(0)
    # 512x512 fp32 weights are 1 MiB each: stored as chunks of their own, not bundled.
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _train_step(model, opt):
    opt.zero_grad()
    model(torch.randn(4, 512)).pow(2).mean().backward()
    opt.step()


def test_unchanged_save_writes_nothing_new(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train_step(model, opt)
    first = stepvault.save(tmp_path, {"model": model, "optimizer": opt}, run="r", step=1)
    second = stepvault.save(tmp_path, {"model": model, "optimizer": opt}, run="r", step=2)
    assert first.new_bytes > 0.95 * first.logical_bytes
    assert second.new_bytes == 0 and second.new_objects == 0
    assert second.stored_bytes == first.stored_bytes
    usage = stepvault.ops.usage(tmp_path)
    assert usage.logical_bytes == 2 * first.logical_bytes
    assert usage.raw_bytes <= first.logical_bytes + 4096
    assert usage.unreferenced_objects == 0


def _new_bytes_after_one_step(tmp_path, run: str, frozen: int) -> tuple[int, int]:
    model = _model()
    for layer in list(model)[:frozen]:
        layer.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    _train_step(model, opt)
    stepvault.save(tmp_path, {"model": model, "optimizer": opt}, run=run, step=1)
    _train_step(model, opt)
    info = stepvault.save(tmp_path, {"model": model, "optimizer": opt}, run=run, step=2)
    return info.new_bytes, info.logical_bytes


def test_freezing_half_the_layers_halves_new_bytes(tmp_path):
    full_new, _ = _new_bytes_after_one_step(tmp_path / "a", "full", frozen=0)
    half_new, _ = _new_bytes_after_one_step(tmp_path / "b", "half", frozen=4)
    ratio = half_new / full_new
    assert 0.4 < ratio < 0.6, ratio


def test_identical_tensors_are_stored_once(tmp_path):
    t = torch.randn(1 << 19)  # 2 MiB
    info = stepvault.save(tmp_path, {"a": t, "b": t.clone(), "c": t.clone()}, run="r", step=1)
    assert info.logical_bytes == 3 * t.nbytes
    assert info.stored_bytes < 1.01 * t.nbytes
