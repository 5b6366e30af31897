"""The GPU save path on a real CUDA device (skipped without one; CI has none).

What the fakes in test_staging_prepare.py cannot show: that a save of CUDA tensors holds
the values they had *at the save call* although the next training step (AdamW writing
the parameters and moments in place) is launched before the device-to-host copies ran;
that back-to-back saves reusing the pinned buffers never mix two steps; that restores
bring CUDA state back bitwise (model, optimizer, CUDA RNG), also under a process group
(DCP with pinned staging) and through the mem tier.
"""

from __future__ import annotations

import pytest
import torch
from test_distributed import _spawn

import stepvault
from stepvault import CheckpointManager
from stepvault.manager.options import ManagerOptions, StagingOptions

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

WIDTH = 1024  # 4 MiB per weight: copies long enough to still run when the step is launched


def _train_state(seed: int = 0, layers: int = 8) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optimizer": opt, "step": 0}


def _step(state: dict) -> None:
    model, opt = state["model"], state["optimizer"]
    x = torch.randn(256, WIDTH, device="cuda")
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    state["step"] += 1


def _snapshot(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the state, cloned on the device (same stream: ordered with training)."""
    out = {f"model.{k}": v.detach().clone() for k, v in state["model"].state_dict().items()}
    for i, s in enumerate(state["optimizer"].state.values()):
        for k, v in s.items():
            if torch.is_tensor(v):
                out[f"opt.{i}.{k}"] = v.detach().clone()
    return out


def _assert_bitwise(state: dict, snap: dict[str, torch.Tensor]) -> None:
    now = _snapshot(state)
    assert now.keys() == snap.keys()
    for k in snap:
        assert now[k].device == snap[k].device, k  # AdamW's step counts stay on the CPU
        assert torch.equal(now[k], snap[k]), f"{k} differs"


def test_async_save_holds_the_values_at_the_call_while_the_next_steps_run(tmp_path):
    state = _train_state()
    _step(state)
    with CheckpointManager(tmp_path, "gpu", async_save=True, lineage=False) as mgr:
        mgr.prepare(state, wait=True)
        area = mgr._p.staging._areas[0]
        assert area.pin_memory and area._block.is_pinned()  # DMA, not pageable copies
        _step(state)
        snap = _snapshot(state)
        handle = mgr.save(state["step"], state)
        assert handle.asynchronous
        # Launched at once, before the copies have necessarily run: the side stream's
        # event orders these in-place writes after the copies on the GPU.
        for _ in range(3):
            _step(state)
        handle.result()
    fresh = _train_state(seed=1)
    _step(fresh)  # AdamW moments exist: restored in place on the device
    info = stepvault.restore(tmp_path, fresh, run="gpu")
    assert info.step == 2 and fresh["step"] == 2
    _assert_bitwise(fresh, snap)


def test_back_to_back_saves_reuse_the_pinned_buffers_without_mixing_steps(tmp_path):
    state = _train_state()
    snaps: dict[int, dict[str, torch.Tensor]] = {}
    with CheckpointManager(
        tmp_path,
        "gpu",
        async_save=True,
        lineage=False,
        options=ManagerOptions(staging=StagingOptions(memory="1GB")),
    ) as mgr:
        for _ in range(6):
            _step(state)
            snaps[state["step"]] = _snapshot(state)
            mgr.save(state["step"], state)  # no wait: the next step runs at once
        mgr.wait()
        assert mgr.stats()["failures"] == 0
    for step, snap in snaps.items():
        fresh = _train_state(seed=step + 10)
        _step(fresh)
        stepvault.restore(tmp_path, fresh, run="gpu", step=step)
        _assert_bitwise(fresh, snap)


def test_restore_into_a_fresh_cuda_optimizer_and_the_cuda_rng(tmp_path):
    state = {**_train_state(), "rng": stepvault.RNGState()}
    assert state["rng"].cuda
    for _ in range(2):
        _step(state)
    stepvault.save(tmp_path, state, run="r", step=2)  # synchronous: copies to host itself
    snap = _snapshot(state)
    expected = torch.randn(8, device="cuda")  # drawn right after the save
    fresh = {**_train_state(seed=5), "rng": stepvault.RNGState()}  # no moments yet
    torch.randn(100, device="cuda")  # move the CUDA generator on
    stepvault.restore(tmp_path, fresh, run="r")
    assert torch.equal(torch.randn(8, device="cuda"), expected)
    _assert_bitwise(fresh, snap)  # moments land on the parameters' device


def test_mem_tier_save_of_cuda_state_restores_bitwise(tmp_path):
    state = _train_state()
    _step(state)
    with CheckpointManager(
        tmp_path / "disk", "gpu", lineage=False, tiers={"mem": tmp_path / "shm"}
    ) as mgr:
        mgr.prepare(state, wait=True)
        _step(state)
        snap = _snapshot(state)
        handle = mgr.save(state["step"], state)
        _step(state)
        handle.result()
        fresh = _train_state(seed=3)
        _step(fresh)
        info = mgr.restore(fresh)
        assert info.tier == "mem"
    _assert_bitwise(fresh, snap)


def test_collective_async_save_of_cuda_state_on_two_ranks(tmp_path):
    """Under a process group the manager saves through DCP (pinned staging on CUDA)."""
    _spawn(2, "manager_cuda", tmp_path / "store", tmp_path / "out")
