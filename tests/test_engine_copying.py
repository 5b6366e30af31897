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


def test_split_spans_covers_every_byte_once_in_balanced_shares():
    spans = [(1 << 40, 1 << 30, 10_000), (2 << 40, 2 << 30, 3), (3 << 40, 3 << 30, 50_000)]
    for parts in (1, 2, 3, 4):
        shares = copying.split_spans(spans, parts)
        assert 1 <= len(shares) <= parts
        flat = [s for share in shares for s in share]
        # Same bytes, in order, nothing lost or doubled: merge the pieces back.
        merged: list[list[int]] = []
        for dst, src, n in flat:
            last = merged[-1] if merged else None
            if last and last[0] + last[2] == dst and last[1] + last[2] == src:
                last[2] += n
            else:
                merged.append([dst, src, n])
        assert [tuple(m) for m in merged] == spans
        sizes = [sum(n for _, _, n in share) for share in shares]
        assert max(sizes) - min(sizes) <= copying.SHARE_ALIGN + 60_003 // parts


def test_copy_spans_copies_on_several_threads():
    src = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    cuts = ((0, 300_001), (300_001, (1 << 20) - 300_001))
    spans = [(dst.ctypes.data + at, src.ctypes.data + at, n) for at, n in cuts]
    shares = copying.split_spans(spans, 3)
    assert len(shares) == 3
    copying.copy_spans(shares)
    assert np.array_equal(dst, src)


def test_staging_follows_tensors_whose_storage_or_layout_changed(monkeypatch):
    # The copy plan is cached per layout; it must never copy from a stale address.
    monkeypatch.setattr(copying, "PARALLEL_FROM", 1 << 10)  # the threaded path, small
    area = StagingArea(pin_memory=False)
    lin = torch.nn.Linear(300, 200)
    state = {"w": lin.weight, "b": lin.bias, "t": torch.arange(6.0).reshape(2, 3)}

    def staged(name):
        a = out[name]
        return torch.frombuffer(bytearray(a.data), dtype=torch.float32).reshape(a.shape)

    out = area.stage(state)
    assert torch.equal(staged("w"), lin.weight.detach())
    plan = area._plan
    with torch.no_grad():
        lin.weight.add_(1.0)  # in place: same storage, same plan
    out = area.stage(state)
    assert area._plan is plan and torch.equal(staged("w"), lin.weight.detach())
    lin.weight.data = torch.randn(200, 300)  # new storage behind the same Parameter
    out = area.stage(state)
    assert area._plan is not plan and torch.equal(staged("w"), lin.weight.detach())
    state["t"] = torch.arange(6.0).reshape(3, 2).t()  # not contiguous: copied by torch
    out = area.stage(state)
    assert torch.equal(staged("t"), state["t"])
    snapshot = {k: staged(k).clone() for k in state}
    with torch.no_grad():  # training goes on at once: the staged bytes do not move
        for t in (lin.weight, lin.bias, state["t"]):
            t.mul_(-3.0)
    assert all(torch.equal(staged(k), v) for k, v in snapshot.items())
    area.release()


def test_tied_tensors_are_staged_once_and_saved_under_both_names(tmp_path):
    emb = torch.nn.Embedding(1000, 64)
    head = torch.nn.Linear(64, 1000, bias=False)
    head.weight = emb.weight  # tied, as GPT-2's wte and lm_head
    area = StagingArea(pin_memory=False)
    state = {"wte": emb.weight, "lm_head": head.weight, "b": torch.ones(3)}
    out = area.stage(state)
    assert area.nbytes == emb.weight.nbytes + 64  # one copy of the tied weight
    assert out["wte"].data is out["lm_head"].data
    # Through the manager: both names saved and restored, the copy taken at save().
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    expected = emb.weight.detach().clone()
    with stepvault.CheckpointManager(tmp_path, "r", async_save=True) as mgr:
        handle = mgr.save(1, {"model": model}, force=True)
        with torch.no_grad():
            emb.weight.add_(1.0)  # training goes on before the write
        handle.result()
    ckpt = stepvault.open(tmp_path).checkpoint("r", 1)
    names = [n for n in ckpt.tensor_names() if n.endswith("weight")]
    assert len(names) == 2
    for name in names:
        assert torch.equal(ckpt.tensor(name), expected), name
