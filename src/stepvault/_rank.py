"""This process's rank and the world size of the default process group, in one place (a
leaf module: every layer may import it; torch is imported when a function is called)."""

from __future__ import annotations

__all__ = ["current_rank", "rank_and_world", "world_size"]


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group; ``(0, 1)`` without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def current_rank() -> int:
    """This process's rank in the default group (0 without one)."""
    return rank_and_world()[0]


def world_size() -> int:
    """The number of ranks in the default group (1 without one)."""
    return rank_and_world()[1]
