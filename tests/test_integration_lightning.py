"""PyTorch Lightning integration, tested with a real Trainer on a tiny model (CPU)."""

from __future__ import annotations

import importlib
import pathlib
import signal
import sys
import warnings

import pytest

pl = pytest.importorskip("lightning.pytorch")
stateful = pytest.importorskip("torchdata.stateful_dataloader")

import torch  # noqa: E402
from helpers import final_digest, same_weights  # noqa: E402
from integration_util import (  # noqa: E402
    damage_newest,
    first_saves_asynchronous,
    kill_when_saved,
    run_example,
    run_example_here,
)
from torch.utils.data import TensorDataset  # noqa: E402

import stepvault  # noqa: E402
from stepvault import Every, KeepLast  # noqa: E402
from stepvault.integrations.lightning import StepvaultCheckpoint  # noqa: E402
from stepvault.ops.export import weight_tensors  # noqa: E402

#: one_thread (tests/conftest.py): tiny models are faster, and steadier, on one thread
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
    pytest.mark.usefixtures("one_thread"),
]


class Tiny(pl.LightningModule):
    def __init__(self, lr: float = 0.05, extra=None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.net(x) - y) ** 2).mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", ((self.net(x) - y) ** 2).mean())

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3)}


class StopAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            trainer.should_stop = True


def _loader():
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g))
    return stateful.StatefulDataLoader(ds, batch_size=4, shuffle=True)


def _fit(
    root,
    *,
    stop=None,
    resume=False,
    save=None,
    keep=None,
    model=None,
    max_steps=25,
    accumulate_grad_batches=1,
    **kw,
):
    pl.seed_everything(1, verbose=False)
    ckpt = StepvaultCheckpoint(
        root, run="r", save=save or Every(steps=7), keep=keep or KeepLast(2), **kw
    )
    trainer = pl.Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=accumulate_grad_batches,
        callbacks=[ckpt] + ([StopAt(stop)] if stop else []),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    model = model or Tiny()
    trainer.fit(model, _loader(), ckpt_path=ckpt.resume_path if resume else None)
    return model, ckpt


def test_stop_and_resume_mid_epoch_is_bitwise_equal(tmp_path):
    reference, _ = _fit(tmp_path / "ref")
    _, first = _fit(tmp_path / "s", stop=16)
    assert first.resume_path == "stepvault:latest"
    assert stepvault.open(tmp_path / "s").steps("r") == [7, 14]  # mid-epoch (10 batches/epoch)
    resumed, ckpt = _fit(tmp_path / "s", resume=True)
    assert ckpt.last_restore.step == 14 and not ckpt.last_restore.skipped
    assert same_weights(reference, resumed)
    # The staging was prepared at train start (and again after a fresh Adam's first step):
    # the first save of the fresh run (7) and of the resumed one (21) only copied.
    assert first_saves_asynchronous(tmp_path / "s", "r") == {7: True, 14: True, 21: True}
    # KeepLast(2) ran after every save; the metrics Lightning logged are in the manifest.
    vault = stepvault.open(tmp_path / "s")
    assert vault.steps("r") == [14, 21]
    summary = vault.checkpoints("r")[-1]
    assert "train_loss" in summary.metrics
    assert vault.checkpoint("r", 21).metadata["framework"] == "lightning"
    # The weights are the checkpoint's module: what `stepvault export` writes.
    exported = dict(weight_tensors(vault, "r", 21, None))
    assert sorted(exported) == sorted(resumed.state_dict())


def test_gradient_accumulation_saves_only_at_optimizer_steps(tmp_path):
    # A time policy that is due at every boundary: with two batches per optimizer step,
    # a save must never land between the two (the accumulated gradients are not saved).
    args = dict(save=Every(seconds=0.001), keep=KeepLast(3), accumulate_grad_batches=2)
    reference, _ = _fit(tmp_path / "ref", max_steps=12, **args)
    _, ckpt = _fit(tmp_path / "s", stop=7, max_steps=12, **args)
    assert stepvault.open(tmp_path / "s").steps("r") == [5, 6, 7]
    for step in (5, 6, 7):
        loops = ckpt.load(step)["loops"]["fit_loop"]
        assert loops["epoch_loop.batch_progress"]["total"]["processed"] == 2 * step
    resumed, ckpt = _fit(tmp_path / "s", resume=True, max_steps=12, **args)
    assert ckpt.last_restore.step == 7
    assert same_weights(reference, resumed)


def test_resume_skips_a_damaged_checkpoint(tmp_path):
    _fit(tmp_path, stop=14)
    assert damage_newest(tmp_path, "r") == 14
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, ckpt = _fit(tmp_path, resume=True)
    info = ckpt.last_restore
    assert info.step == 7 and [s.step for s in info.skipped] == [14]
    assert any("skipped damaged checkpoint r@14" in str(w.message) for w in caught)
    assert stepvault.open(tmp_path).steps("r")[-1] == 21  # training went on from step 7


def test_unencodable_hyperparameter_fails_with_its_key(tmp_path):
    with pytest.raises(stepvault.errors.UnsupportedTypeError, match=r"hyper_parameters.*'extra'"):
        _fit(tmp_path, model=Tiny(extra=pathlib.Path("/data")))
    assert stepvault.open(tmp_path).steps("r") == []  # nothing half-saved


def test_unencodable_hyperparameter_stored_as_repr_when_asked(tmp_path):
    with pytest.warns(RuntimeWarning, match="hyper_parameters\\['extra'\\]"):
        _fit(tmp_path, stop=7, model=Tiny(extra=pathlib.Path("/data")), unsupported_hparams="str")
    ckpt = StepvaultCheckpoint(tmp_path, run="r")
    loaded = ckpt.load("latest")  # read-only: no Trainer, no lease
    assert loaded["hyper_parameters"]["extra"] == repr(pathlib.Path("/data"))
    assert loaded["global_step"] == 7 and "net.0.weight" in loaded["state_dict"]


def test_weights_only_policy_and_ckpt_path_best(tmp_path):
    from stepvault import KeepBest

    save = Every(steps=5, what="weights") | Every(steps=10)
    keep = KeepBest(1, metric="train_loss") | KeepLast(10)
    _fit(tmp_path, save=save, keep=keep)
    summaries = stepvault.open(tmp_path).checkpoints("r")
    assert {c.step: c.kind for c in summaries} == {
        5: "weights",
        10: "full",
        15: "weights",
        20: "full",
        25: "weights",
    }
    best = min(summaries, key=lambda c: (c.metrics["train_loss"], -c.step)).step
    # ckpt_path="best" is Lightning's own special value; it resolves through the callback
    # (read-only: validate takes no lease and writes nothing).
    ckpt = StepvaultCheckpoint(tmp_path, run="r", keep=KeepBest(1, metric="train_loss"))
    assert ckpt.best_model_path == "stepvault:best"
    trainer = pl.Trainer(
        callbacks=[ckpt], logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    model = Tiny()
    trainer.validate(model, _loader(), ckpt_path="best", verbose=False)
    assert ckpt.last_restore.step == best
    stored = stepvault.open(tmp_path).checkpoint("r", best).tensor("model/net.0.weight")
    assert torch.equal(model.net[0].weight, stored)
    assert stepvault.open(tmp_path).steps("r") == [5, 10, 15, 20, 25]


def test_import_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.setitem(sys.modules, "pytorch_lightning", None)
    monkeypatch.delitem(sys.modules, "stepvault.integrations.lightning")
    with pytest.raises(ImportError, match=r'pip install "stepvault\[lightning\]"'):
        importlib.import_module("stepvault.integrations.lightning")


@pytest.mark.slow
def test_example_preempted_then_killed_resumes_to_the_same_weights(tmp_path):
    args = ["--run", "lit", "--max-steps", "60", "--save-every", "10"]
    here = run_example_here("lightning_train.py", "--root", str(tmp_path / "a"), *args)
    reference = final_digest(here)
    root = tmp_path / "b"
    run = ["lightning_train.py", root, "lit", "--root", str(root), *args]
    # SIGTERM (a preemption notice): OnSignal saves at the next step boundary, exits 143.
    steps = kill_when_saved(
        *run, "--step-sleep", "0.1", min_step=10, sig=signal.SIGTERM, exit_code=143
    )
    assert steps[-1] % 10 != 0  # the extra checkpoint taken at the signal
    # SIGKILL (a crash) of the resumed run, later on.
    steps = kill_when_saved(*run, "--step-sleep", "0.05", min_step=steps[-1] + 10)
    assert steps[-1] < 60
    out = run_example("lightning_train.py", "--root", str(root), *args)
    assert f"RESUMED {steps[-1]}" in out
    assert final_digest(out) == reference
    assert stepvault.ops.verify(root, deep=True).ok


def test_standalone_pytorch_lightning_package(tmp_path):
    ptl = pytest.importorskip("pytorch_lightning")
    from stepvault.integrations.pytorch_lightning import StepvaultCheckpoint as PTLCheckpoint

    class TinyPTL(ptl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self.net(x) - y) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(resume: bool):
        ckpt = PTLCheckpoint(tmp_path, run="ptl", save=Every(steps=5))
        trainer = ptl.Trainer(
            max_steps=10,
            callbacks=[ckpt],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(TinyPTL(), _loader(), ckpt_path=ckpt.resume_path if resume else None)
        return ckpt, trainer

    fit(resume=False)
    assert stepvault.open(tmp_path).steps("ptl") == [5, 10]
    ckpt, trainer = fit(resume=True)  # resumed at max_steps: nothing left to train
    assert ckpt.last_restore.step == 10 and trainer.global_step == 10


@pytest.mark.parametrize("every", [5, 10])
def test_a_validation_at_a_saved_step_annotates_that_checkpoint(tmp_path, every):
    """A save happens at the end of its step, before Lightning's validation at that step,
    so the checkpoint recorded the previous validation's val_loss (other weights) and
    KeepBest ranked by it. The validation right after the save now annotates it: the
    metric a listing and KeepBest see is the one measured on that checkpoint's weights,
    and a checkpoint no validation measured has none (it carried the last one's)."""
    pl.seed_everything(1, verbose=False)
    ckpt = StepvaultCheckpoint(tmp_path, run="r", save=Every(steps=5), keep=KeepLast(10))
    trainer = pl.Trainer(
        max_steps=15,
        val_check_interval=every,
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    trainer.fit(Tiny(), _loader(), _loader())
    listed = {c.step: c.metrics.get("val_loss") for c in stepvault.open(tmp_path).checkpoints("r")}
    assert sorted(listed) == [5, 10, 15]
    measured_at = [5, 10, 15] if every == 5 else [10]
    assert [s for s, v in listed.items() if v is not None] == measured_at, listed
    for step in measured_at:
        val_loss = listed[step]
        check = StepvaultCheckpoint(tmp_path, run="r")
        quiet = pl.Trainer(
            callbacks=[check], logger=False, enable_progress_bar=False, enable_model_summary=False
        )
        measured = quiet.validate(Tiny(), _loader(), ckpt_path=f"stepvault:{step}", verbose=False)
        assert measured[0]["val_loss"] == pytest.approx(val_loss, rel=1e-6), step
