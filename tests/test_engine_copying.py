"""Parallel host copies (placement on restore, staging on save) and the one-block staging."""

from __future__ import annotations

import numpy as np
import torch

import stepvault
from stepvault.engine import copying
from stepvault.engine.staging_area import StagingArea


def test_parallel_copy_cuts_large_copies_into_pieces_and_copies_every_byte(monkeypatch):
    monkeypatch.setattr(copying, "PARALLEL_FROM", 1 << 10)
    monkeypatch.setattr(copying, "PIECE", 1000)  # not a divisor of the sizes below
    rng = np.random.default_rng(0)
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (10_007, 3, 2500, 0)]
    dsts = [np.zeros_like(s) for s in srcs]
    pieces = copying._pieces(list(zip(dsts, srcs)))
    assert len(pieces) == 11 + 1 + 3 + 1
    copying.parallel_copy(list(zip(dsts, srcs)))
    for d, s in zip(dsts, srcs):
        assert np.array_equal(d, s)


def test_restore_places_every_tensor_through_the_parallel_path(tmp_path, monkeypatch):
    monkeypatch.setattr(copying, "PARALLEL_FROM", 1 << 10)
    monkeypatch.setattr(copying, "PIECE", 4096 + 8)
    calls = []
    real = copying._pool

    def counting_pool():
        calls.append(1)
        return real()

    monkeypatch.setattr(copying, "_pool", counting_pool)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 7))
    stepvault.save(tmp_path, {"model": model}, run="r", step=1)
    live = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 7))
    stepvault.restore(tmp_path, {"model": live}, run="r", step=1)
    assert calls  # the placement copies went through the pool
    for a, b in zip(model.state_dict().values(), live.state_dict().values()):
        assert torch.equal(a, b)


def test_staging_uses_one_block_reused_until_the_layout_changes():
    area = StagingArea(pin_memory=False)
    state = {
        "a": torch.arange(10, dtype=torch.float32),
        "b": torch.ones(3, dtype=torch.int64),
        "c": np.arange(5, dtype=np.float64),
    }
    out = area.stage(state)
    block = area._block
    assert area.nbytes == 64 * 3  # each buffer 64-byte aligned inside one allocation
    assert np.array_equal(np.frombuffer(out["a"].data, np.float32), np.arange(10))
    assert np.array_equal(np.frombuffer(out["b"].data, np.int64), np.ones(3))
    assert np.array_equal(np.frombuffer(out["c"].data, np.float64), np.arange(5))
    state["a"] += 1
    out = area.stage(state)
    assert area._block is block  # same layout: same memory
    assert np.array_equal(np.frombuffer(out["a"].data, np.float32), np.arange(1, 11))
    state["d"] = torch.zeros(100, dtype=torch.bfloat16)
    area.stage(state)
    assert area._block is not block and area.nbytes == 64 * 3 + 256
    area.release()
    assert area.nbytes == 0
