"""Run under torchrun with 2 processes: an Accelerator with an FSDP2 plugin (the model and
optimizer sharded by ``fully_shard``) saves through ``AcceleratorCheckpointer`` on every
rank, trains on, restores and trains the same steps again: every rank must draw the same
numbers and end with the same shards, bitwise (its own RNG state and shards, not rank 0's).

    python -m torch.distributed.run --standalone --nproc_per_node 2 accelerate_fsdp2_state.py \
        ROOT [NATIVE_DIR [IMPORTED_ROOT]]

With NATIVE_DIR, ``accelerator.save_state(NATIVE_DIR)`` also writes Accelerate's own FSDP
folders (``pytorch_model_fsdp_0/``, ``optimizer_0/``) of the step-3 state. With
IMPORTED_ROOT, rank 0 imports that folder with ``stepvault import`` (printing ``IMPORT``
and the CLI's output) and, after the stepvault check, every rank resumes with
Accelerate's own ``load_state`` of the folder and then through ``AcceleratorCheckpointer``
from the import: both must give the step-3 state and the same next steps, bitwise
(``IMPORT-RESUME <r> OK``).

Prints ``RANK <r> OK`` on each rank.

TEST-ONLY PATCH: Accelerate honours an FSDP plugin only for GPU-like distributed types;
on CPU processes it silently trains with DDP. ``cpu_fsdp2_accelerator`` sets the FSDP
distributed type and the plugin in Accelerate's shared state before ``prepare``, which
makes ``prepare`` apply ``fully_shard`` on CPU (gloo). Nothing of it belongs in the
package: on GPUs ``Accelerator(fsdp_plugin=...)`` is what users run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.tensor import DTensor

from stepvault.integrations.accelerate import AcceleratorCheckpointer


def cpu_fsdp2_accelerator() -> Accelerator:
    """TEST-ONLY: an Accelerator whose prepare() shards with FSDP2 on CPU processes."""
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True)
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    # Both shared states: every AcceleratorState() made later copies PartialState's type.
    PartialState().distributed_type = DistributedType.FSDP
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    return acc


def weights_digest(model: torch.nn.Module) -> str:
    """A hash of the full weights by name (a collective call under a process group; the
    same function of a plain module in one process)."""
    import hashlib

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    msd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    h = hashlib.sha256()
    for name in sorted(msd):
        h.update(name.encode())
        h.update(msd[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def build() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1)
    )


def snapshot(acc: Accelerator, model: torch.nn.Module, opt, sched) -> list[torch.Tensor]:
    """This rank's training state: its weight shards, its Adam moments and step counts in
    parameter order, the LR, accelerator.step and its RNG's next CPU state."""
    out = [p.to_local().detach().clone() for p in model.parameters()]
    for p in model.parameters():
        for _key, v in sorted(opt.optimizer.state[p].items()):
            out.append((v.to_local() if isinstance(v, DTensor) else v).detach().clone())
    lr = torch.tensor(sched.get_last_lr())
    return [*out, lr, torch.tensor(acc.step), torch.get_rng_state()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def main(root: str, native: str | None = None, imported: str | None = None) -> None:
    torch.manual_seed(0)
    acc = cpu_fsdp2_accelerator()
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    assert acc.is_fsdp2 and any(isinstance(p, DTensor) for p in model.parameters())
    torch.manual_seed(100 + acc.process_index)  # the ranks' RNGs differ

    def train(steps: int) -> list[torch.Tensor]:
        for _ in range(steps):
            loss = model(torch.randn(4, 4)).pow(2).mean()  # dropout: a draw per rank
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        shards = [p.to_local().detach().clone() for p in model.parameters()]
        moments = [
            v.to_local().clone()
            for s in opt.optimizer.state.values()
            for v in s.values()
            if isinstance(v, DTensor)
        ]
        return [*shards, *moments, torch.tensor(sched.get_last_lr()), torch.rand(3)]

    progress = {"epoch": 1}
    assert acc.is_fsdp2, acc.distributed_type  # the patch holds (see the top)
    ckpt = AcceleratorCheckpointer(acc, root, run="fsdp2", extra=progress, async_save=True)
    assert ckpt.restore() is None
    train(3)
    ckpt.save(3, force=True)
    ckpt.wait()
    saved = snapshot(acc, model, opt, sched)
    if native:  # Accelerate's own FSDP save of the same state (for the import test)
        acc.save_state(native)
        if imported and acc.is_main_process:  # the user's import of it, with the CLI
            cli = [sys.executable, "-m", "stepvault.cli.main", "--root", imported, "import"]
            done = subprocess.run(
                [*cli, native, "--run", "acc", "--step", "3", "--trust"],
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert done.returncode == 0, done.stderr
            print(f"IMPORT {done.stdout}", flush=True)
        acc.wait_for_everyone()
    weights = weights_digest(model)  # collective: the full weights at step 3
    if acc.is_main_process:
        print(f"WEIGHTS {weights}", flush=True)
    expected = train(4)
    progress["epoch"] = 7
    info = ckpt.restore()
    assert info is not None and info.step == 3 and progress == {"epoch": 1}, (info, progress)
    got = train(4)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), "not the same"
    ckpt.close()
    if native and imported:
        # Accelerate's own resume of its folder, then stepvault's resume of the import of
        # that folder: the same state (shards, Adam moments, LR, accelerator.step, this
        # rank's RNG) and the same next steps, bitwise.
        acc.load_state(native)
        assert same(snapshot(acc, model, opt, sched), saved), "Accelerate's own resume differs"
        own = train(4)
        assert same(own, expected), "Accelerate's own resume trains differently"
        train(2)  # move away from the saved state
        from_import = AcceleratorCheckpointer(acc, imported, run="acc", async_save=False)
        info = from_import.restore()
        assert info is not None and info.step == 3, info
        assert same(snapshot(acc, model, opt, sched), saved), "the import's resume differs"
        assert same(train(4), own), "the import's resume trains differently"
        from_import.close()
        print(f"IMPORT-RESUME {acc.process_index} OK", flush=True)
    print(f"RANK {acc.process_index} OK", flush=True)
    acc.wait_for_everyone()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    sys.stdout.flush()
    os._exit(0)  # see tests/scripts/accelerate_ddp_state.py
