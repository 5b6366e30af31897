"""FSDP1 (``FullyShardedDataParallel``) as the HF Trainer and Accelerate build it: the one
change that makes its sharded state save through the collective path.

FSDP1 built without a ``device_mesh`` (Accelerate passes none, and neither the Trainer's
``fsdp_config`` nor Accelerate's plugin can give one) shards its state dicts as
``ShardedTensor``s. A synchronous collective save and restore of those works, but the
asynchronous save's staging copy does not (torch 2.13's ``DefaultStager`` calls
``data_ptr`` on them: "torch function 'data_ptr' ... not supported for ShardedTensor").
Built with a 1-D mesh over the world, FSDP1 shards the same state as DTensors (the same
``torch.chunk`` layout), which every save mode, the planner's resharding and the export
take. For a FULL_SHARD or SHARD_GRAD_OP module whose process group is the default (world)
group, such a mesh changes nothing else: ``FullyShardedDataParallel.__init__`` with
``device_mesh`` sets ``_device_mesh`` and takes the mesh's group, which for a 1-D mesh over
the world *is* the default group. So :func:`give_world_mesh` sets ``_device_mesh`` on each
FSDP1 state after the framework has wrapped the model, as ``device_mesh=`` would have.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import StepvaultError

#: Sharding strategies whose state is sharded over the default group on one mesh dim.
FLAT_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")


def is_fsdp1(model: Any) -> bool:
    """Whether ``model`` is (or holds) FSDP1 ``FullyShardedDataParallel`` modules."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return isinstance(model, torch.nn.Module) and bool(FSDP.fsdp_modules(model))


def give_world_mesh(model: torch.nn.Module, where: str) -> None:
    """Give every FSDP1 state of ``model`` the 1-D device mesh over the world (see the
    module docstring), so that its state dicts are DTensors. Idempotent. Refuses, saying
    why and what to use, a sharding strategy or process group a 1-D world mesh would
    change (``where`` names the integration)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.distributed_c10d import _get_default_group
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    states = FSDP.fsdp_modules(model)
    todo = [s for s in states if getattr(s, "_device_mesh", None) is None]
    if not todo:
        return
    for state in todo:
        strategy = state.sharding_strategy.name
        if strategy not in FLAT_STRATEGIES:
            raise StepvaultError(
                f"{where}: FSDP1 with sharding_strategy {strategy} is not supported (its "
                "state is not sharded over one world-sized mesh dimension, which the "
                "collective save needs). Use FULL_SHARD or SHARD_GRAD_OP, or FSDP2 "
                '(fsdp_version: 2; the Trainer\'s fsdp_config={"version": 2}) with a '
                "2-D mesh for hybrid sharding; NO_SHARD is DDP: train without FSDP"
            )
        if state.process_group is not _get_default_group():
            raise StepvaultError(
                f"{where}: an FSDP1 module sharded over a process group other than the "
                "world is not supported; shard over the default group or use FSDP2 "
                "(fsdp_version: 2) with a device mesh"
            )
    device = todo[0].compute_device or torch.device("cpu")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if mesh.get_group(0) is not _get_default_group():  # a torch that builds a new group
        raise StepvaultError(
            f"{where}: this torch ({torch.__version__}) gives a 1-D world device mesh its "
            "own process group, so FSDP1 cannot be given one after wrapping; use FSDP2 "
            "(fsdp_version: 2)"
        )
    for state in todo:
        state._device_mesh = mesh
