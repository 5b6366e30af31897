"""A 2-rank Accelerate job on a tiny GPT-2 for tests/test_export_frameworks.py:

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        accelerate_hf_export_job.py --backend fsdp2|deepspeed [--stage 2] --root DIR --out FILE

``--backend fsdp2``: an FSDP2 plugin (through the TEST-ONLY CPU patch of
``accelerate_fsdp2_state.cpu_fsdp2_accelerator``: Accelerate honours an FSDP plugin only for
GPU-like distributed types); ``--backend deepspeed``: a DeepSpeed plugin of ZeRO
``--stage`` (gloo named as a CPU user names it, ``DS_ACCELERATOR=cpu``). The job trains
``--steps`` steps with torch AdamW and saves its last step through
``AcceleratorCheckpointer``; then every rank computes the logits of :func:`tokens` with the
prepared (sharded) model in eval mode, and rank 0 writes them to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

from stepvault.integrations.accelerate import AcceleratorCheckpointer

CONFIG = dict(
    vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
)  # fmt: skip


def tokens() -> torch.Tensor:
    """The fixed input whose logits the test compares."""
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=g)


def accelerator(backend: str, stage: int) -> Accelerator:
    if backend == "fsdp2":
        from accelerate_fsdp2_state import cpu_fsdp2_accelerator  # TEST-ONLY patch

        return cpu_fsdp2_accelerator()
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    plugin = DeepSpeedPlugin(
        hf_ds_config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10_000,
        }
    )
    return Accelerator(
        deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")]
    )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=["fsdp2", "deepspeed"], required=True)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--root", required=True)
    p.add_argument("--run", default="acc")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    torch.set_num_threads(1)
    acc = accelerator(args.backend, args.stage)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**CONFIG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    ckpt = AcceleratorCheckpointer(acc, args.root, run=args.run)
    g = torch.Generator().manual_seed(acc.process_index)
    for _ in range(args.steps):
        x = torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=g)
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    ckpt.save(args.steps, force=True)
    ckpt.close()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=tokens()).logits
    if acc.is_main_process:
        torch.save(logits.detach().clone(), args.out)
        print("DONE", flush=True)
    acc.wait_for_everyone()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # see tests/scripts/accelerate_ddp_state.py
