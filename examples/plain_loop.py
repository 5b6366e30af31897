"""A hand-written training loop that resumes exactly where it stopped — even mid-epoch and
mid-way through a gradient-accumulation window.

    python examples/plain_loop.py --store ckpts                  # train (resumes if it can)
    python examples/plain_loop.py --store ckpts --kill-at 17     # die by SIGKILL at step 17
    python examples/plain_loop.py --store ckpts                  # ...and pick up again

What a checkpoint holds, and why each piece is needed for a bitwise-exact resume:

* ``model``, ``optimizer``, ``scheduler`` — the obvious part.
* ``scaler`` — ``torch.amp.GradScaler``: its scale and growth tracker decide whether the
  next optimizer step is skipped and how gradients are unscaled.
* ``grads`` — the gradients accumulated so far in the current accumulation window. A save
  that lands mid-window without them would resume with the window's first micro-batches
  forgotten.
* ``loader`` — torchdata's ``StatefulDataLoader``: its ``state_dict()`` (batches already
  yielded this epoch) is plain ints and tensors, so stepvault stores it as it is. Shuffling
  comes from an epoch-seeded sampler (``DistributedSampler(...).set_epoch(epoch)``): the
  order of every epoch is a function of (seed, epoch), so it is the same whether or not
  the run was interrupted. (``shuffle=True`` with a ``generator`` is *not* enough with
  torchdata 0.11: after a restore, later epochs are shuffled differently from an
  uninterrupted run, because the restored generator misses the draw each new iterator
  makes for its base seed.)
* ``rng`` — Python, numpy and torch RNGs (dropout masks).
* ``progress`` — epoch, micro-steps done, and a running digest of the sample ids consumed,
  which lets a test prove that the data order was preserved.

The save policy counts micro-batches: ``Every(steps=7)`` with 12 batches per epoch and
windows of 3 lands mid-epoch and mid-window (7, 14, 28, 35 ...), the awkward case.

AMP: on CUDA the loop uses float16 autocast with a ``GradScaler``. On CPU it does the same:
this torch (2.13) runs float16 autocast and ``torch.amp.GradScaler("cpu")`` on CPU, with the
same unscale / inf-check / skip / back-off / growth logic as on CUDA, so the scaler's state
is really exercised (a first scale of 2**20 overflows float16 and makes it skip and back
off; a bfloat16 loop would need no scaler at all). ``--no-amp`` turns both off
(``GradScaler(enabled=False)`` keeps the same code path with an empty state).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import sys
import warnings

import numpy as np
import torch
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import stepvault
from stepvault import CheckpointManager, Every, KeepLast, OnSignal

warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata 0.11 noise


class AccumulatedGrads:
    """The ``.grad`` of every parameter, as a stateful object for the checkpoint.

    Between two optimizer steps the gradients are training state: they hold the sum over
    the micro-batches seen so far in the window. Parameters without a gradient (right after
    ``zero_grad(set_to_none=True)``) are simply absent.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = dict(model.named_parameters())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: p.grad for name, p in self.params.items() if p.grad is not None}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        unknown = set(state) - set(self.params)
        if unknown:
            raise KeyError(f"gradients for unknown parameters: {sorted(unknown)}")
        for name, p in self.params.items():
            p.grad = state[name].detach().clone().to(p.device) if name in state else None


def make_data(samples: int) -> TensorDataset:
    """A fixed synthetic classification task; each sample carries its id."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 16, generator=g)
    y = (x[:, :4].sum(dim=1) > 0).long() + 2 * (x[:, 4] > 0).long()
    return TensorDataset(torch.arange(samples), x, y)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True, help="checkpoint store (a directory or URL)")
    p.add_argument("--run", default="plain")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--accum", type=int, default=3, help="micro-batches per optimizer step")
    p.add_argument("--save-every", type=int, default=7, help="save every N micro-batches")
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL itself after step N")
    p.add_argument("--no-amp", action="store_true")
    p.add_argument("--sync", action="store_true", help="synchronous saves")
    args = p.parse_args(argv)

    torch.set_num_threads(1)  # same arithmetic in every process, and kind to shared CPUs
    device = "cuda" if torch.cuda.is_available() else "cpu"
    use_amp = not args.no_amp

    # Seed every RNG the run may draw from (Python's is seeded from os.urandom otherwise);
    # after a resume, the restored RNGState replaces these.
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 4)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    batches_per_epoch = -(-args.samples // args.batch_size)
    total_updates = -(-args.epochs * batches_per_epoch // args.accum)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=total_updates)
    # A first scale that overflows float16 and a short growth interval, so that this small
    # run really skips steps, backs off and grows again: the scaler's state matters.
    scaler = torch.amp.GradScaler(device, init_scale=2.0**20, growth_interval=3, enabled=use_amp)

    data = make_data(args.samples)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    # The loader's own generator only feeds its per-iterator base seed; giving it one keeps
    # that draw off the global torch RNG (which dropout uses).
    loader = StatefulDataLoader(
        data, batch_size=args.batch_size, sampler=sampler, generator=torch.Generator()
    )

    state = {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "scaler": scaler,
        "grads": AccumulatedGrads(model),
        "loader": loader,
        "rng": stepvault.RNGState(),
        "progress": {"epoch": 0, "step": 0, "skipped_updates": 0, "data_digest": ""},
    }
    mgr = CheckpointManager(
        args.store,
        args.run,
        save=Every(steps=args.save_every) | OnSignal(),  # SIGTERM/SIGUSR1: save, then exit
        keep=KeepLast(3),
        async_save=not args.sync,
    )
    info = mgr.restore(state)
    progress = state["progress"]  # restore replaces plain values: read it after
    if info is None:
        print("FRESH", flush=True)
    else:
        done = progress["step"]
        print(
            f"RESUMED step={done} epoch={progress['epoch']} "
            f"batch={done - progress['epoch'] * batches_per_epoch}/{batches_per_epoch} "
            f"window={done % args.accum}/{args.accum}",
            flush=True,
        )

    loss_fn = torch.nn.CrossEntropyLoss()
    for epoch in range(progress["epoch"], args.epochs):
        progress["epoch"] = epoch
        sampler.set_epoch(epoch)  # this epoch's order; the loader skips what was consumed
        model.train()
        for ids, x, y in loader:
            x, y = x.to(device), y.to(device)
            with torch.autocast(device, dtype=torch.float16, enabled=use_amp):
                loss = loss_fn(model(x).float(), y) / args.accum
            scaler.scale(loss).backward()
            progress["step"] += 1
            progress["data_digest"] = hashlib.sha256(
                (progress["data_digest"] + "," + ",".join(map(str, ids.tolist()))).encode()
            ).hexdigest()
            if progress["step"] % args.accum == 0:  # end of an accumulation window
                scale = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                if not use_amp or scaler.get_scale() >= scale:
                    sched.step()
                else:  # inf/nan gradients: the scaler skipped the step and backed off
                    progress["skipped_updates"] += 1
            mgr.save(progress["step"], state, epoch=epoch, metrics={"loss": loss.item()})
            if args.kill_at is not None and progress["step"] == args.kill_at:
                print(f"KILLED step={progress['step']}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no flush: a hard crash
    progress["epoch"] = args.epochs
    mgr.wait()  # the last policy save may still be in flight
    if mgr.latest_step != progress["step"]:
        mgr.save(progress["step"], state, epoch=args.epochs, force=True)
    mgr.close()
    print(
        f"FINAL step={progress['step']} skipped_updates={progress['skipped_updates']} "
        f"scale={scaler.get_scale() if use_amp else None} "
        f"data={progress['data_digest'][:16]}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
