#!/usr/bin/env python
"""Sharded jobs through the frameworks (issue 30): a 2-rank Lightning
``ModelParallelStrategy`` job (FSDP2, gloo on CPU) saving through ``StepvaultCheckpoint``
against the same job saving with Lightning's own sharded checkpointing
(``ModelCheckpoint``: a DCP folder per save). Measured in one run: the stall of a save
step (its step time minus the median step time of steps that save nothing, on rank 0),
the wall time of the job, and the bytes stored after every save of a fine-tune whose
first half of the layers is frozen (stepvault stores an unchanged chunk once).

Rewrites the section between ``<!-- frameworks:begin -->`` and ``<!-- frameworks:end -->``
of BENCHMARKS.md::

    python benchmarks/bench_frameworks.py [--width 1024] [--layers 6] [--saves 10]

The job is this script run with ``--worker`` (Lightning's launcher starts rank 1 by
running the same command line again).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

SECTION = "frameworks"


def worker(args: argparse.Namespace) -> None:
    """One 2-rank Lightning job (both ranks run this); rank 0 writes its timings."""
    from datetime import timedelta

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from stepvault import Every, KeepLast

    torch.set_num_threads(1)

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(
                *[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
            )
            if args.frozen:  # a fine-tune: the first half of the layers does not train
                for layer in list(self.layers)[: args.layers // 2]:
                    layer.requires_grad_(False)

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            dp = self.device_mesh["data_parallel"]
            for layer in self.layers:
                fully_shard(layer, mesh=dp)
            fully_shard(self.layers, mesh=dp)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.layers(x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *a: Any) -> None:
            self.starts.append(time.perf_counter())

    steps = args.saves * args.every
    clock = Clock()
    callbacks: list[pl.Callback] = [clock]
    if args.mode == "stepvault":
        from stepvault.integrations.lightning import StepvaultCheckpoint

        callbacks.append(
            StepvaultCheckpoint(
                args.root, run="bench", save=Every(steps=args.every), keep=KeepLast(1000)
            )
        )
    else:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=args.root, every_n_train_steps=args.every, save_top_k=-1
            )
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, timeout=timedelta(seconds=300)
        ),
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = TensorDataset(torch.randn(16 * (steps + 1), args.width))
    # The stall: what the training thread spends in trainer.save_checkpoint (both
    # StepvaultCheckpoint and ModelCheckpoint save through it), on every save.
    stalls: list[float] = []
    own_save = trainer.save_checkpoint

    def timed_save(*a: Any, **k: Any) -> None:
        t = time.perf_counter()
        own_save(*a, **k)
        stalls.append(time.perf_counter() - t)

    trainer.save_checkpoint = timed_save  # type: ignore[method-assign]
    t0 = time.perf_counter()
    trainer.fit(Net(), DataLoader(data, batch_size=16))
    wall = time.perf_counter() - t0
    if trainer.is_global_zero:
        ends = [*clock.starts[1:], None]
        intervals = [b - a for a, b in zip(clock.starts, ends, strict=True) if b is not None]
        # step i (1-based) ends with global_step == i; a save runs at its end when i % every == 0
        saving = [d for i, d in enumerate(intervals, 1) if i % args.every == 0]
        plain = [d for i, d in enumerate(intervals, 1) if i % args.every != 0 and i > 1]
        Path(args.result).write_text(
            json.dumps({"saving": saving, "plain": plain, "wall": wall, "stalls": stalls})
        )


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_job(mode: str, root: Path, args: argparse.Namespace, frozen: bool) -> dict[str, Any]:
    result = root.parent / f"{root.name}.json"
    cmd = [
        sys.executable, __file__, "--worker", "--mode", mode, "--root", str(root),
        "--result", str(result), "--width", str(args.width), "--layers", str(args.layers),
        "--saves", str(args.saves), "--every", str(args.every),
    ]  # fmt: skip
    if frozen:
        cmd.append("--frozen")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, timeout=900)
    out = json.loads(result.read_text())
    out["bytes"] = du(root)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["stepvault", "lightning"], default="stepvault")
    ap.add_argument("--root", default="")
    ap.add_argument("--result", default="")
    ap.add_argument("--frozen", action="store_true")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    import _common
    from _common import REPO, machine_facts, table

    out_md = args.out or REPO / "BENCHMARKS.md"
    t_all = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-frameworks-", dir=args.workdir))
    results: dict[tuple[str, bool], dict[str, Any]] = {}
    try:
        # The two modes alternate, so that both see the same drift of a shared machine.
        for frozen in (False, True):
            for mode in ("lightning", "stepvault"):
                root = work / f"{mode}-{'frozen' if frozen else 'full'}"
                results[mode, frozen] = run_job(mode, root, args, frozen)
                print(mode, frozen, results[mode, frozen], flush=True)
        facts = machine_facts(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    params = args.layers * (args.width * args.width + args.width)
    state_mb = params * 4 * 3 / 1e6  # weights + AdamW's two moments, float32

    def stall(r: dict[str, Any]) -> float:
        return statistics.median(r["stalls"])

    rows = []
    for frozen in (False, True):
        for mode in ("lightning", "stepvault"):
            r = results[mode, frozen]
            rows.append([
                "fine-tune, half frozen" if frozen else "all layers train",
                "Lightning sharded (DCP folders)" if mode == "lightning" else "stepvault (async)",
                f"{stall(r) * 1000:.0f} ms",
                f"{max(r['stalls']) * 1000:.0f} ms",
                f"{statistics.median(r['plain']) * 1000:.0f} ms",
                f"{r['wall']:.1f} s",
                f"{r['bytes'] / 1e6:.1f} MB",
            ])  # fmt: skip
    lf, sf = results["lightning", True], results["stepvault", True]
    lines = _common.section_head(
        "Sharded jobs through the frameworks (issue 30)",
        "python benchmarks/bench_frameworks.py",
        time.perf_counter() - t_all,
        facts,
    )
    lines += [
        "### Results",
        "",
        f"A 2-rank Lightning `ModelParallelStrategy` job (FSDP2 over gloo, CPU): {args.layers} "
        f"linear layers of {args.width}x{args.width} ({params / 1e6:.1f} M parameters, "
        f"{state_mb:.0f} MB with AdamW's moments when every layer trains), "
        f"{args.saves} saves, one every {args.every} steps.",
        "",
        table(
            [
                "job",
                "checkpointing",
                "stall per save (median, rank 0)",
                "stall (max)",
                "median step without a save",
                "job wall time",
                f"bytes stored after {args.saves} saves",
            ],
            rows,
        ),
        "",
        f"Bytes for {args.saves} saves of the half-frozen fine-tune: stepvault "
        f"{sf['bytes'] / 1e6:.1f} MB, Lightning {lf['bytes'] / 1e6:.1f} MB "
        f"({lf['bytes'] / max(sf['bytes'], 1):.1f}x).",
        "",
        "### Method",
        "",
        "Each job is a fresh pair of processes started by Lightning's own launcher. The stall "
        "is the time rank 0's training thread spends in `trainer.save_checkpoint` (both "
        "callbacks save through it): for stepvault Lightning's `dump_checkpoint` and the "
        "copy of each rank's shards into reused host buffers, the write and the commit "
        "running in the background; for Lightning's `ModelCheckpoint` the whole synchronous "
        "DCP write of a folder per save (`save_top_k=-1`, nothing deleted). The background "
        "write shares the two cores with training, so the steps without a save are slower "
        "with stepvault on this machine (the median step column; the job wall time is the "
        "sum). Bytes are the files under each store/folder after the job.",
    ]
    _common.write_section(out_md, SECTION, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
