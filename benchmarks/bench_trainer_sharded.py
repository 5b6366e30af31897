#!/usr/bin/env python
"""The HF Trainer with a sharded model through stepvault (issue 30): a 2-rank ``Trainer``
job (torchrun, gloo on CPU) training a GPT-2 built here, with DeepSpeed ZeRO-2 or FSDP2,
checkpointing through ``StepvaultTrainer`` (every rank its shards, async) against the
same job with the Trainer's own checkpoints (``save_steps``: DeepSpeed's
``save_checkpoint`` folder, or FSDP's ``SHARDED_STATE_DICT`` folders) in one run. Measured:
the stall of a save (the time ``Trainer._save_checkpoint`` holds the training loop, rank
0), the job's wall time and the bytes stored after every save.

Rewrites the section between ``<!-- trainer_sharded:begin -->`` and
``<!-- trainer_sharded:end -->`` of BENCHMARKS.md::

    python benchmarks/bench_trainer_sharded.py [--embd 256] [--layers 4] [--saves 10]

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

SECTION = "trainer_sharded"


def _cpu_fsdp2() -> None:
    """BENCHMARK-ONLY: Accelerate honours an FSDP plugin only for GPU-like distributed
    types; this sets the FSDP type in its shared state so that the Trainer shards with
    FSDP2 on CPU processes (as tests/scripts/transformers_sharded_train.py does)."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    real_init = AcceleratorState.__init__

    def init(self, *a, fsdp_plugin=None, **kw):
        real_init(self, *a, fsdp_plugin=fsdp_plugin, **kw)
        if fsdp_plugin is not None:
            PartialState().distributed_type = DistributedType.FSDP
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init  # type: ignore[method-assign]


def worker(args: argparse.Namespace) -> None:
    """One 2-rank Trainer job (both ranks run this); rank 0 writes its timings."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.set_num_threads(1)
    steps = args.saves * args.every
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 1024, (steps * 2 * 4, 64), generator=g)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, i):
            return {"input_ids": rows[i], "labels": rows[i]}

    stalls: list[float] = []
    options: dict[str, Any] = dict(
        output_dir=args.root if args.mode == "native" else os.path.join(args.root, "out"),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-4,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=10**6,
        ddp_backend="gloo",
        save_strategy="steps" if args.mode == "native" else "no",
        save_steps=args.every,
    )
    if args.shard == "zero2":
        options["deepspeed"] = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": 2},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
    else:
        _cpu_fsdp2()
        options["fsdp"] = True
        options["fsdp_config"] = {"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=1024, n_positions=64, n_embd=args.embd, n_layer=args.layers,
                        n_head=4)  # fmt: skip
    model = GPT2LMHeadModel(config)
    if args.frozen:  # a fine-tune: the first half of the blocks and the embeddings frozen
        model.transformer.wte.requires_grad_(False)
        model.transformer.wpe.requires_grad_(False)
        for block in model.transformer.h[: args.layers // 2]:
            block.requires_grad_(False)
    callbacks: list[Any] = []
    if args.mode == "stepvault":
        from stepvault import Every
        from stepvault.integrations.transformers import StepvaultCallback, StepvaultTrainer

        callbacks.append(StepvaultCallback(args.root, run="bench", save=Every(steps=args.every)))
        base: type = StepvaultTrainer
    else:
        base = Trainer

    class Timed(base):  # type: ignore[misc, valid-type]
        def _save_checkpoint(self, model, trial):
            t0 = time.perf_counter()
            super()._save_checkpoint(model, trial)
            stalls.append(time.perf_counter() - t0)

    trainer = Timed(model=model, args=TrainingArguments(**options), train_dataset=Tokens(),
                    callbacks=callbacks)  # fmt: skip
    t_job = time.perf_counter()
    trainer.train()  # returns once the last stepvault save is committed
    wall = time.perf_counter() - t_job
    params = sum(p.numel() for p in model.parameters())
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps({"stall": stalls, "wall": wall, "params": params}))
    dist.barrier()


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_job(
    shard: str, mode: str, root: Path, args: argparse.Namespace, frozen: bool
) -> dict[str, Any]:
    result = root.parent / f"{root.name}.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        __file__, "--worker", "--shard", shard, "--mode", mode, "--root", str(root),
        "--result", str(result), "--embd", str(args.embd), "--layers", str(args.layers),
        "--saves", str(args.saves), "--every", str(args.every),
    ]  # fmt: skip
    if frozen:
        cmd.append("--frozen")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["DS_ACCELERATOR"] = "cpu"
    subprocess.run(
        cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        timeout=1200,
    )  # fmt: skip
    out = json.loads(result.read_text())
    out["bytes"] = du(root / "objects") if mode == "stepvault" else du(root)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shard", choices=["zero2", "fsdp2"], default="zero2")
    ap.add_argument("--mode", choices=["stepvault", "native"], default="stepvault")
    ap.add_argument("--root", default="")
    ap.add_argument("--result", default="")
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--frozen", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--no-fine-tune", action="store_true", help="skip the half-frozen fine-tune rows"
    )
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
    work = Path(tempfile.mkdtemp(prefix="bench-trainer-", dir=args.workdir))
    results: dict[tuple[str, str, bool], dict[str, Any]] = {}
    jobs = (False,) if args.no_fine_tune else (False, True)
    try:
        # The two modes alternate, so that both see the same drift of a shared machine.
        for frozen in jobs:
            for shard in ("zero2", "fsdp2"):
                for mode in ("native", "stepvault"):
                    root = work / f"{shard}-{mode}-{int(frozen)}"
                    results[shard, mode, frozen] = run_job(shard, mode, root, args, frozen)
                    r = results[shard, mode, frozen]
                    print(shard, mode, frozen, {k: r[k] for k in ("wall", "bytes")}, flush=True)
        facts = machine_facts(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    own = {"zero2": "Trainer's own (DeepSpeed save_checkpoint)",
           "fsdp2": "Trainer's own (FSDP SHARDED_STATE_DICT)"}  # fmt: skip
    rows, ratios, dedup = [], [], []
    for frozen, shard in [(f, s) for f in jobs for s in ("zero2", "fsdp2")]:
        for mode in ("native", "stepvault"):
            r = results[shard, mode, frozen]
            rows.append([
                {"zero2": "DeepSpeed ZeRO-2", "fsdp2": "FSDP2"}[shard]
                + (", half frozen" if frozen else ""),
                own[shard] if mode == "native" else "StepvaultTrainer (async)",
                f"{statistics.median(r['stall']) * 1000:.0f} ms",
                f"{max(r['stall']) * 1000:.0f} ms",
                f"{r['wall']:.1f} s",
                f"{r['bytes'] / 1e6:.1f} MB",
            ])  # fmt: skip
        n, s = results[shard, "native", frozen], results[shard, "stepvault", frozen]
        if frozen:
            dedup.append(f"{shard}: {s['bytes'] / 1e6:.1f} vs {n['bytes'] / 1e6:.1f} MB "
                         f"({s['bytes'] / n['bytes']:.2f}x)")  # fmt: skip
            continue
        ratios.append(
            f"{shard}: stall {statistics.median(s['stall']) / statistics.median(n['stall']):.2f}x, "
            f"job {s['wall'] / n['wall']:.2f}x"
        )
    params = results["zero2", "native", False]["params"]
    lines = _common.section_head(
        "The HF Trainer with DeepSpeed ZeRO-2 / FSDP2 through stepvault (issue 30)",
        "python benchmarks/bench_trainer_sharded.py",
        time.perf_counter() - t_all,
        facts,
    )
    lines += [
        "### Results",
        "",
        f"A 2-rank `Trainer` job (torchrun, gloo, CPU): a GPT-2 of {args.layers} layers, "
        f"n_embd {args.embd} ({params / 1e6:.1f} M parameters, AdamW), {args.saves} saves, "
        f"one every {args.every} steps, every one kept. Stall: the time "
        "`Trainer._save_checkpoint` holds the loop on rank 0 (median and max over the "
        "saves); job: `train()` until it returns (stepvault's last save committed).",
        "",
        table(
            [
                "sharding",
                "checkpointing",
                "stall (median)",
                "stall (max)",
                "job",
                f"bytes after {args.saves} saves",
            ],
            rows,
        ),
        "",
        "stepvault / the Trainer's own: " + "; ".join(ratios) + ". Bytes: when every "
        "parameter trains consecutive saves share little; the Trainer's own ZeRO-2 save also "
        "writes the whole model as model.safetensors beside DeepSpeed's files each time. A "
        "stall is what the loop waits for; stepvault writes in the background (the job "
        "time includes its last commit)."
        + (
            " Half-frozen fine-tune (embeddings and the first half of the blocks frozen), "
            f"bytes after {args.saves} saves, stepvault vs the Trainer's own: "
            + "; ".join(dedup)
            + ". Dedup works per stored chunk: ZeRO-2's frozen module weights are whole "
            "tensors in DeepSpeed's model-states file and are stored once; under FSDP2 "
            "the collective writer lays each rank's shards out as one stream cut in 1 MiB "
            "chunks, so the small frozen tensors of a model this size share chunks with "
            "trained ones and little is saved (in a 0.2 M-parameter run every tensor of "
            "a rank lay in the same two objects)."
            if dedup
            else ""
        ),
    ]
    _common.write_section(out_md, SECTION, "\n".join(lines) + "\n")
    print(f"wrote the {SECTION} section of {out_md}")


if __name__ == "__main__":
    main()
