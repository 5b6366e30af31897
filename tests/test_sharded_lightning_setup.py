"""Lightning's sharding strategies at ``StepvaultCheckpoint.setup`` (fast, one process):
what the callback takes over and what it refuses, with why and what to use. The
2-process jobs are in tests/test_sharded_lightning.py."""

from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy  # noqa: E402

from stepvault.errors import StepvaultError  # noqa: E402
from stepvault.integrations.lightning import StepvaultCheckpoint  # noqa: E402


class _Module(pl.LightningModule):
    pass


class _CPUFSDPStrategy(FSDPStrategy):
    """TEST-ONLY: Lightning accepts the exact FSDPStrategy class only with a GPU
    accelerator; a subclass is let through on CPU (nothing here starts FSDP)."""


def _trainer(strategy) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


@pytest.mark.parametrize(
    ("kwargs", "refusal"),
    [
        # hybrid: replicated across one dimension, sharded along the other (not one
        # world-sized group); auto_wrap_policy lets Lightning build it without a mesh
        (
            {"sharding_strategy": "HYBRID_SHARD", "auto_wrap_policy": {torch.nn.Linear}},
            r"HYBRID_SHARD.*without a device_mesh.*FULL_SHARD or SHARD_GRAD_OP.*ModelParallel",
        ),
        ({"sharding_strategy": "NO_SHARD"}, r"NO_SHARD.*is DDP: use strategy=\"ddp\""),
        ({"process_group": object()}, r"process_group=.*Leave process_group out"),
    ],
)
def test_fsdp_strategy_without_a_mesh_is_refused_where_the_world_mesh_cannot_be_given(
    tmp_path, kwargs, refusal
):
    ckpt = StepvaultCheckpoint(tmp_path, run="r")
    trainer = _trainer(_CPUFSDPStrategy(state_dict_type="sharded", **kwargs))
    with pytest.raises(StepvaultError, match=refusal):
        ckpt.setup(trainer, _Module(), "fit")
    assert ckpt.manager is None  # nothing opened in the store
    assert not (tmp_path / "stepvault.json").exists()


@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_fsdp_strategy_without_a_mesh_is_taken(tmp_path, sharding):
    # FULL_SHARD/SHARD_GRAD_OP over the world: the callback gives FSDP1 the world mesh
    # after wrapping (the 2-process job is in tests/test_sharded_lightning.py); here only
    # the one-device refusal is left, which every sharding strategy gets.
    ckpt = StepvaultCheckpoint(tmp_path, run="r")
    trainer = _trainer(_CPUFSDPStrategy(state_dict_type="sharded", sharding_strategy=sharding))
    with pytest.raises(StepvaultError, match=r"on one device"):
        ckpt.setup(trainer, _Module(), "fit")
    assert ckpt.manager is None


def test_model_parallel_strategy_save_and_load_are_taken_over_and_given_back(tmp_path):
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    own_save, own_load = strategy.save_checkpoint, strategy.load_checkpoint
    ckpt = StepvaultCheckpoint(tmp_path, run="r")
    trainer = _trainer(strategy)
    ckpt._sharded = ckpt._sharding_strategy(strategy)
    assert ckpt._sharded
    undo = ckpt._take_over(strategy)
    assert strategy.save_checkpoint != own_save and strategy.load_checkpoint != own_load
    with pytest.raises(ValueError, match="stepvault:<step>"):
        strategy.save_checkpoint({}, "stepvault:latest")
    undo()
    assert strategy.save_checkpoint == own_save and strategy.load_checkpoint == own_load
    assert trainer.strategy is strategy


def test_a_sharding_strategy_on_one_device_is_refused_with_the_way_out(tmp_path):
    # One process: the DTensor state would need a collective save of more ranks.
    ckpt = StepvaultCheckpoint(tmp_path, run="r")
    trainer = _trainer(ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1))
    with pytest.raises(StepvaultError, match=r"on one device.*strategy=\"auto\""):
        ckpt.setup(trainer, _Module(), "fit")
    assert ckpt.manager is None
