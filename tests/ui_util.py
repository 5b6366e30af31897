"""A store made by a real short training run, for the dashboard's tests (and its README
screenshot): CheckpointManager saves with metrics, retention deletes some, an evaluation job
annotates one, one is pinned, the registry promotes and rolls back, and a second run has a
damaged manifest."""

from __future__ import annotations

import dataclasses
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


def make_long_run(root: Path, run: str, count: int, *, keep_every: int = 1) -> list[int]:
    """A run of ``count`` saves (steps 1..count) written quickly: the first checkpoint is a
    real ``stepvault.save``; the others are its manifest with its own step, time and
    metrics, committed through the store with the commit epilogue's summary row and object
    list (so listings read them as a writer's), and a ``save`` event each with its metrics,
    as a manager writes it. Only every ``keep_every``-th checkpoint is left (the others
    were "deleted by retention": a ``delete`` event each). Returns the steps kept."""
    import json as _json
    import time as _time

    import torch

    from stepvault.catalog.commit import after_commit
    from stepvault.format import parse_manifest
    from stepvault.format.manifest import serialize_manifest

    stepvault.save(root, {"w": torch.ones(64)}, run=run, step=1, metrics={"loss": 1.0})
    store = Store.open(root)
    first = parse_manifest(store.read_manifest(run, 1), f"{run}@1")
    t0 = _time.time() - count
    events = []
    kept = []
    for step in range(1, count + 1):
        metrics = {"loss": 1.0 / step, "lr": 1e-3 * (0.5 if step > count // 2 else 1.0)}
        keep = step % keep_every == 0 or step == count
        if step > 1 and keep:
            m = dataclasses.replace(
                first,
                step=step,
                created=t0 + step,
                metrics=metrics,
                parent_step=kept[-1] if kept else None,
            )
            data = serialize_manifest(m)
            store.backend.put_atomic(store.manifest_key(run, step), [data], durable=False)
            after_commit(store, m, data)
        base = {"run": run, "user": "test", "host": "bench", "pid": 1, "step": step}
        events.append(
            {
                "time": t0 + step,
                "event": "save",
                **base,
                "kind": "full",
                "metrics": metrics,
                "logical_bytes": 256,
                "stored_bytes": 300,
                "new_bytes": 300,
                "stall_seconds": 0.001,
                "write_seconds": 0.004,
                "keep": None,
                "best": [],
            }
        )
        if keep:
            kept.append(step)
        else:
            if step == 1:
                store.delete_manifest(run, 1)
            events.append({"time": t0 + step + 0.5, "event": "delete", **base, "reasons": ["test"]})
    lines = "".join(_json.dumps(e, separators=(",", ":")) + "\n" for e in events)
    store.backend.append(f"events/{run}.jsonl", lines.encode())
    return kept
