"""Dedup of collective saves: each tensor of a rank starts its own chunk, so a frozen
tensor's chunks are free in the next save (2 gloo ranks, FSDP2, real processes)."""

from __future__ import annotations

from pathlib import Path

import dist_dedup_workers
import pytest
import torch
from helpers import spawn_ranks

import stepvault


def _chunks(manifest, prefixes: tuple[str, ...]) -> set[str]:
    """The objects the tensor entries under ``prefixes`` name, every shard."""
    return {
        c[0]
        for name, e in manifest.sharded["entries"].items()
        if e["type"] == "tensor" and name.startswith(prefixes)
        for sh in e["shards"]
        for c in sh["chunks"]
    }


@pytest.mark.slow
@pytest.mark.extended
def test_second_collective_save_of_a_fine_tune_writes_no_chunk_of_its_frozen_tensors(
    tmp_path: Path,
) -> None:
    root, out = tmp_path / "store", tmp_path / "out"
    spawn_ranks(dist_dedup_workers.run, 2, "fine_tune", root, out)
    vault = stepvault.open(root)
    first, second = vault.manifest("ft", 1), vault.manifest("ft", 2)
    frozen = dist_dedup_workers.FROZEN
    trained = tuple(n for n in second.sharded["entries"] if not n.startswith(frozen))
    assert _chunks(second, frozen) and _chunks(second, trained)
    # The frozen tensors' chunks are the first save's, and none of them is new ...
    new = set(second.objects) - set(first.objects)
    assert _chunks(second, frozen) == _chunks(first, frozen)
    assert not new & _chunks(second, frozen)
    # ... nor shared with a trained tensor (a bundle of both would change at every save).
    assert not _chunks(second, frozen) & _chunks(second, trained)
    # What the second save wrote is the trained part only, counted by the save itself too.
    trained_bytes = sum(second.objects[d].size for d in _chunks(second, trained))
    assert sum(second.objects[d].size for d in new) <= trained_bytes
    assert 0 < second.stats["new_bytes"] <= trained_bytes
    # The save's own count is exact: each new object once, over both ranks.
    assert second.stats["new_objects"] == len(new)
    assert second.stats["new_bytes"] == sum(second.objects[d].size for d in new)
    # The writer before this change (run "old", one bundle per rank) shares nothing.
    old = vault.manifest("old", 2)
    assert _chunks(old, frozen) & _chunks(old, trained)
    # One process (no group) restores the gathered weights of the new layout bitwise.
    saved = torch.load(out / "saved2.pt", weights_only=True)
    plain = dist_dedup_workers.plain_model()
    state = {"model": plain, "step": 0}
    stepvault.restore(root, state, run="ft", step=2, strict=False)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, saved[f"model.{name}"]), name
    assert stepvault.ops.verify(root, deep=True).ok


def test_collective_writer_gives_each_tensor_its_own_chunk_and_bundles_only_scalars(
    tmp_path: Path,
) -> None:
    """The same writer without a group (DCP in one process): the frozen tensors' chunks
    of the first save are the second's; only the step counters share a bundle."""
    import stepvault.distributed as sd

    g = torch.Generator().manual_seed(0)
    state = {
        "frozen": {"w": torch.randn(16, 32, generator=g), "ln": torch.randn(16, generator=g)},
        "trained": {"w": torch.randn(32, 32, generator=g)},
        "steps": {"a": torch.tensor(1.0), "b": torch.tensor(1.0)},
    }
    sd.save_sharded(tmp_path, state, run="r", step=1)
    state["trained"]["w"] += 1
    state["steps"] = {"a": torch.tensor(2.0), "b": torch.tensor(2.0)}
    sd.save_sharded(tmp_path, state, run="r", step=2)
    vault = stepvault.open(tmp_path)
    first, second = vault.manifest("r", 1), vault.manifest("r", 2)
    assert _chunks(second, ("frozen.",)) == _chunks(first, ("frozen.",))
    assert len(_chunks(second, ("frozen.",))) == 2  # one object per tensor
    new = set(second.objects) - set(first.objects)
    assert new == _chunks(second, ("trained.", "steps."))
    assert len(_chunks(second, ("steps.",))) == 1  # the scalars: one bundle
    # The save counts what it stored new (it said 0 objects before).
    assert second.stats["new_objects"] == len(new) == 2
    assert second.stats["new_bytes"] == sum(second.objects[d].size for d in new)
    assert first.stats["new_objects"] == len(first.objects)
    loaded = vault.checkpoint("r@2").load()
    assert torch.equal(loaded["trained"]["w"], state["trained"]["w"])
    assert torch.equal(loaded["frozen"]["ln"], state["frozen"]["ln"])
