"""stepvault demo: train, get killed, resume from the newest checkpoint that verifies.

    python examples/demo.py [--store DIR]

1. starts a training process (a small MLP with dropout, AdamW, a cosine schedule and a
   shuffled data loader) that checkpoints every 100 steps through a ``CheckpointManager``
   (asynchronous saves, keep the last 4 and the best 2 by loss);
2. kills it with SIGKILL in the middle of the run, the way a failing node dies;
3. damages the newest checkpoint (one flipped bit, as bit rot would) to show that a
   broken checkpoint is detected and skipped, never loaded;
4. restarts training, which resumes from the newest *valid* checkpoint and finishes;
5. prints what the store holds (the ``stepvault ls``, ``du`` and ``verify`` commands).

Only the public API is used (``CheckpointManager``, ``stepvault.open/verify``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

from stepvault.manager.options import GCOptions, ManagerOptions

RUN = "demo"
TOTAL_STEPS = 1500
SAVE_EVERY = 100
KILL_AFTER_CHECKPOINTS = 6


# --------------------------------------------------------------------------- training
def train(store: str) -> None:
    import math

    import torch

    import stepvault

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(512, 10),
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=TOTAL_STEPS)
    # A synthetic classification task; the data order is part of the checkpoint.
    g = torch.Generator().manual_seed(42)
    inputs = torch.randn(4096, 64, generator=g)
    labels = (inputs[:, :10] @ torch.randn(10, 10, generator=g)).argmax(dim=1)
    shuffle = torch.Generator().manual_seed(7)
    data = {"epoch": 0, "position": 0, "order": torch.randperm(4096, generator=shuffle)}
    state = {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "rng": stepvault.RNGState(generators=[shuffle]),
        "data": data,
        "step": 0,
    }

    mgr = stepvault.CheckpointManager(
        store, RUN,
        save=stepvault.Every(steps=SAVE_EVERY) | stepvault.LastStep(),
        keep=stepvault.KeepLast(4) | stepvault.KeepBest(2, metric="loss"),
        async_save=True, codec="auto", total_steps=TOTAL_STEPS,
        options=ManagerOptions(gc=GCOptions(grace_seconds=0)),
    )  # fmt: skip
    info = mgr.restore(state)
    if info is None:
        print("[train] no checkpoint yet: fresh start", flush=True)
    else:
        for s in info.skipped:
            print(f"[train] skipped damaged checkpoint {RUN}@{s.step}: {s.reason}", flush=True)
        print(
            f"[train] resumed from {RUN}@{info.step} (loss then: "
            f"{info.metrics.get('loss', math.nan):.4f}) in {info.seconds:.2f}s",
            flush=True,
        )
    data, step = state["data"], state["step"]
    model.train()
    while step < TOTAL_STEPS:
        if data["position"] + 64 > 4096:  # next epoch: a new order from the saved generator
            data.update(
                epoch=data["epoch"] + 1, position=0, order=torch.randperm(4096, generator=shuffle)
            )
        idx = data["order"][data["position"] : data["position"] + 64]
        data["position"] += 64
        loss = torch.nn.functional.cross_entropy(model(inputs[idx]), labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        state["step"] = step
        handle = mgr.save(step, state, epoch=data["epoch"], metrics={"loss": loss.item()})
        if handle is not None:
            print(
                f"[train] step {step:5d} loss {loss.item():.4f}  checkpoint started; "
                f"training waited {handle.stall_seconds * 1000:.1f} ms",
                flush=True,
            )
            if info is not None and step == info.step + SAVE_EVERY:
                new = handle.result().new_bytes  # wait, just this once, to show the dedup
                print(
                    f"[train]   re-saved step {step}: only {new / 1024:.0f} KiB new - every "
                    "other chunk equals the lost checkpoint, so the resume is bitwise exact",
                    flush=True,
                )
        time.sleep(0.01)  # pace the demo so a run takes about a minute
    mgr.close()
    stats = mgr.stats()
    print(
        f"[train] finished {TOTAL_STEPS} steps; {stats['saves']} saves in this process, "
        f"mean stall {stats['mean_stall_seconds'] * 1000:.1f} ms, mean write "
        f"{stats['mean_write_seconds'] * 1000:.0f} ms; {stats['deleted_checkpoints']} old "
        "checkpoints deleted by the keep policy",
        flush=True,
    )


# ------------------------------------------------------------------------- orchestration
def _stepvault(*args: str) -> None:
    cmd = [sys.executable, "-m", "stepvault.cli.main", *args]
    print(f"\n$ stepvault {' '.join(args)}", flush=True)
    subprocess.run(cmd, check=False)


def main() -> int:
    import stepvault

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="demo-store", help="store directory (recreated)")
    parser.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train:
        train(args.store)
        return 0

    shutil.rmtree(args.store, ignore_errors=True)
    child_cmd = [sys.executable, os.path.abspath(__file__), "--train", "--store", args.store]
    print(
        f"== 1. training in a subprocess, checkpoints every {SAVE_EVERY} steps into {args.store}/",
        flush=True,
    )
    child = subprocess.Popen(child_cmd)
    while child.poll() is None:
        try:
            steps = stepvault.open(args.store).steps(RUN)
        except stepvault.errors.StepvaultError:
            steps = []
        if steps and steps[-1] >= KILL_AFTER_CHECKPOINTS * SAVE_EVERY:
            break
        time.sleep(0.05)
    time.sleep(0.5)  # somewhere between two checkpoints
    child.send_signal(signal.SIGKILL)
    child.wait()
    vault = stepvault.open(args.store)
    steps = vault.steps(RUN)
    print(
        f"\n== 2. killed with SIGKILL (exit {child.returncode}); committed checkpoints: {steps}",
        flush=True,
    )

    newest = steps[-1]
    unique = set(vault.manifest(RUN, newest).objects) - set(vault.manifest(RUN, steps[-2]).objects)
    victim = sorted(unique)[0]
    path = os.path.join(args.store, "objects", victim[:2], victim)
    with open(path, "r+b") as f:  # flip one bit near the end of the object
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x08]))
    print(
        f"\n== 3. flipped one bit in object {victim[:16]}… of {RUN}@{newest} (bit rot)", flush=True
    )
    report = stepvault.ops.verify(args.store, deep=True)
    print(
        f"   deep verify: damaged checkpoints: {[f'{c.run}@{c.step}' for c in report.damaged]}",
        flush=True,
    )

    print(
        "\n== 4. restarting training: it resumes from the newest checkpoint that verifies",
        flush=True,
    )
    rc = subprocess.run(child_cmd, check=False).returncode
    if rc != 0:
        print(f"training failed with exit code {rc}", file=sys.stderr)
        return rc

    print("\n== 5. what the store holds", flush=True)
    _stepvault("--root", args.store, "ls", RUN)
    _stepvault("--root", args.store, "du")
    _stepvault("--root", args.store, "verify", "--deep")
    _stepvault("--root", args.store, "events", RUN, "--tail", "6")
    print(
        f"\nThe damaged object of {RUN}@{newest} was quarantined, the resumed run wrote step "
        f"{newest} again, and the keep policy (last 4 + best 2 by loss) deleted the rest.",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
