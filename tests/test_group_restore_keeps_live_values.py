"""A one-process checkpoint restored collectively (under a process group) with
``strict=False``: an entry the checkpoint lacks keeps its live value, as it does without a
group (issue 30: a checkpointer's ``extra`` resumed from an imported Accelerate folder,
which holds none, came back as None; and ``strict=False`` was dropped on the way to the
collective planner, so the restore was refused, telling the caller to pass it). The
multi-rank case runs in ``tests/test_sharded_accelerate.py`` (``-m extended``, DDP and
FSDP1 jobs resuming an imported FSDP1 folder with ``extra``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import stepvault
from stepvault.errors import StateMismatchError


@pytest.fixture
def group():
    """A one-rank gloo group in this process: the collective path, without spawning."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_strict_false_keeps_live_values_the_checkpoint_lacks(tmp_path, group):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).square().mean().backward()
    opt.step()
    saved = {"model": model, "optimizer": opt, "step": 3}
    stepvault.save(tmp_path, saved, run="r", step=3)

    live = torch.nn.Linear(4, 2)
    live_opt = torch.optim.AdamW(live.parameters(), lr=1e-2)
    state = {"model": live, "optimizer": live_opt, "step": 0, "epoch": 5, "tags": ["a"]}
    info = stepvault.restore(tmp_path, state, run="r", strict=False, collective=True)
    assert info is not None and info.step == 3
    assert state["step"] == 3  # what the checkpoint holds is restored
    assert state["epoch"] == 5 and state["tags"] == ["a"]  # what it lacks keeps its value
    assert torch.equal(live.weight, model.weight)
    assert torch.equal(live_opt.state[live.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])

    # strict (the default) still refuses, naming the entries and the way out
    with pytest.raises(StateMismatchError, match=r"epoch: not in checkpoint.*strict=False"):
        stepvault.restore(tmp_path, dict(state), run="r", collective=True)
