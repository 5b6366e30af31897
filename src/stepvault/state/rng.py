"""Random-number-generator state as a Stateful object: Python, numpy, torch (CPU and CUDA)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RNGState:
    """Captures and restores every global RNG a training loop draws from.

    Put one in the state (``state["rng"] = stepvault.RNGState()``) and dropout masks, data
    shuffles and augmentations continue exactly after a resume. Extra ``numpy.random.Generator``
    and ``torch.Generator`` objects (e.g. a DataLoader's generator) are captured too when
    passed as ``generators``.
    """

    def __init__(self, generators: list[Any] | None = None, *, cuda: bool | None = None) -> None:
        self.generators = list(generators or [])
        self.cuda = torch.cuda.is_available() if cuda is None else cuda

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        state: dict[str, Any] = {
            "python": {"version": version, "state": list(internal), "gauss_next": gauss},
            "numpy": np.random.get_state(legacy=False),
            "torch": torch.get_rng_state(),
            "generators": [_gen_state(g) for g in self.generators],
        }
        if self.cuda:
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = _own_rank(state)
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if self.cuda and "cuda" in state:
            torch.cuda.set_rng_state_all(state["cuda"])
        saved = state.get("generators", [])
        if len(saved) != len(self.generators):
            raise ValueError(
                f"checkpoint holds {len(saved)} extra generator states, RNGState has "
                f"{len(self.generators)} generators"
            )
        for gen, gstate in zip(self.generators, saved):
            _set_gen_state(gen, gstate)


def _own_rank(state: dict[str, Any]) -> dict[str, Any]:
    """This rank's entry when ``state`` holds every rank's under ``ranks`` (rank 0's state
    at the top: what the Trainer integration writes and an import of per-rank RNG files
    holds), so each rank of a resume continues its own draws; rank 0's when the process
    group is larger than the saving one (a warning: its draws will differ)."""
    ranks = state.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        return state
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank < len(ranks):
        return dict(ranks[rank])
    import warnings

    warnings.warn(
        f"stepvault: the RNG state was saved by {len(ranks)} process(es); rank {rank} has "
        "none of its own and continues from rank 0's",
        RuntimeWarning,
        stacklevel=3,
    )
    return state


def _gen_state(gen: Any) -> Any:
    if isinstance(gen, torch.Generator):
        return {"torch": gen.get_state()}
    if isinstance(gen, np.random.Generator):
        return {"numpy": gen.bit_generator.state}
    if isinstance(gen, random.Random):
        version, internal, gauss = gen.getstate()
        return {"python": {"version": version, "state": list(internal), "gauss_next": gauss}}
    raise TypeError(f"unsupported generator type {type(gen).__name__}")


def _set_gen_state(gen: Any, state: dict[str, Any]) -> None:
    if isinstance(gen, torch.Generator):
        gen.set_state(state["torch"])
    elif isinstance(gen, np.random.Generator):
        gen.bit_generator.state = state["numpy"]
    else:
        py = state["python"]
        gen.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
