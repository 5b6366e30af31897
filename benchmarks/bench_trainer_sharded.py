#!/usr/bin/env python
"""The HF Trainer and Accelerate with a sharded model through stepvault (issue 30): a
2-rank job (torchrun, gloo on CPU) training a GPT-2 built here, with DeepSpeed ZeRO-2 or
FSDP2, through the ``Trainer`` (``StepvaultTrainer``) or a plain Accelerate loop
(``AcceleratorCheckpointer``), every rank its shards, async, against the same job with the
framework's own checkpoints (the Trainer's ``save_steps`` or ``accelerator.save_state``:
DeepSpeed's ``save_checkpoint`` folder, or FSDP's ``SHARDED_STATE_DICT`` folders) in one
run. Measured: the stall of a save (the time the save call holds the training loop, rank
0), the save time (stepvault: until the background write is committed, from the
manifests; the framework's own: the synchronous save), the job's wall time and the bytes
stored after every save, for all parameters training and for a half-frozen fine-tune.
The Trainer's FSDP2 jobs also run with the collective writer's earlier layout (every
shard under 1 MiB bundled: ``--layout bundled``) for the before/after of issue 30's fix.

Rewrites the section between ``<!-- trainer_sharded:begin -->`` and
``<!-- trainer_sharded:end -->`` of BENCHMARKS.md::

    python benchmarks/bench_trainer_sharded.py [--embd 256] [--layers 4] [--saves 10]
        [--frameworks trainer,accelerate]

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


def _gpt2(args: argparse.Namespace) -> Any:
    """The model of every job (seeded), half of it frozen for a fine-tune."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=1024, n_positions=64, n_embd=args.embd, n_layer=args.layers,
                        n_head=4)  # fmt: skip
    model = GPT2LMHeadModel(config)
    if args.frozen:  # a fine-tune: the first half of the blocks and the embeddings frozen
        model.transformer.wte.requires_grad_(False)
        model.transformer.wpe.requires_grad_(False)
        for block in model.transformer.h[: args.layers // 2]:
            block.requires_grad_(False)
    return model


def accelerate_worker(args: argparse.Namespace) -> None:
    """One 2-rank plain Accelerate loop (both ranks run this); rank 0 writes its timings."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator, PartialState
    from accelerate.utils import (
        DeepSpeedPlugin,
        DistributedType,
        FullyShardedDataParallelPlugin,
        InitProcessGroupKwargs,
    )

    torch.set_num_threads(1)
    # Accelerate picks no process-group backend on CPU: gloo, as CPU users do.
    gloo = [InitProcessGroupKwargs(backend="gloo")]
    if args.shard == "zero2":
        plugin = DeepSpeedPlugin(hf_ds_config={
            "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        })  # fmt: skip
        acc = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=gloo)
    else:
        fsdp = FullyShardedDataParallelPlugin(
            fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", reshard_after_forward=True
        )
        acc = Accelerator(cpu=True, fsdp_plugin=fsdp, kwargs_handlers=gloo)
        # BENCHMARK-ONLY (as tests/scripts/accelerate_fsdp2_state.py): Accelerate honours an
        # FSDP plugin only for GPU-like distributed types; this makes prepare() shard on CPU.
        PartialState().distributed_type = DistributedType.FSDP
        acc.state.distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = fsdp
    model = _gpt2(args)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model, opt = acc.prepare(model, opt)
    ckpt = None
    if args.mode == "stepvault":
        from stepvault import Every, KeepLast
        from stepvault.integrations.accelerate import AcceleratorCheckpointer

        ckpt = AcceleratorCheckpointer(
            acc, args.root, run="bench", save=Every(steps=args.every), keep=KeepLast(1000)
        )
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    stalls: list[float] = []
    t_job = time.perf_counter()
    for step in range(1, args.saves * args.every + 1):
        ids = torch.randint(0, 1024, (4, 64), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        if step % args.every:
            continue
        t0 = time.perf_counter()
        if ckpt is not None:
            ckpt.save(step)
        else:
            acc.save_state(os.path.join(args.root, f"checkpoint_{step}"))
        stalls.append(time.perf_counter() - t0)
    if ckpt is not None:
        ckpt.close()  # the last save committed
    wall = time.perf_counter() - t_job
    params = sum(p.numel() for p in _gpt2(args).parameters())
    if rank == 0:
        Path(args.result).write_text(json.dumps({"stall": stalls, "wall": wall, "params": params}))
    dist.barrier()


def worker(args: argparse.Namespace) -> None:
    """One 2-rank Trainer job (both ranks run this); rank 0 writes its timings."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.layout == "bundled":
        # The collective writer before issue 30's fix: every shard under the store's
        # small_tensor (1 MiB) bundled, for the before/after rows.
        from stepvault.distributed.storage import StepvaultWriter

        StepvaultWriter.bundle_below = 1 << 20
    if args.framework == "accelerate":
        accelerate_worker(args)
        return
    import torch
    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments

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
    model = _gpt2(args)
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


def save_seconds(root: Path, run: str = "bench") -> list[float]:
    """Each committed checkpoint's save time (its writer's start to its commit: the
    background write of an asynchronous save), from the manifests' stats."""
    import stepvault

    vault = stepvault.open(root)
    return [float(vault.manifest(run, s).stats["seconds"]) for s in vault.steps(run)]


#: a job: (framework, sharding, mode, half frozen); mode "bundled" is stepvault with the
#: collective writer's layout before issue 30's fix
Job = tuple[str, str, str, bool]


def run_job(job: Job, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    framework, shard, mode, frozen = job
    result = root.parent / f"{root.name}.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        __file__, "--worker", "--framework", framework, "--shard", shard,
        "--mode", "native" if mode == "native" else "stepvault",
        "--layout", "bundled" if mode == "bundled" else "per-tensor", "--root", str(root),
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
    out["bytes"] = du(root) if mode == "native" else du(root / "objects")
    # The framework's own saves are synchronous: the save is the stall.
    out["save"] = out["stall"] if mode == "native" else save_seconds(root)
    return out


FRAMEWORKS = ("trainer", "accelerate")
SHARDS = {"zero2": "DeepSpeed ZeRO-2", "fsdp2": "FSDP2"}
OWN = {
    ("trainer", "zero2"): "Trainer's own (DeepSpeed save_checkpoint)",
    ("trainer", "fsdp2"): "Trainer's own (FSDP SHARDED_STATE_DICT)",
    ("accelerate", "zero2"): "save_state (DeepSpeed save_checkpoint)",
    ("accelerate", "fsdp2"): "save_state (FSDP SHARDED_STATE_DICT)",
}
OURS = {"trainer": "StepvaultTrainer (async)", "accelerate": "AcceleratorCheckpointer (async)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--framework", choices=FRAMEWORKS, default="trainer")
    ap.add_argument("--shard", choices=list(SHARDS), default="zero2")
    ap.add_argument("--mode", choices=["stepvault", "native"], default="stepvault")
    ap.add_argument("--layout", choices=["per-tensor", "bundled"], default="per-tensor",
                    help=argparse.SUPPRESS)  # fmt: skip
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
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS),
                    help="comma-separated, of trainer, accelerate")  # fmt: skip
    ap.add_argument(
        "--no-before", action="store_true", help="skip the Trainer FSDP2 jobs of the old layout"
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    import _common
    from _common import REPO, machine_facts, table

    frameworks = [f for f in args.frameworks.split(",") if f]
    if set(frameworks) - set(FRAMEWORKS):
        ap.error(f"--frameworks: choose among {', '.join(FRAMEWORKS)}")
    out_md = args.out or REPO / "BENCHMARKS.md"
    t_all = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-trainer-", dir=args.workdir))
    results: dict[Job, dict[str, Any]] = {}
    jobs = (False,) if args.no_fine_tune else (False, True)
    order: list[Job] = []
    for frozen in jobs:
        for framework in frameworks:
            for shard in SHARDS:
                order += [
                    (framework, shard, "native", frozen),
                    (framework, shard, "stepvault", frozen),
                ]
                if framework == "trainer" and shard == "fsdp2" and not args.no_before:
                    order.append((framework, shard, "bundled", frozen))
    try:
        # The modes alternate, so that all see the same drift of a shared machine.
        for job in order:
            root = work / "-".join(str(x) for x in job)
            r = results[job] = run_job(job, root, args)
            print(*job, {k: r[k] for k in ("wall", "bytes")}, flush=True)
        facts = machine_facts(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    rows, ratios, dedup = [], [], []
    for frozen in jobs:
        for framework in frameworks:
            for shard in SHARDS:
                for mode in ("native", "stepvault", "bundled"):
                    r = results.get((framework, shard, mode, frozen))
                    if r is None:
                        continue
                    who = {
                        "native": OWN[framework, shard],
                        "stepvault": OURS[framework],
                        "bundled": OURS[framework] + ", writer before the fix",
                    }[mode]
                    rows.append([
                        framework.capitalize(),
                        SHARDS[shard] + (", half frozen" if frozen else ""),
                        who,
                        f"{med(r['stall']) * 1000:.0f} ms",
                        f"{max(r['stall']) * 1000:.0f} ms",
                        f"{med(r['save']) * 1000:.0f} ms",
                        f"{r['wall']:.1f} s",
                        f"{r['bytes'] / 1e6:.1f} MB",
                    ])  # fmt: skip
                n = results[framework, shard, "native", frozen]
                sv = results[framework, shard, "stepvault", frozen]
                name = f"{framework.capitalize()} {SHARDS[shard]}"
                if frozen:
                    dedup.append(f"{name}: {sv['bytes'] / 1e6:.1f} vs {n['bytes'] / 1e6:.1f} MB "
                                 f"({sv['bytes'] / n['bytes']:.2f}x)")  # fmt: skip
                else:
                    ratios.append(
                        f"{name}: stall {med(sv['stall']) / med(n['stall']):.2f}x, "
                        f"job {sv['wall'] / n['wall']:.2f}x"
                    )
    before = []
    for frozen in jobs:
        b = results.get(("trainer", "fsdp2", "bundled", frozen))
        if b is None:
            continue
        a = results["trainer", "fsdp2", "stepvault", frozen]
        before.append(
            ("half frozen" if frozen else "all training")
            + f": save {med(a['save']) * 1000:.0f} vs {med(b['save']) * 1000:.0f} ms "
            f"({med(a['save']) / med(b['save']):.2f}x), bytes {a['bytes'] / 1e6:.1f} vs "
            f"{b['bytes'] / 1e6:.1f} MB ({a['bytes'] / b['bytes']:.2f}x)"
        )
    params = next(iter(results.values()))["params"]
    lines = _common.section_head(
        "The HF Trainer and Accelerate with DeepSpeed ZeRO-2 / FSDP2 through stepvault (issue 30)",
        "python benchmarks/bench_trainer_sharded.py",
        time.perf_counter() - t_all,
        facts,
    )
    lines += [
        "### Results",
        "",
        f"A 2-rank job (torchrun, gloo, CPU): a GPT-2 of {args.layers} layers, n_embd "
        f"{args.embd} ({params / 1e6:.1f} M parameters, AdamW), {args.saves} saves, one every "
        f"{args.every} steps, every one kept; through the `Trainer` or a plain Accelerate "
        "loop. Stall: the time the save call holds the loop on rank 0 "
        "(`Trainer._save_checkpoint`, `AcceleratorCheckpointer.save` or "
        "`accelerator.save_state`; median and max over the saves); save: stepvault's "
        "background write until its commit (the manifests' `stats.seconds`), the "
        "framework's own synchronous save (= the stall); job: until training returns "
        "(stepvault's last save committed).",
        "",
        table(
            [
                "framework",
                "sharding",
                "checkpointing",
                "stall (median)",
                "stall (max)",
                "save (median)",
                "job",
                f"bytes after {args.saves} saves",
            ],
            rows,
        ),
        "",
        "stepvault / the framework's own: " + "; ".join(ratios) + ". Bytes: when every "
        "parameter trains consecutive saves share little; the Trainer's own ZeRO-2 save also "
        "writes the whole model as model.safetensors beside DeepSpeed's files each time. A "
        "stall is what the loop waits for; stepvault writes in the background (the job "
        "time includes its last commit)."
        + (
            " Half-frozen fine-tune (embeddings and the first half of the blocks frozen), "
            f"bytes after {args.saves} saves, stepvault vs the framework's own: "
            + "; ".join(dedup)
            + ". Dedup works per stored chunk, and each tensor shard a rank writes starts "
            "a chunk of its own, so a frozen tensor is stored once."
            if dedup
            else ""
        )
        + (
            " The collective writer per tensor vs its earlier layout (each rank's shards "
            "under 1 MiB bundled, so that frozen and trained tensors shared objects), Trainer "
            "FSDP2: " + "; ".join(before) + "."
            if before
            else ""
        ),
    ]
    _common.write_section(out_md, SECTION, "\n".join(lines) + "\n")
    print(f"wrote the {SECTION} section of {out_md}")


if __name__ == "__main__":
    main()
