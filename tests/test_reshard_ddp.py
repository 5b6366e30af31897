"""FSDP -> DDP in the restore planner: a checkpoint written collectively by a 2-rank FSDP2
job (DTensor shards) restores on every rank of a DDP job through rank-local readers, each
rank reading the full tensors in its own process (no collective inside the read), as one
process reshards. Every rank takes the RNG state the same rank saved, and a checkpoint
damaged in one rank's part is passed over by every rank alike.

Plain torch.distributed over gloo, spawned processes: ``slow``.
"""

from __future__ import annotations

import pytest
import reshard_ddp_workers as workers
import torch
from helpers import flip_byte, object_path, spawn_ranks

import stepvault
from stepvault.format import parse_manifest
from stepvault.store import Store

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]


def _damage_rank1_rng(root, run: str, step: int) -> str:
    """Flip a bit of an object of rank 1's RNG state in ``run@step`` only (no other
    checkpoint uses it): rank 0's own read of that checkpoint would not need it."""
    store = Store.open(root)
    m = parse_manifest(store.read_manifest(run, step), f"{run}@{step}")
    vault = stepvault.open(root)
    older = set().union(*(vault.manifest(run, s).objects for s in vault.steps(run) if s != step))
    for fqn, entry in m.sharded["entries"].items():
        if fqn.startswith("rng.rank1.") and entry["type"] == "tensor":
            for shard in entry["shards"]:
                digest = shard["chunks"][0][0]
                if digest not in older:
                    flip_byte(object_path(root, digest))
                    return fqn
    raise AssertionError(f"no object of rank 1's RNG in {run}@{step} alone")


def test_fsdp2_checkpoint_resumes_on_every_ddp_rank_falling_back_together(tmp_path):
    root, out = tmp_path / "store", tmp_path / "out"
    spawn_ranks(workers.run, 2, "fsdp_save", root, out)
    vault = stepvault.open(root)
    assert vault.steps(workers.RUN) == [1, 2, 3] and vault.manifest(workers.RUN, 3).sharded
    _damage_rank1_rng(root, workers.RUN, 3)

    spawn_ranks(workers.run, 2, "ddp_resume", root, out)
    saved = torch.load(out / "saved2.pt")
    for rank in (0, 1):
        got = torch.load(out / f"resumed{rank}.pt")
        # every rank passed over 3 (damage in rank 1's part) and restored 2
        assert (got["step"], got["skipped"], got["state_step"]) == (2, [3], 2), rank
        full = got["full"]
        assert sorted(full) == sorted(saved)
        differ = [k for k in saved if not torch.equal(saved[k], full[k])]
        assert not differ, (rank, differ)  # the whole model and optimizer, bitwise
        # this rank's RNG is the one the same rank saved: its next draw is that rank's
        assert torch.equal(got["draw"], torch.load(out / f"draw{rank}.pt")), rank
    vault = stepvault.open(root)
    assert 4 in vault.steps(workers.RUN) and not vault.manifest(workers.RUN, 4).sharded


@pytest.mark.extended
def test_fsdp2_checkpoint_of_2_ranks_on_4_ddp_ranks_says_what_each_rank_gets(tmp_path):
    """2 FSDP ranks -> 4 DDP ranks: every rank restores the whole model and optimizer
    bitwise; ranks 0 and 1 take the RNG state the same rank saved, ranks 2 and 3 (none in
    the checkpoint) keep their own and are warned. (4 processes: ``extended``.)"""
    root, out = tmp_path / "store", tmp_path / "out"
    spawn_ranks(workers.run, 2, "fsdp_save", root, out)
    spawn_ranks(workers.run, 4, "ddp_resume_wider", root, out)
    saved = torch.load(out / "saved2.pt")
    for rank in range(4):
        got = torch.load(out / f"wider{rank}.pt")
        differ = [k for k in saved if not torch.equal(saved[k], got["full"][k])]
        assert not differ, (rank, differ)
        if rank < 2:
            assert torch.equal(got["draw"], torch.load(out / f"draw{rank}.pt")), rank
            assert not got["warnings"], got["warnings"]
        else:
            assert not torch.equal(got["draw"], torch.load(out / "draw0.pt"))
            assert any(f"no RNG state for rank {rank}" in w for w in got["warnings"]), got
