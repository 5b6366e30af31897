#!/usr/bin/env python
"""DeepSpeed ZeRO-2 through stepvault (issue 30): a 2-rank DeepSpeed job (torchrun, gloo on
CPU, torch AdamW) saving through ``DeepSpeedCheckpointer`` against the same job saving
with DeepSpeed's own ``engine.save_checkpoint`` (a ``global_stepN`` folder of torch.save
files per save). Measured in one run: the stall of a save (the time the save call holds
the training loop, rank 0), the time until it is durable, and the bytes stored after every
save of a fine-tune whose first half of the layers is frozen (stepvault stores an
unchanged chunk once; DeepSpeed writes the module states again each time).

Rewrites the section between ``<!-- deepspeed:begin -->`` and ``<!-- deepspeed:end -->``
of BENCHMARKS.md::

    python benchmarks/bench_deepspeed.py [--width 1024] [--layers 6] [--saves 10]

The job is this script run with ``--worker`` under torchrun.
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

SECTION = "deepspeed"


def worker(args: argparse.Namespace) -> None:
    """One 2-rank DeepSpeed job (both ranks run this); rank 0 writes its timings."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    model = torch.nn.Sequential(*layers)
    if args.frozen:
        for layer in layers[: args.layers // 2]:
            layer.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    ckpt = None
    if args.mode == "stepvault":
        from stepvault.integrations.deepspeed import DeepSpeedCheckpointer

        ckpt = DeepSpeedCheckpointer(engine, args.root, "bench")
    plain: list[float] = []
    stalls: list[float] = []
    durable: list[float] = []
    t_job = time.perf_counter()
    for _ in range(args.saves):
        for _ in range(args.every):
            t0 = time.perf_counter()
            x = torch.randn(8, args.width)
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()
            plain.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        if ckpt is not None:
            ckpt.save(force=True)
            stalls.append(time.perf_counter() - t0)
            ckpt.wait()
        else:
            engine.save_checkpoint(args.root)
            stalls.append(time.perf_counter() - t0)
        durable.append(time.perf_counter() - t0)
    if ckpt is not None:
        ckpt.close()
    wall = time.perf_counter() - t_job
    if rank == 0:
        Path(args.result).write_text(
            json.dumps({"plain": plain, "stall": stalls, "durable": durable, "wall": wall})
        )
    dist.barrier()
    dist.destroy_process_group()


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_job(mode: str, root: Path, args: argparse.Namespace, frozen: bool) -> dict[str, Any]:
    result = root.parent / f"{root.name}.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        __file__, "--worker", "--mode", mode, "--root", str(root), "--result", str(result),
        "--width", str(args.width), "--layers", str(args.layers), "--saves", str(args.saves),
        "--every", str(args.every),
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
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["stepvault", "deepspeed"], default="stepvault")
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
    work = Path(tempfile.mkdtemp(prefix="bench-deepspeed-", dir=args.workdir))
    results: dict[tuple[str, bool], dict[str, Any]] = {}
    try:
        # The two modes alternate, so that both see the same drift of a shared machine.
        for frozen in (False, True):
            for mode in ("deepspeed", "stepvault"):
                root = work / f"{mode}-{'frozen' if frozen else 'full'}"
                results[mode, frozen] = run_job(mode, root, args, frozen)
                print(mode, frozen, {k: results[mode, frozen][k] for k in ("wall", "bytes")})
        facts = machine_facts(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    params = args.layers * (args.width * args.width + args.width)
    rows = []
    for frozen in (False, True):
        for mode in ("deepspeed", "stepvault"):
            r = results[mode, frozen]
            rows.append([
                "fine-tune, half frozen" if frozen else "all layers train",
                "DeepSpeed save_checkpoint" if mode == "deepspeed" else "stepvault (async)",
                f"{statistics.median(r['stall']) * 1000:.0f} ms",
                f"{statistics.median(r['durable']) * 1000:.0f} ms",
                f"{statistics.median(r['plain']) * 1000:.0f} ms",
                f"{r['bytes'] / 1e6:.1f} MB",
            ])  # fmt: skip
    df, sf = results["deepspeed", True], results["stepvault", True]
    d0, s0 = results["deepspeed", False], results["stepvault", False]
    stall_ratio = statistics.median(s0["stall"]) / statistics.median(d0["stall"])
    lines = _common.section_head(
        "DeepSpeed ZeRO-2 through stepvault (issue 30)",
        "python benchmarks/bench_deepspeed.py",
        time.perf_counter() - t_all,
        facts,
    )
    lines += [
        "### Results",
        "",
        f"A 2-rank DeepSpeed ZeRO-2 job (torchrun, gloo, CPU, torch AdamW): {args.layers} "
        f"linear layers of {args.width}x{args.width} ({params / 1e6:.1f} M parameters), "
        f"{args.saves} saves, one every {args.every} steps; medians over the saves.",
        "",
        table(
            [
                "job",
                "checkpointing",
                "stall of a save (rank 0)",
                "save until durable",
                "step without a save",
                f"bytes stored after {args.saves} saves",
            ],
            rows,
        ),
        "",
        f"Stall of a save, all layers training: stepvault / DeepSpeed = {stall_ratio:.2f}. "
        f"Bytes for {args.saves} saves of the half-frozen fine-tune: stepvault "
        f"{sf['bytes'] / 1e6:.1f} MB, DeepSpeed {df['bytes'] / 1e6:.1f} MB "
        f"({sf['bytes'] / df['bytes']:.2f}x): the frozen layers' weights in the module "
        "states are stored once, and each save of stepvault is durable (fsync) where "
        "DeepSpeed's torch.save files are not synced.",
    ]
    _common.write_section(out_md, SECTION, "\n".join(lines) + "\n")
    print(f"wrote the {SECTION} section of {out_md}")


if __name__ == "__main__":
    main()
