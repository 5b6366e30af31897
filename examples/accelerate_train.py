"""A hand-written training loop on Hugging Face Accelerate, checkpointing through stepvault.

    python examples/accelerate_train.py --root ckpts --run acc-demo --steps 100

Gradient accumulation, a shuffled stateful data loader (its position is saved), dropout
and a scheduler. Kill it and run the same command again: it resumes from the newest checkpoint
that verifies and ends with the same weights, bit for bit, as an uninterrupted run.

With two processes (DDP, gloo on CPU), under ``accelerate launch`` or

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        examples/accelerate_train.py --run-name acc-demo

every rank saves and restores together (replicated tensors are written once; each rank's
RNG state and data position are its own).
"""

from __future__ import annotations

import argparse
import hashlib
import time

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

from stepvault import Every, KeepLast, OnSignal
from stepvault.integrations.accelerate import AcceleratorCheckpointer


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="ckpts")
    p.add_argument("--run", "--run-name", default="acc-demo")  # torchrun rejects "--run"
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()

    torch.manual_seed(0)
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=2,
        # A stateful loader saves its position in the epoch; the seedable sampler makes each
        # epoch's shuffle a function of (seed, epoch), so a resumed epoch has the same order.
        dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=True, use_seedable_sampler=True
        ),
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = x.sum(dim=1, keepdim=True)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
    # The loader's own generator: building its iterator then never draws from the global
    # RNG, which dropout uses and the checkpoint restores.
    loader = DataLoader(
        TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    # Each rank its own dropout masks (as it would draw its own augmentations); a restore
    # gives every rank back its own RNG state.
    torch.manual_seed(1000 + accelerator.process_index)

    progress = {"epoch": 0, "step": 0}  # plain values, saved and restored with the rest
    ckpt = AcceleratorCheckpointer(
        accelerator,
        args.root,
        run=args.run,
        extra=progress,
        save=Every(steps=args.save_every) | OnSignal(),
        keep=KeepLast(args.keep),
    )
    info = ckpt.restore()
    if accelerator.is_main_process:
        print(f"RESUMED {info.step}" if info else "FRESH", flush=True)
    while progress["step"] < args.steps:
        loader.set_epoch(progress["epoch"])  # the shuffle order of this epoch
        for xb, yb in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            if accelerator.sync_gradients:  # an optimizer step happened: a step boundary
                progress["step"] += 1
                time.sleep(args.step_sleep)
                ckpt.save(progress["step"], epoch=progress["epoch"], metrics={"loss": loss})
                if progress["step"] >= args.steps:
                    break
        else:
            progress["epoch"] += 1
    ckpt.close()
    if accelerator.is_main_process:
        print(f"FINAL {digest(accelerator.unwrap_model(model))}", flush=True)
    # Destroys the process group: a gloo group left to the interpreter's exit can abort
    # the process after the job finished.
    accelerator.end_training()


if __name__ == "__main__":
    main()
