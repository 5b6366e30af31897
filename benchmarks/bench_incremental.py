#!/usr/bin/env python
"""Incremental benchmark: what 10 consecutive checkpoints of a real short training run
store, against writing a full copy every time.

Rewrites the section between ``<!-- incremental:begin -->`` and ``<!-- incremental:end -->``
of BENCHMARKS.md::

    python benchmarks/bench_incremental.py [--checkpoints 10] [--every 5] [--out BENCHMARKS.md]

A small GPT-like transformer (token + position embeddings, pre-norm blocks, tied head) is
trained with AdamW on a learnable synthetic sequence task, and checkpointed
(``{"model": module, "optimizer": optimizer}``) every ``--every`` steps into one store:
(a) with the first half of the blocks and the embeddings frozen (``requires_grad=False``),
(b) a full fine-tune. Each checkpoint's new stored bytes (deduplicated against every
earlier one) are compared with its logical size (what a full copy writes) and with the
size of a ``torch.save`` file of the same state.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when loaded by path
import _common
from _common import MB, REPO, facts_line, fmt_bytes, machine_facts, table

import stepvault

SECTION = "incremental"


class TinyGpt(nn.Module):
    """A GPT-like causal language model, small enough to train for seconds on a CPU."""

    def __init__(self, vocab: int, ctx: int, d: int, n_layer: int, heads: int = 4) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(n_layer)
        )
        self.ln_f = nn.LayerNorm(d)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx))
        for emb in (self.wte, self.wpe):  # GPT-2's init; N(0, 1) makes the tied head's
            nn.init.normal_(emb.weight, std=0.02)  # first losses absurd

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for block in self.blocks:
            x = block(x, src_mask=self.mask[:t, :t], is_causal=True)
        return self.ln_f(x) @ self.wte.weight.T


def batches(vocab: int, ctx: int, batch: int, seed: int) -> Callable[[], torch.Tensor]:
    """Sequences that follow a fixed random permutation of the vocabulary from a random
    start: the next token is learnable, so the loss really falls."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=gen)
    steps = torch.arange(ctx + 1)

    def next_batch() -> torch.Tensor:
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        pos = start.clone()
        seq = [start]
        for _ in steps[1:]:
            pos = perm[pos]
            seq.append(pos)
        return torch.cat(seq, dim=1)

    return next_batch


@dataclass
class Scenario:
    name: str
    trainable: int = 0  # parameters with requires_grad
    frozen_bytes: int = 0  # parameters and buffers that never change
    params: int = 0
    logical: list[int] = field(default_factory=list)
    new: list[int] = field(default_factory=list)
    stored: list[int] = field(default_factory=list)  # the checkpoint's own objects
    torch_save: list[int] = field(default_factory=list)
    save_s: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    store_bytes: int = 0
    train_s: float = 0.0


def run_scenario(
    name: str, freeze_half: bool, args: argparse.Namespace, work: Path, log: Callable[[str], None]
) -> Scenario:
    torch.manual_seed(0)
    model = TinyGpt(args.vocab, args.ctx, args.d, args.layers)
    if freeze_half:
        frozen = [model.wte, model.wpe, *model.blocks[: args.layers // 2]]
        for m in frozen:
            for p in m.parameters():
                p.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    unchanged = [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())
    opt = torch.optim.AdamW(trainable, lr=3e-3, weight_decay=0.01)
    sc = Scenario(
        name, sum(p.numel() for p in trainable), sum(p.numel() for p in model.parameters())
    )
    sc.frozen_bytes = sum(t.nbytes for t in unchanged)
    next_batch = batches(args.vocab, args.ctx, args.batch, seed=1)
    root = work / f"store-{name.split()[0]}"
    state = {"model": model, "optimizer": opt}
    t_train = 0.0
    for ckpt in range(1, args.checkpoints + 1):
        t0 = time.perf_counter()
        for _ in range(args.every):
            seq = next_batch()
            logits = model(seq[:, :-1])
            loss = nn.functional.cross_entropy(
                logits.reshape(-1, args.vocab), seq[:, 1:].reshape(-1)
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        t_train += time.perf_counter() - t0
        step = ckpt * args.every
        t0 = time.perf_counter()
        info = stepvault.save(root, state, run="train", step=step, metrics={"loss": loss.item()})
        sc.save_s.append(time.perf_counter() - t0)
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
        sc.logical.append(info.logical_bytes)
        sc.new.append(info.new_bytes)
        sc.stored.append(info.stored_bytes)
        sc.torch_save.append(buf.tell())
        sc.loss.append(loss.item())
        log(
            f"  {name}: step {step:4d} loss {loss.item():.3f}"
            f"  logical {fmt_bytes(info.logical_bytes)}"
            f"  new {fmt_bytes(info.new_bytes)} ({info.new_bytes / info.logical_bytes:.0%})"
        )
    sc.train_s = t_train
    sc.store_bytes = _common.dir_bytes(root / "objects")
    return sc


def render(
    command: str,
    facts: dict[str, str],
    scenarios: list[Scenario],
    args: argparse.Namespace,
    runtime: float,
) -> str:
    out = [
        "## Incremental checkpoints of a real training run",
        "",
        f"Generated by `{command}` in {runtime / 60:.1f} min on {facts['date']}.",
        "",
        f"Machine: {facts_line(facts)}; load average {facts['load average at start']}.",
        "",
        table(
            [
                "run",
                "checkpoints",
                "logical per checkpoint",
                "new bytes, 1st",
                "new bytes, 2nd-last (median)",
                "new / full copy, 2nd-last",
                "changed tensors / full copy",
                "store total / full copies",
                "loss first → last",
            ],
            [
                [
                    s.name,
                    str(len(s.new)),
                    fmt_bytes(s.logical[-1]),
                    fmt_bytes(s.new[0]),
                    fmt_bytes(_common.median([float(x) for x in s.new[1:]])),
                    f"{_common.median([n / lg for n, lg in zip(s.new[1:], s.logical[1:])]):.3f}",
                    f"{(s.logical[-1] - s.frozen_bytes) / s.logical[-1]:.3f}",
                    f"{s.store_bytes / sum(s.logical):.3f}",
                    f"{s.loss[0]:.2f} → {s.loss[-1]:.2f}",
                ]
                for s in scenarios
            ],
        ),
        "",
        table(
            [
                "run",
                "checkpoint",
                "step",
                "loss",
                "logical",
                "new stored",
                "new / full copy",
                "torch.save size",
                "save s",
            ],
            [
                [
                    s.name,
                    str(i + 1),
                    str((i + 1) * args.every),
                    f"{s.loss[i]:.3f}",
                    fmt_bytes(s.logical[i]),
                    fmt_bytes(s.new[i]),
                    f"{s.new[i] / s.logical[i]:.3f}",
                    fmt_bytes(s.torch_save[i]),
                    f"{s.save_s[i]:.2f}",
                ]
                for s in scenarios
                for i in range(len(s.new))
            ],
        ),
        "",
        "### Method",
        "",
        f"- Model: a GPT-like causal transformer (vocab {args.vocab}, context {args.ctx}, width "
        f"{args.d}, {args.layers} pre-norm `nn.TransformerEncoderLayer` blocks, tied head; "
        f"{scenarios[0].params / 1e6:.2f} M parameters), AdamW (lr 3e-3), batch "
        f"{args.batch}, trained on sequences that follow a fixed permutation of the vocabulary "
        "(learnable: the loss falls). Checkpoint = `stepvault.save(root, {'model': model, "
        f"'optimizer': optimizer}})` every {args.every} steps, {args.checkpoints} "
        "checkpoints into one store, default codec (raw), default chunk size.",
        "- Frozen half: the embeddings and the first half of the blocks have "
        "`requires_grad=False` (no gradients, no optimizer state); their chunks are unchanged "
        f"and cost nothing after the first checkpoint ({scenarios[0].trainable / 1e6:.2f} M of "
        f"{scenarios[0].params / 1e6:.2f} M parameters train).",
        "- Full fine-tune: every parameter and its AdamW moments change every step, so every "
        "chunk is new; content addressing cannot help (the float codec would, at the cost of "
        "speed: see the core section).",
        "- Changed tensors = the checkpoint's bytes minus the frozen parameters and the "
        "buffers (the least any incremental scheme must write); new bytes above it come "
        "from frozen tensors smaller than the bundling threshold, which share a bundle "
        "object with tensors that changed.",
        "- New bytes = `SaveInfo.new_bytes` (objects this checkpoint added to the store); full "
        "copy = the checkpoint's logical bytes, which `torch.save`/safetensors write every "
        "time (torch.save file size shown per checkpoint). Store total = bytes under "
        "`objects/` after the run.",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--checkpoints", type=int, default=10)
    ap.add_argument("--every", type=int, default=5, help="training steps between checkpoints")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch parent")
    args = ap.parse_args(argv)
    if args.checkpoints < 2 or args.every < 1 or args.layers < 2:
        ap.error("--checkpoints >= 2, --every >= 1, --layers >= 2")
    t_start = time.perf_counter()
    parent = args.workdir or REPO / "bench-out"
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-incremental-", dir=parent))

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    command = _common.command_line("bench_incremental.py", argv)
    try:
        facts = machine_facts(work)
        log(facts_line(facts))
        scenarios = [
            run_scenario("(a) half the layers frozen", True, args, work, log),
            run_scenario("(b) full fine-tune", False, args, work, log),
        ]
        runtime = time.perf_counter() - t_start
        _common.write_section(args.out, SECTION, render(command, facts, scenarios, args, runtime))
        if args.json:
            args.json.write_text(json.dumps([s.__dict__ for s in scenarios], indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for s in scenarios:
        ratio = _common.median([n / lg for n, lg in zip(s.new[1:], s.logical[1:])])
        print(
            f"{s.name}: new / full copy after the first checkpoint {ratio:.3f} "
            f"(logical {s.logical[-1] / MB:.1f} MB)"
        )
    print(f"total runtime {runtime:.1f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
