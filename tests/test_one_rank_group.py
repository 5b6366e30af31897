"""FSDP2 on a process group of one rank (``torchrun --nproc_per_node 1``, how a sharded
job is debugged on one GPU): a collective manager saves and restores it."""

from __future__ import annotations

from pathlib import Path

import dist_dedup_workers
import pytest
import torch
from helpers import spawn_ranks

import stepvault


@pytest.mark.slow
def test_fsdp2_on_a_group_of_one_rank_saves_with_collective_true(tmp_path: Path) -> None:
    root, out = tmp_path / "store", tmp_path / "out"
    spawn_ranks(dist_dedup_workers.run, 1, "one_rank", root, out)
    # What the one rank wrote is an ordinary collective checkpoint: a plain process
    # without a group restores its full tensors bitwise.
    saved = torch.load(out / "one_rank.pt", weights_only=True)
    plain = dist_dedup_workers.plain_model()
    state = {"model": plain, "step": 0}
    info = stepvault.restore(root, state, run="one", strict=False)
    assert info.step == 3 == state["step"]
    for name, value in plain.state_dict().items():
        assert torch.equal(value, saved[f"model.{name}"]), name
    assert stepvault.ops.verify(root, deep=True).ok


@pytest.mark.slow
@pytest.mark.extended
def test_accelerate_fsdp2_job_on_one_rank_saves_and_resumes_bitwise(tmp_path: Path) -> None:
    """The Accelerate FSDP2 job of tests/test_sharded_accelerate.py under ``torchrun
    --nproc_per_node 1``: AcceleratorCheckpointer saves its DTensor state and the resume
    repeats the same steps bitwise (it refused the save before)."""
    pytest.importorskip("accelerate")
    from ddp_util import run_job, torchrun

    script = Path(__file__).parent / "scripts" / "accelerate_fsdp2_state.py"
    out = run_job(torchrun(script, str(tmp_path / "store"), nproc=1))
    assert "RANK 0 OK" in out
    assert stepvault.open(tmp_path / "store").manifest("fsdp2", 3).sharded


def test_collective_true_without_a_process_group_is_refused_before_the_store(
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError, match="init_process_group"):
        stepvault.CheckpointManager(tmp_path / "store", "r", collective=True)
    assert not (tmp_path / "store").exists()
