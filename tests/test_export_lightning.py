"""Lightning export (issue 19): a LightningModule's checkpoint becomes a folder of weights
and hparams that plain code reloads (no load_from_checkpoint, no pickle)."""

from __future__ import annotations

import json

import pytest

pl = pytest.importorskip("lightning.pytorch")

import torch  # noqa: E402
import yaml  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from stepvault import Every  # noqa: E402
from stepvault.cli.main import app  # noqa: E402
from stepvault.integrations.lightning import StepvaultCheckpoint  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


class Regressor(pl.LightningModule):
    def __init__(self, hidden: int = 8, lr: float = 0.05, activation: str = "tanh") -> None:
        super().__init__()
        self.save_hyperparameters()
        act = {"tanh": torch.nn.Tanh, "relu": torch.nn.ReLU}[activation]
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, hidden), act(), torch.nn.Linear(hidden, 1)
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self(x) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def test_lightning_export_reloads_with_plain_code(tmp_path):
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    root = tmp_path / "store"
    ckpt = StepvaultCheckpoint(root, run="reg", save=Every(steps=4), async_save=False)
    trainer = pl.Trainer(
        max_steps=4,
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regressor(hidden=6, activation="relu")
    trainer.fit(model, DataLoader(data, batch_size=4))
    out = tmp_path / "exported"
    res = CliRunner().invoke(app, ["--root", str(root), "export", "reg@4", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert (out / "README.md").exists() and (out / "stepvault-export.json").exists()

    # The plain code of INTEGRATIONS.md: hparams + safetensors, the class's own constructor.
    hparams = json.loads((out / "hparams.json").read_text())
    assert hparams == {"hidden": 6, "lr": 0.05, "activation": "relu"}
    assert yaml.safe_load((out / "hparams.yaml").read_text()) == hparams
    reloaded = Regressor(**hparams)
    reloaded.load_state_dict(load_file(out / "model.safetensors"))
    x = torch.randn(3, 4)
    model.eval()
    reloaded.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(x), model(x))
