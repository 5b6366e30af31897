"""Adopting Lightning checkpoints (issue 28): a ``last.ckpt`` written by the real
``ModelCheckpoint`` is imported with the real CLI, then training continues through
``StepvaultCheckpoint`` (``fit(ckpt_path=cb.resume_path)``) and through a plain loop
(``stepvault.restore`` into a model and an optimizer), compared bitwise with Lightning's
own resume from the same ``last.ckpt``."""

from __future__ import annotations

import warnings

import pytest

pl = pytest.importorskip("lightning.pytorch")

import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import stepvault  # noqa: E402
from stepvault.cli.main import app  # noqa: E402
from stepvault.errors import ResumeGapWarning  # noqa: E402
from stepvault.integrations.lightning import StepvaultCheckpoint  # noqa: E402

#: one_thread (tests/conftest.py): tiny models are faster, and steadier, on one thread
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
    pytest.mark.usefixtures("one_thread"),
]

#: steps in the first run (mid-epoch: 5 batches an epoch) and in the continued one
FIRST, TOTAL = 7, 13


class Tiny(pl.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3)}


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(20, 4, generator=g), torch.randn(20, 1, generator=g))
    return DataLoader(ds, batch_size=4)


def _module() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def _trainer(root, max_steps: int, callbacks: list, **kw) -> pl.Trainer:
    return pl.Trainer(
        max_steps=max_steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=root,
        num_sanity_val_steps=0,
        **kw,
    )


def _last_ckpt(tmp_path, *, weights_only: bool = False):
    """Train FIRST steps with the real ModelCheckpoint; its last.ckpt."""
    dirpath = tmp_path / "checkpoints"
    mc = pl.callbacks.ModelCheckpoint(
        dirpath=dirpath, save_last=True, every_n_train_steps=1, save_weights_only=weights_only
    )
    _trainer(tmp_path, FIRST, [mc]).fit(_module(), _data())
    last = dirpath / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == FIRST
    return last


def _import(root, ckpt) -> str:
    result = CliRunner().invoke(app, ["--root", str(root), "import", str(ckpt), "--run", "lit"])
    assert result.exit_code == 0, result.output
    return result.output


def _lightning_resume(tmp_path, ckpt) -> pl.Trainer:
    """Lightning's own resume from the .ckpt file, to TOTAL steps."""
    trainer = _trainer(tmp_path / "own", TOTAL, [], enable_checkpointing=False)
    trainer.fit(_module(), _data(), ckpt_path=str(ckpt))
    return trainer


def _same_state(a, b, path="") -> None:
    """Bitwise equal nested state (tensors by value and dtype, everything else by ==)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, list(a), list(b))
        for k in a:
            _same_state(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same_state(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def test_lightning_import_continues_with_stepvault_checkpoint_like_lightning_resume(tmp_path):
    last = _last_ckpt(tmp_path)
    root = tmp_path / "store"
    out = _import(root, last)
    assert f"lit@{FIRST}" in out and "missing" not in out

    cb = StepvaultCheckpoint(root, run="lit")
    assert cb.resume_path == "stepvault:latest"
    ours = _trainer(tmp_path / "ours", TOTAL, [cb])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a complete import: no warning
        ours.fit(_module(), _data(), ckpt_path=cb.resume_path)
    assert cb.last_restore is not None and cb.last_restore.step == FIRST
    assert ours.global_step == TOTAL and ours.current_epoch > FIRST // 5  # crossed an epoch

    theirs = _lightning_resume(tmp_path, last)
    assert theirs.global_step == TOTAL
    _same_state(theirs.lightning_module.state_dict(), ours.lightning_module.state_dict())
    _same_state(theirs.optimizers[0].state_dict(), ours.optimizers[0].state_dict())
    _same_state(
        theirs.lr_scheduler_configs[0].scheduler.state_dict(),
        ours.lr_scheduler_configs[0].scheduler.state_dict(),
    )
    # The continued run saved into the imported run, and resumes from its own checkpoint.
    assert stepvault.open(root).checkpoint("lit@latest").step > FIRST


def test_lightning_import_restores_into_a_plain_loop(tmp_path):
    last = _last_ckpt(tmp_path)
    root = tmp_path / "store"
    _import(root, last)

    def continued(load) -> Tiny:
        module = _module()
        opt = torch.optim.Adam(module.parameters(), lr=0.05)
        load(module, opt)
        for x, y in list(_data())[:3]:
            opt.zero_grad()
            module.training_step((x, y), 0).backward()
            opt.step()
        return module, opt

    def from_store(module, opt):
        info = stepvault.restore(root, {"model": module, "optimizer": opt}, run="lit", strict=False)
        assert info.step == FIRST

    def from_file(module, opt):  # what a user of the .ckpt does by hand
        ckpt = torch.load(last, weights_only=True)
        module.load_state_dict(ckpt["state_dict"])
        opt.load_state_dict(ckpt["optimizer_states"][0])

    (m1, o1), (m2, o2) = continued(from_store), continued(from_file)
    _same_state(m2.state_dict(), m1.state_dict())
    _same_state(o2.state_dict(), o1.state_dict())


def test_weights_only_lightning_import_says_what_it_lacks_and_resume_warns(tmp_path):
    last = _last_ckpt(tmp_path, weights_only=True)
    root = tmp_path / "store"
    out = _import(root, last)
    assert "missing optimizer" in out and "missing scheduler" in out
    missing = stepvault.open(root).checkpoint(f"lit@{FIRST}").metadata["missing"]
    assert set(missing) == {"optimizer", "scheduler"}

    cb = StepvaultCheckpoint(root, run="lit")
    trainer = _trainer(tmp_path / "ours", TOTAL, [cb])
    with pytest.warns(ResumeGapWarning, match=r"holds no optimizer .*scheduler .*fresh"):
        trainer.fit(_module(), _data(), ckpt_path=cb.resume_path)
    # The weights and the loops came back; the optimizer started fresh (with a warning).
    assert cb.last_restore is not None and cb.last_restore.step == FIRST
    assert trainer.global_step == TOTAL
