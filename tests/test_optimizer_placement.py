"""A restore into an optimizer that has state places the moments into its live tensors
(state/placement.py, issue 31): no fresh allocation (page faults, the kernel zeroing each
new page) where the memory is already there, as for a module's parameters. They are
placed only after the whole checkpoint verified: damage found late changes none of them.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import flip_byte, object_path

import stepvault


def _job(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 256, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _moments(opt: torch.optim.Optimizer) -> dict:
    return {(i, k): v for i, st in opt.state_dict()["state"].items() for k, v in st.items()}


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    return copy.deepcopy(model.state_dict()), {key: v.clone() for key, v in _moments(opt).items()}


def _same(a: tuple[dict, dict], b: tuple[dict, dict]) -> bool:
    return all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def _two_steps(root) -> tuple[tuple[dict, dict], tuple[dict, dict]]:
    model, opt = _job()
    _train(model, opt, 2, seed=1)
    stepvault.save(root, {"model": model, "optimizer": opt}, run="r", step=1)
    one = _snapshot(model, opt)
    _train(model, opt, 3, seed=2)
    stepvault.save(root, {"model": model, "optimizer": opt}, run="r", step=2)
    return one, _snapshot(model, opt)


def test_a_rollback_places_the_moments_into_the_live_optimizer(tmp_path):
    one, _ = _two_steps(tmp_path)
    # The job goes on in this process, then rolls back to step 1.
    model, opt = _job(seed=5)
    _train(model, opt, 2, seed=3)
    live = {key: t for key, t in _moments(opt).items()}
    stepvault.restore(tmp_path, {"model": model, "optimizer": opt}, run="r", step=1)
    assert _same(_snapshot(model, opt), one)  # bitwise
    after = _moments(opt)
    assert after.keys() == live.keys()
    for key, t in live.items():  # the same tensors, filled in place
        assert after[key] is t, key
    # and training goes on from there exactly as the uninterrupted job would
    ref_model, ref_opt = _job()
    _train(ref_model, ref_opt, 2, seed=1)
    _train(ref_model, ref_opt, 1, seed=9)
    _train(model, opt, 1, seed=9)
    assert _same(_snapshot(model, opt), _snapshot(ref_model, ref_opt))


def test_an_optimizer_without_state_gets_fresh_moments(tmp_path):
    _, two = _two_steps(tmp_path)
    model, opt = _job(seed=5)  # a new process: no step taken, no moments yet
    stepvault.restore(tmp_path, {"model": model, "optimizer": opt}, run="r")
    assert _same(_snapshot(model, opt), two)


@pytest.mark.parametrize("victim", ["first", "last"])
def test_damage_found_late_changes_no_live_moment(tmp_path, victim):
    one, _ = _two_steps(tmp_path)
    vault = stepvault.open(tmp_path)
    manifest = vault.manifest("r", 2)
    only2 = set(manifest.objects) - set(vault.manifest("r", 1).objects)
    order = [
        d
        for d in dict.fromkeys(d for t in manifest.tensors.values() for d, _, _ in t.chunks)
        if d in only2
    ]
    flip_byte(object_path(tmp_path, order[0 if victim == "first" else -1]))

    model, opt = _job(seed=5)
    _train(model, opt, 2, seed=3)
    before = _snapshot(model, opt)
    with pytest.raises(stepvault.errors.IntegrityError):  # an explicit step: no fallback
        stepvault.restore(tmp_path, {"model": model, "optimizer": opt}, run="r", step=2)
    assert _same(_snapshot(model, opt), before)  # not one parameter, not one moment

    info = stepvault.restore(tmp_path, {"model": model, "optimizer": opt}, run="r")
    assert info.step == 1 and [s.step for s in info.skipped] == [2]
    assert _same(_snapshot(model, opt), one)
