#!/usr/bin/env python
"""Sharded jobs through the frameworks (issue 30): a 2-rank Lightning job (gloo on CPU)
with ``ModelParallelStrategy`` (FSDP2), ``FSDPStrategy`` (FSDP1, sharded state dicts over a
device mesh) or ``DeepSpeedStrategy`` (ZeRO-2) saving through ``StepvaultCheckpoint``
against the same job saving with Lightning's own checkpointing (``ModelCheckpoint``: a DCP
folder per save, or DeepSpeed's ``save_checkpoint`` folder). Measured in one run: the
stall of a save (the time rank 0's training thread spends in ``trainer.save_checkpoint``),
the save time (stepvault: until the background write is committed, from the manifests;
Lightning: the synchronous save, i.e. the stall), the wall time of the job, and the bytes
stored after every save of a fine-tune whose first half of the layers is frozen
(stepvault stores an unchanged chunk once).

Rewrites the section between ``<!-- frameworks:begin -->`` and ``<!-- frameworks:end -->``
of BENCHMARKS.md::

    python benchmarks/bench_frameworks.py [--width 1024] [--layers 6] [--saves 10]
        [--strategies model_parallel,fsdp,deepspeed]

The job is this script run with ``--worker`` (Lightning's launcher starts rank 1 by
running the same command line again). FSDP1 and DeepSpeed run on CPU through the CPU
subclasses of Lightning's strategies that the tests use (tests/scripts/: Lightning accepts
them only with CUDA); nothing of them is in the package.
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
SCRIPTS = Path(__file__).resolve().parent.parent / "tests" / "scripts"
STRATEGIES = {
    "model_parallel": "ModelParallelStrategy (FSDP2)",
    "fsdp": "FSDPStrategy (FSDP1, sharded)",
    "deepspeed": "DeepSpeedStrategy (ZeRO-2)",
}
OWN = {
    "model_parallel": "Lightning sharded (DCP folders)",
    "fsdp": "Lightning sharded (DCP folders)",
    "deepspeed": "Lightning's DeepSpeed save_checkpoint",
}


def strategy_for(name: str) -> Any:
    """The Lightning strategy of a job; FSDP1 and DeepSpeed through the tests' CPU
    subclasses (BENCHMARK-ONLY: Lightning accepts them only with CUDA)."""
    from datetime import timedelta

    if name == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, timeout=timedelta(seconds=300)
        )
    sys.path.insert(0, str(SCRIPTS))
    if name == "fsdp":
        import torch
        from lightning_sharded_train import CPUFSDPStrategy

        return CPUFSDPStrategy(
            state_dict_type="sharded",
            auto_wrap_policy={torch.nn.Linear},
            device_mesh=(2,),  # DTensor state dicts (StepvaultCheckpoint needs them)
            timeout=timedelta(seconds=300),
        )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from lightning_deepspeed_train import CPUDeepSpeedStrategy

    return CPUDeepSpeedStrategy(
        stage=2,
        config={
            "zero_optimization": {"stage": 2},
            "zero_allow_untested_optimizer": True,
            "train_micro_batch_size_per_gpu": 16,
            "steps_per_print": 10**9,
        },
        timeout=timedelta(seconds=300),
    )


def worker(args: argparse.Namespace) -> None:
    """One 2-rank Lightning job (both ranks run this); rank 0 writes its timings."""
    import lightning.pytorch as pl
    import torch
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
            if args.strategy != "model_parallel":
                return  # FSDPStrategy and DeepSpeedStrategy wrap the module themselves
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
        strategy=strategy_for(args.strategy),
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


def save_seconds(root: Path, run: str = "bench") -> list[float]:
    """Each committed checkpoint's save time (its writer's start to its commit: the
    background write of an asynchronous save), from the manifests' stats."""
    import stepvault

    vault = stepvault.open(root)
    return [float(vault.manifest(run, s).stats["seconds"]) for s in vault.steps(run)]


def run_job(
    strategy: str, mode: str, root: Path, args: argparse.Namespace, frozen: bool
) -> dict[str, Any]:
    result = root.parent / f"{root.name}.json"
    cmd = [
        sys.executable, __file__, "--worker", "--strategy", strategy, "--mode", mode,
        "--root", str(root), "--result", str(result), "--width", str(args.width),
        "--layers", str(args.layers), "--saves", str(args.saves), "--every", str(args.every),
    ]  # fmt: skip
    if frozen:
        cmd.append("--frozen")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["DS_ACCELERATOR"] = "cpu"
    subprocess.run(
        cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        timeout=900,
    )  # fmt: skip
    out = json.loads(result.read_text())
    out["bytes"] = du(root)
    # Lightning's own saves are synchronous: the save is the stall.
    out["save"] = save_seconds(root) if mode == "stepvault" else out["stalls"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--strategy", choices=list(STRATEGIES), default="model_parallel")
    ap.add_argument("--mode", choices=["stepvault", "lightning"], default="stepvault")
    ap.add_argument("--root", default="")
    ap.add_argument("--result", default="")
    ap.add_argument("--frozen", action="store_true")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help="comma-separated, of " + ", ".join(STRATEGIES),
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    import _common
    from _common import REPO, machine_facts, table

    strategies = [x for x in args.strategies.split(",") if x]
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        ap.error(f"unknown strategies {unknown}: choose among {', '.join(STRATEGIES)}")
    out_md = args.out or REPO / "BENCHMARKS.md"
    t_all = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-frameworks-", dir=args.workdir))
    results: dict[tuple[str, str, bool], dict[str, Any]] = {}
    try:
        # The two modes alternate, so that both see the same drift of a shared machine.
        for frozen in (False, True):
            for strategy in strategies:
                for mode in ("lightning", "stepvault"):
                    root = work / f"{strategy}-{mode}-{'frozen' if frozen else 'full'}"
                    r = results[strategy, mode, frozen] = run_job(
                        strategy, mode, root, args, frozen
                    )
                    print(strategy, mode, frozen, {k: r[k] for k in ("wall", "bytes")}, flush=True)
        facts = machine_facts(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    params = args.layers * (args.width * args.width + args.width)
    state_mb = params * 4 * 3 / 1e6  # weights + AdamW's two moments, float32
    med = statistics.median
    # The dedup floor: frozen weights stored once, the rest (weights + 2 moments) each save.
    frozen_units, trained_units = args.layers // 2, 3 * (args.layers - args.layers // 2)
    frozen_share = frozen_units / (frozen_units + trained_units)
    floor = (frozen_units + trained_units * args.saves) / (
        (frozen_units + trained_units) * args.saves
    )

    rows, ratios, dedup = [], [], []
    for frozen in (False, True):
        for strategy in strategies:
            for mode in ("lightning", "stepvault"):
                r = results[strategy, mode, frozen]
                rows.append([
                    STRATEGIES[strategy],
                    "fine-tune, half frozen" if frozen else "all layers train",
                    OWN[strategy] if mode == "lightning" else "stepvault (async)",
                    f"{med(r['stalls']) * 1000:.0f} ms",
                    f"{max(r['stalls']) * 1000:.0f} ms",
                    f"{med(r['save']) * 1000:.0f} ms",
                    f"{med(r['plain']) * 1000:.0f} ms",
                    f"{r['wall']:.1f} s",
                    f"{r['bytes'] / 1e6:.1f} MB",
                ])  # fmt: skip
            n, sv = results[strategy, "lightning", frozen], results[strategy, "stepvault", frozen]
            if frozen:
                dedup.append(
                    f"{STRATEGIES[strategy]} {sv['bytes'] / 1e6:.1f} vs {n['bytes'] / 1e6:.1f} MB "
                    f"({sv['bytes'] / max(n['bytes'], 1):.2f}x)"
                )
            else:
                ratios.append(
                    f"{STRATEGIES[strategy]} stall {med(sv['stalls']) / med(n['stalls']):.2f}x, "
                    f"save {med(sv['save']) / med(n['save']):.2f}x"
                )
    lines = _common.section_head(
        "Sharded jobs through the frameworks (issue 30)",
        "python benchmarks/bench_frameworks.py",
        time.perf_counter() - t_all,
        facts,
    )
    lines += [
        "### Results",
        "",
        f"A 2-rank Lightning job (gloo, CPU) per strategy: {args.layers} linear layers of "
        f"{args.width}x{args.width} ({params / 1e6:.1f} M parameters, {state_mb:.0f} MB with "
        f"AdamW's moments when every layer trains), {args.saves} saves, one every "
        f"{args.every} steps, every one kept.",
        "",
        table(
            [
                "strategy",
                "job",
                "checkpointing",
                "stall per save (median, rank 0)",
                "stall (max)",
                "save (median)",
                "median step without a save",
                "job wall time",
                f"bytes stored after {args.saves} saves",
            ],
            rows,
        ),
        "",
        "stepvault / Lightning's own, all layers training: " + "; ".join(ratios) + ".",
        "",
        f"Bytes for {args.saves} saves of the half-frozen fine-tune, stepvault vs Lightning's "
        "own: " + "; ".join(dedup) + f". The frozen layers hold {frozen_share:.0%} of "
        "the fine-tune's state (weights only, no moments), so storing each unchanged byte "
        f"once can reach {floor:.2f}x here.",
        "",
        "### Method",
        "",
        "Each job is a fresh pair of processes started by Lightning's own launcher. The stall "
        "is the time rank 0's training thread spends in `trainer.save_checkpoint` (both "
        "callbacks save through it): for stepvault Lightning's `dump_checkpoint` and the "
        "copy of each rank's shards into reused host buffers, the write and the commit "
        "running in the background; for Lightning's `ModelCheckpoint` the whole synchronous "
        "write of a folder per save (`save_top_k=-1`, nothing deleted). The save column is, "
        "for stepvault, each checkpoint's write until its commit (the manifest's "
        "`stats.seconds`), and for Lightning its synchronous save (the stall). The background "
        "write shares the two cores with training, so the steps without a save can be "
        "slower with stepvault on this machine (the median step column; the job wall time is "
        "the sum). Bytes are the files under each store/folder after the job. FSDP1 and "
        "DeepSpeed run through the tests' CPU subclasses of Lightning's strategies "
        "(tests/scripts/).",
    ]
    _common.write_section(out_md, SECTION, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
