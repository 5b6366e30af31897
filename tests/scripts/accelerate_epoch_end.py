"""The documented Accelerate loop (stateful loader, seedable sampler, ``set_epoch``) as a
process of its own, for tests/test_accelerate_epoch_end.py.

    python accelerate_epoch_end.py --root R --steps 10 --log batches.jsonl [--kill-at 5]

12 samples in batches of 2, gradient accumulation 2: 3 optimizer steps an epoch. Every
step is saved (``--save at-step``, inside the loop, right after the optimizer step) or
every epoch once the loop has left it and counted it (``--save epoch-end``). With
``--kill-at k`` the process SIGKILLs itself once step k's checkpoint is committed; run
again with the same ``--root`` it resumes from it. Each batch goes to ``--log`` as a JSON
line (step, epoch, batch digest); at the end ``FINAL <json>`` gives the epoch counter and
a digest of the weights, the AdamW moments and the torch RNG.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

from stepvault import Every
from stepvault.integrations.accelerate import AcceleratorCheckpointer, load_state, save_state


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--save", choices=("at-step", "epoch-end"), default="at-step")
    p.add_argument("--one-shot", action="store_true", help="save_state/load_state")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--log", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)

    torch.manual_seed(0)
    acc = Accelerator(
        cpu=True,
        gradient_accumulation_steps=2,
        dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=True, use_seedable_sampler=True
        ),
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 4, generator=g)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    loader = DataLoader(
        data,
        batch_size=2,
        shuffle=True,
        num_workers=args.workers,
        generator=torch.Generator().manual_seed(5),
    )
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    torch.manual_seed(1000)  # the dropout masks: the checkpoint's RNG state

    progress = {"epoch": 0, "step": 0}
    ckpt = None
    if args.one_shot:
        load_state(acc, args.root, run="e", extra=progress, missing_ok=True)
    else:
        ckpt = AcceleratorCheckpointer(acc, args.root, run="e", extra=progress, save=Every(steps=1))
        ckpt.restore()
    print("RESTORED", json.dumps(progress), flush=True)

    def save(**kw) -> None:
        if ckpt is None:
            save_state(acc, args.root, run="e", step=progress["step"], extra=progress)
        else:
            ckpt.save(progress["step"], **kw)
            ckpt.wait()
        if progress["step"] == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    with open(args.log, "a") as log:
        while progress["step"] < args.steps:
            loader.set_epoch(progress["epoch"])
            for xb, yb in loader:
                log.write(json.dumps({**progress, "batch": digest(xb)}) + "\n")
                log.flush()
                with acc.accumulate(model):
                    loss = torch.nn.functional.mse_loss(model(xb), yb)
                    acc.backward(loss)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                if acc.sync_gradients:
                    progress["step"] += 1
                    if args.save == "at-step":
                        save()
            progress["epoch"] += 1
            if args.save == "epoch-end":
                save(epoch=progress["epoch"], force=True)
    if ckpt is not None:
        ckpt.close()
    state = [*model.state_dict().values()]
    state += [v for s in opt.state_dict()["state"].values() for v in s.values()]
    final = {**progress, "state": digest(*state, torch.get_rng_state())}
    print("FINAL", json.dumps(final), flush=True)


if __name__ == "__main__":
    main()
