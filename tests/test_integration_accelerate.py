"""Accelerate integration, tested with a real Accelerator on CPU."""

from __future__ import annotations

import importlib
import sys

import pytest

accelerate = pytest.importorskip("accelerate")
pytest.importorskip("torchdata.stateful_dataloader")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DataLoaderConfiguration  # noqa: E402
from helpers import final_digest, same_weights  # noqa: E402
from integration_util import (  # noqa: E402
    damage_newest,
    first_saves_asynchronous,
    kill_when_saved,
    run_example,
    run_example_here,
)

import stepvault  # noqa: E402
from stepvault import Every, KeepLast  # noqa: E402
from stepvault.integrations.accelerate import (  # noqa: E402
    AcceleratorCheckpointer,
    load_state,
    save_state,
)

#: one_thread (tests/conftest.py): tiny models are faster, and steadier, on one thread
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.usefixtures("one_thread"),
]


def _setup():
    torch.manual_seed(0)
    acc = Accelerator(
        cpu=True,
        gradient_accumulation_steps=2,
        # The stateful loader saves its position; the seedable sampler makes an epoch's
        # shuffle a function of (seed, epoch), so the resumed epoch has the same order.
        dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=True, use_seedable_sampler=True
        ),
    )
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(
        torch.randn(48, 4, generator=g), torch.randn(48, 1, generator=g)
    )
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1)
    )
    return (acc, *acc.prepare(model, opt, sched, loader))


def _train(root, *, stop=None, total=20):
    acc, model, opt, sched, loader = _setup()
    progress = {"epoch": 0, "step": 0}
    ckpt = AcceleratorCheckpointer(
        acc, root, run="r", save=Every(steps=4), keep=KeepLast(2), extra=progress
    )
    info = ckpt.restore()
    while progress["step"] < total:
        loader.set_epoch(progress["epoch"])
        for x, y in loader:
            with acc.accumulate(model):
                loss = ((model(x) - y) ** 2).mean()
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            if acc.sync_gradients:
                progress["step"] += 1
                ckpt.save(progress["step"], metrics={"loss": loss})
                if progress["step"] in (stop, total):
                    break
        else:
            progress["epoch"] += 1
        if progress["step"] == stop:
            break
    ckpt.close()
    return model, info, progress


def test_checkpointer_stop_and_resume_is_bitwise_equal(tmp_path):
    reference, _, _ = _train(tmp_path / "ref")
    _, _, progress = _train(tmp_path / "s", stop=9)
    assert progress == {"epoch": 1, "step": 9}
    assert stepvault.open(tmp_path / "s").steps("r") == [4, 8]
    resumed, info, progress = _train(tmp_path / "s")
    assert info.step == 8
    assert same_weights(reference, resumed)
    assert progress["step"] == 20
    assert stepvault.open(tmp_path / "s").steps("r") == [16, 20]
    assert "loss" in stepvault.open(tmp_path / "s").checkpoints("r")[-1].metrics
    # The staging was prepared at restore() and again after a fresh AdamW's first step:
    # the first save of the fresh run (4) and of the resumed one (12) only copied.
    saves = first_saves_asynchronous(tmp_path / "s", "r")
    assert saves == {4: True, 8: True, 12: True, 16: True, 20: True}


def test_save_state_load_state_round_trip_and_fallback(tmp_path):
    acc, model, opt, sched, loader = _setup()
    x, y = next(iter(loader))
    for step in (1, 2):
        with acc.accumulate(model):
            acc.backward(((model(x) - y) ** 2).mean())
            opt.step()
            sched.step()
            opt.zero_grad()
        save_state(acc, tmp_path, run="r", step=step, extra={"epoch": step * 10})
    names = set(stepvault.open(tmp_path).checkpoint("r", 2).manifest.state_kinds)
    assert {"model", "optimizer", "scheduler", "dataloader", "rng", "accelerate_step"} <= names
    saved = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    saved_step = acc.step

    acc2, model2, opt2, sched2, _ = _setup()
    extra = {"epoch": 0}
    info = load_state(acc2, tmp_path, run="r", extra=extra)
    assert info.step == 2 and extra == {"epoch": 20} and acc2.step == saved_step
    assert all(torch.equal(v, saved[k]) for k, v in acc2.unwrap_model(model2).state_dict().items())
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert sched2.state_dict() == sched.state_dict()

    damage_newest(tmp_path, "r")
    acc3, *_ = _setup()
    extra = {"epoch": 0}
    info = load_state(acc3, tmp_path, run="r", extra=extra)
    assert info.step == 1 and [s.step for s in info.skipped] == [2] and extra == {"epoch": 10}


def test_import_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)
    monkeypatch.delitem(sys.modules, "stepvault.integrations.accelerate")
    with pytest.raises(ImportError, match=r'pip install "stepvault\[accelerate\]"'):
        importlib.import_module("stepvault.integrations.accelerate")


@pytest.mark.slow
def test_example_killed_with_sigkill_resumes_to_the_same_weights(tmp_path):
    args = ["--run", "acc", "--steps", "60", "--save-every", "10"]
    here = run_example_here("accelerate_train.py", "--root", str(tmp_path / "a"), *args)
    reference = final_digest(here)
    root = tmp_path / "b"
    steps = kill_when_saved(
        "accelerate_train.py",
        root,
        "acc",
        "--root",
        str(root),
        *args,
        "--step-sleep",
        "0.05",
        min_step=30,
    )
    assert steps and steps[-1] < 60
    out = run_example("accelerate_train.py", "--root", str(root), *args)
    assert f"RESUMED {steps[-1]}" in out
    assert final_digest(out) == reference
    assert stepvault.ops.verify(root, deep=True).ok


def test_importing_stepvault_imports_no_trainer_framework():
    import subprocess

    code = (
        "import sys, stepvault, stepvault.integrations\n"
        "loaded = [m for m in ('lightning', 'pytorch_lightning', 'transformers', 'accelerate')"
        " if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("restore_first", [True, False])
def test_first_due_save_of_a_fresh_run_is_asynchronous(tmp_path, restore_first):
    """AdamW's moments (2x the weights, more than the manager's reserve) appear at its
    first step: the checkpointer prepares again at the next boundary that saves nothing,
    so the first due save only copies into ready buffers (also without a restore())."""
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(512, 512)  # 1 MiB of weights, 2 MiB of AdamW moments
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    ckpt = AcceleratorCheckpointer(acc, tmp_path, run="r", save=Every(steps=3), lineage=False)
    if restore_first:
        assert ckpt.restore() is None  # a fresh start: prepared without the moments
    handles = []
    for step in range(1, 4):
        acc.backward(model(torch.randn(2, 512)).square().mean())
        opt.step()
        opt.zero_grad()
        handles.append(ckpt.save(step))
    assert handles[:2] == [None, None] and handles[2].asynchronous
    assert handles[2].result().step == 3
    ckpt.close()
    assert first_saves_asynchronous(tmp_path, "r") == {3: True}
