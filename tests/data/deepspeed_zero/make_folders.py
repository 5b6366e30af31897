"""Writes the tiny DeepSpeed ``global_stepN`` folders of tests/test_migrate_deepspeed.py.

Made with DeepSpeed 0.19.8 and torch 2.13.0+cpu (``DS_ACCELERATOR=cpu``, gloo). Each stage
is a real 2-process job; building them takes ~30 s per stage on a loaded 2-core machine,
too long for a fast test, so the folders are stored here. Rebuild with::

    for s in 1 2 3; do DS_ACCELERATOR=cpu python -m torch.distributed.run --standalone \\
        --nproc_per_node 2 tests/data/deepspeed_zero/make_folders.py --stage $s; done

With ``--resume-from stepvault --root STORE --run-name RUN`` or ``--resume-from deepspeed``, the
job instead resumes the stored ZeRO-3 folder (an import of it in STORE through
``DeepSpeedCheckpointer.resume``, or DeepSpeed's own ``load_checkpoint`` of the folder),
trains one more step on a fixed batch and saves with DeepSpeed's own ``save_checkpoint`` to
``--out`` (tests/test_migrate_deepspeed.py compares the two).

The model holds what makes a consolidation hard: a tied weight (``head.weight`` is
``emb.weight``: one of DeepSpeed's ``shared_params``), frozen parameters, two parameter
groups (decay / no decay: two flat fp32 groups per rank), element counts that are odd (the
last rank's ZeRO-3 slice is padded) and buffers (float and int). ZeRO-2 is built with
``parameter_alignment`` (its ``param_alignment_paddings`` are not zero).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 3


class Tiny(nn.Module):
    """The model of the stored folders (the test rebuilds it to restore into)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 7)  # 91 elements: odd
        self.frozen = nn.Linear(7, 5)  # frozen below
        self.lin = nn.Linear(5, 7)
        self.norm = nn.LayerNorm(7)
        self.head = nn.Linear(7, 13, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.full((3,), 0.5))
        self.register_buffer("count", torch.arange(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.lin(torch.tanh(self.frozen(h))) * self.scale[0]
        return self.head(self.norm(h))


def build(seed: int = 0) -> Tiny:
    """The model as every rank builds it (frozen layer included)."""
    torch.manual_seed(seed)
    model = Tiny()
    model.frozen.requires_grad_(False)
    return model


def main() -> int:
    import deepspeed
    import torch.distributed as dist

    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--resume-from", choices=["stepvault", "deepspeed"], default="")
    p.add_argument("--root", default="")
    p.add_argument("--run-name", default="z3")
    p.add_argument("--out", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    model = build()
    decay = [q for q in model.parameters() if q.requires_grad and q.dim() >= 2]
    rest = [q for q in model.parameters() if q.requires_grad and q.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2
    )
    zero: dict = {"stage": args.stage}
    if args.stage == 2:
        zero["parameter_alignment"] = True
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    if args.resume_from:
        return resume(engine, args, rank)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        ids = torch.randint(0, 13, (2, 5), generator=g)
        loss = nn.functional.cross_entropy(engine(ids).flatten(0, 1), ids.flatten())
        engine.backward(loss)
        engine.step()
    out = os.path.join(HERE, f"zero{args.stage}")
    if rank == 0 and os.path.isdir(out):
        shutil.rmtree(out)
    dist.barrier()
    engine.save_checkpoint(out)
    dist.barrier()
    if rank == 0:
        # DeepSpeed copies its recovery script next to the tags: not needed here
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            if os.path.exists(os.path.join(out, script)):
                os.remove(os.path.join(out, script))
        print("WROTE", out, sorted(os.listdir(os.path.join(out, f"global_step{STEPS}"))))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def resume(engine: Any, args: argparse.Namespace, rank: int) -> int:
    """Resume the stored folder (through stepvault or DeepSpeed), one step, save to --out."""
    import torch.distributed as dist

    folder = os.path.join(HERE, f"zero{args.stage}")
    if args.resume_from == "stepvault":
        from stepvault.integrations.deepspeed import DeepSpeedCheckpointer

        ckpt = DeepSpeedCheckpointer(engine, args.root, args.run_name)
        info = ckpt.resume()
        assert info is not None, "nothing to resume"
        print(f"RESUMED {info.step}", flush=True)
        ckpt.close()  # DeepSpeed's own engine back for the save below
    else:
        engine.load_checkpoint(folder)
    assert engine.global_steps == STEPS, engine.global_steps
    ids = torch.randint(0, 13, (2, 5), generator=torch.Generator().manual_seed(100 + rank))
    loss = nn.functional.cross_entropy(engine(ids).flatten(0, 1), ids.flatten())
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(args.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
