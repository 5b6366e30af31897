"""A store made by a real short training run, for the dashboard's tests (and its README
screenshot): CheckpointManager saves with metrics, retention deletes some, an evaluation job
annotates one, one is pinned, the registry promotes and rolls back, and a second run has a
damaged manifest."""

from __future__ import annotations

import math
from pathlib import Path

from training import Trainer

import stepvault
from stepvault import CheckpointManager, Every, KeepBest, KeepLast
from stepvault.registry import Registry
from stepvault.store import Store

RUN = "mlp-train"
BROKEN = "broken-run"
STEPS, EVERY = 32, 4


def make_trained_store(root: Path, *, steps: int = STEPS, every: int = EVERY) -> Path:
    """Train ``steps`` steps with a checkpoint every ``every``; return the store root."""
    trainer = Trainer(seed=0)
    mgr = CheckpointManager(
        root,
        run=RUN,
        save=Every(steps=every),
        keep=KeepLast(4) | KeepBest(2, metric="val_loss", mode="min"),
        async_save=False,
    )

    def on_step(t: Trainer, loss: float) -> None:
        val = loss * 1.1 + 0.3 * math.cos(t.step / 5)  # a noisy validation curve
        mgr.save(
            t.step, t.state, metrics={"loss": loss, "val_loss": val, "lr": t.sched.get_last_lr()[0]}
        )

    trainer.train(steps, on_step=on_step)
    mgr.pin(mgr.checkpoints()[-3].step, note="paper figure")
    mgr.close()
    store = Store.open(root)
    steps_left = store.list_steps(RUN)
    stepvault.ops.annotate(root, RUN, steps_left[-2], {"val_accuracy": 0.71}, note="eval job")
    reg = Registry(root)
    reg.promote("mlp", f"{RUN}@{steps_left[-4]}", alias="candidate")
    reg.promote("mlp", "v1", alias="stable", note="passed eval")
    reg.promote("mlp", f"{RUN}@{steps_left[-1]}", alias="stable")
    reg.rollback("mlp", "stable", note="regression on eval set")
    # A second run whose newest manifest is damaged (one flipped byte).
    for step in (10, 20):
        stepvault.save(
            root, {"w": trainer.model[0].weight}, run=BROKEN, step=step, metrics={"loss": 1 / step}
        )
    manifest = root / "runs" / BROKEN / "checkpoints" / "20.json"
    data = bytearray(manifest.read_bytes())
    data[-5] ^= 0x01
    manifest.write_bytes(bytes(data))
    return root


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root`` with its size and mtime (ns): a change detector."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_size if p.is_file() else 0, st.st_mtime_ns)
    return out
