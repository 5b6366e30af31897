"""The torchtitan job's ``config_registry`` module (``--module torchtitan_configs``): the
llama3 debug model made small enough for two CPU processes, checkpointed through stepvault
(``llama3_stepvault``: the one line INTEGRATIONS.md shows) or torchtitan's own DCP
checkpointer (``llama3_dcp``), with the same schedule."""

from __future__ import annotations

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from stepvault.integrations.torchtitan import StepvaultCheckpointManager

INTERVAL = 3


def _small() -> Trainer.Config:
    config = llama3_debugmodel()
    # TEST-ONLY (CPU): causal SDPA in place of flex attention (torchtitan compiles flex
    # attention and its block masks with Inductor for GPUs); documents packed into one
    # sequence then attend across their boundary, which changes nothing checkpointed.
    model = config.model_spec.model
    for _, _, parent, attr in model.traverse(FlexAttention.Config):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    config.training.seq_len = 64
    config.training.local_batch_size = 2
    config.training.steps = 12
    config.training.mixed_precision_param = "float32"  # exact CPU arithmetic, no bf16 casts
    config.lr_scheduler.warmup_steps = 2
    config.validator.enable = False
    config.activation_checkpoint = None  # type: ignore[assignment]
    config.metrics.log_freq = 1
    config.debug.seed = 0  # the same initial weights in every job: runs are comparable
    config.parallelism.data_parallel_shard_degree = -1  # FSDP2 over every rank
    # Plain FSDP2 (fully_shard of plain modules): the default spmd_types backend
    # distributes the modules over a full SPMD mesh first, which fails on a CPU mesh.
    config.parallelism.spmd_backend = "partial_dtensor"
    return config


def llama3_stepvault() -> Trainer.Config:
    config = _small()
    config.checkpoint = StepvaultCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=INTERVAL, run="llama3", keep_last=3
    )
    return config


def llama3_dcp() -> Trainer.Config:
    config = _small()
    config.checkpoint = CheckpointManager.Config(
        enable=True,
        folder="checkpoint",
        interval=INTERVAL,
        keep_latest_k=3,
        last_save_model_only=False,
    )
    return config
