"""A tiny but complete training setup shared by tests: dropout, AdamW, a scheduler and a
shuffled DataLoader whose position is part of the checkpoint."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import stepvault


def make_model(width: int = 64, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 4),
    )


class Trainer:
    """Everything a run needs; ``state`` is what gets checkpointed."""

    def __init__(self, seed: int = 0, width: int = 64) -> None:
        self.model = make_model(width, seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=5, gamma=0.5)
        g = torch.Generator().manual_seed(1234)
        data = TensorDataset(
            torch.randn(96, 16, generator=g), torch.randint(0, 4, (96,), generator=g)
        )
        self.gen = torch.Generator().manual_seed(seed)
        self.loader = DataLoader(data, batch_size=8, shuffle=True, generator=self.gen)
        self.steps_per_epoch = len(self.loader)
        # Data position: the shuffle generator's state at the start of the current epoch and
        # the number of batches consumed in it.
        self.data = {"epoch": 0, "batch": 0, "epoch_gen_state": self.gen.get_state()}
        self.rng = stepvault.RNGState()
        self.step = 0

    @property
    def state(self) -> dict:
        return {
            "model": self.model,
            "optimizer": self.opt,
            "scheduler": self.sched,
            "rng": self.rng,
            "data": self.data,
            "step": self.step,
        }

    def load_from(self, state: dict) -> None:
        """After a restore, pick the plain values back up."""
        self.data = state["data"]
        self.step = state["step"]

    def train(self, until: int, on_step=None) -> None:
        self.model.train()
        while self.step < until:
            self.gen.set_state(self.data["epoch_gen_state"])
            it = iter(self.loader)
            for _ in range(self.data["batch"]):
                next(it)
            for x, y in it:
                loss = torch.nn.functional.cross_entropy(self.model(x), y)
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
                self.sched.step()
                self.step += 1
                self.data["batch"] += 1
                if on_step is not None:
                    on_step(self, loss.item())
                if self.step >= until:
                    break
            if self.data["batch"] >= self.steps_per_epoch:
                self.data = {
                    "epoch": self.data["epoch"] + 1,
                    "batch": 0,
                    "epoch_gen_state": self.gen.get_state(),
                }


def assert_same_training_state(a: Trainer, b: Trainer) -> None:
    for (na, pa), (nb, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert na == nb
        assert torch.equal(pa, pb), f"parameter {na} differs"
    sa, sb = a.opt.state_dict(), b.opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for idx in sa["state"]:
        for key, va in sa["state"][idx].items():
            vb = sb["state"][idx][key]
            assert torch.equal(va, vb), f"optimizer state {idx}/{key} differs"
    assert a.sched.state_dict() == b.sched.state_dict()
