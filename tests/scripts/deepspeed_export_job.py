"""A 2-rank DeepSpeed job on a tiny GPT-2, for tests/test_export_zero3.py: launch with
``python -m torch.distributed.run --standalone --nproc_per_node 2 deepspeed_export_job.py``
(gloo on CPU, ``DS_ACCELERATOR=cpu``).

The model has what makes a ZeRO-3 export hard: tied weights (``lm_head`` is
``transformer.wte``: one of DeepSpeed's ``shared_params``), a frozen parameter
(``transformer.wpe``: ZeRO-3 keeps it in each rank's ``frozen_param_fragments``), two
parameter groups (decay / no decay: two flat fp32 groups per rank), parameters whose
element count is odd (partition padding on the last rank) and buffers. It trains a few
steps with torch AdamW, saves its last step through :class:`DeepSpeedCheckpointer`, then
(the checkpointer closed, DeepSpeed's own engine back) DeepSpeed's own ``save_checkpoint``
of the same state into ``--native``. Rank 0 writes the model's logits on a fixed input
(computed by the ZeRO engine itself, eval mode) to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

#: the model (the test builds the same config); n_embd 255 and vocab 509 make most element
#: counts odd, so the last rank's slice of each is padded
CONFIG = dict(
    vocab_size=509, n_positions=32, n_embd=255, n_layer=3, n_head=5, resid_pdrop=0.0,
    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
)  # fmt: skip


def tokens() -> torch.Tensor:
    """The fixed input whose logits the test compares."""
    return torch.randint(
        0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(7)
    )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--run", default="z3")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--native", default="", help="DeepSpeed's own save of the final state")
    p.add_argument("--out", default="", help="rank 0: the engine's logits on tokens()")
    args = p.parse_args()

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**CONFIG))
    model.transformer.wpe.weight.requires_grad_(False)  # a frozen parameter
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2
    )
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    from stepvault.integrations.deepspeed import DeepSpeedCheckpointer
    from stepvault.policy import Every

    ckpt = DeepSpeedCheckpointer(engine, args.root, args.run, save=Every(steps=args.steps))
    g = torch.Generator().manual_seed(rank)
    while engine.global_steps < args.steps:
        x = torch.randint(0, CONFIG["vocab_size"], (2, 16), generator=g)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        ckpt.save()
    ckpt.close()  # waits for the commit and gives DeepSpeed back its own engine
    if args.native:
        engine.save_checkpoint(args.native)
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=tokens()).logits
    if rank == 0 and args.out:
        torch.save(logits, args.out)
        print("DONE", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
