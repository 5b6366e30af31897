"""A 2-rank Accelerate job with an FSDP1 plugin for tests/test_sharded_accelerate.py:

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        accelerate_fsdp1_train.py --root DIR [--steps 20] [--orig-params] [--out FILE]

``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1, ...))`` wraps a
small MLP with dropout (every rank's RNG matters) in ``FullyShardedDataParallel`` (each
Linear its own unit; flat parameters, or the original ones with ``--orig-params``), with
torch AdamW and a StepLR scheduler; data is drawn by step from a per-epoch permutation (8
batches an epoch, so runs cross epoch boundaries). ``AcceleratorCheckpointer`` saves every
``--save-every`` steps (asynchronously) with ``extra={"epoch": ...}`` and resumes at start.
Rank 0 prints ``FRESH`` / ``RESUMED <step> epoch=<e> skipped=<n>``; at the end it writes
the full weights, both Adam moments of every parameter (by name), the scheduler's LR,
``accelerator.step`` and a draw of each rank's torch RNG to ``--out`` (``torch.save``).

With ``--native DIR --imported ROOT`` (issue 30: resuming an imported FSDP1 folder), after
the last step ``accelerator.save_state(DIR)`` writes Accelerate's own FSDP1 folders
(``pytorch_model_fsdp_0/``, ``optimizer_0/``, ``scheduler.bin``, ``random_states_<r>.pkl``),
rank 0 imports it into ROOT as ``--run`` with ``stepvault import`` (printing ``IMPORT`` and
the CLI's output) and every rank trains 4 steps on (the uninterrupted run, whose state
then goes to ``--out``), resumes with Accelerate's own ``load_state`` of the folder
(printing ``OWN-RESUME <r>`` and what of its state differs from the saved one), trains 4
steps, then resumes through ``AcceleratorCheckpointer`` from the import: its local shards,
Adam moments, LR, ``accelerator.step`` and RNG must equal those at the save and the next 4
steps the uninterrupted ones, bitwise (``IMPORT-RESUME <r> OK``). Before that, with
``--mismatched ROOT2``, a restore from ROOT2 (a one-process checkpoint that does not fit)
must be refused on every rank (``REFUSED <r> <message>``) and change nothing. ``--root ROOT
--not-strict`` then resumes from the import in new processes (``restore(strict=False)``:
the import holds no ``extra``, which keeps its values).

Other layouts (issue 30): ``--sharding SHARD_GRAD_OP`` wraps with that FSDP1 strategy,
``--sharding ddp`` runs the same job without the FSDP plugin (Accelerate's DDP), and
``--out-resumed FILE`` writes what ``--out`` holds right after the restore (the state the
training starts from; the RNG draw is undone so the steps that follow are unchanged).
Under torchrun with ``--nproc_per_node 4`` the same job resumes a 2-rank checkpoint.

TEST-ONLY PATCH: Accelerate honours an FSDP plugin only for GPU-like distributed types;
on CPU processes it silently trains with DDP. ``cpu_fsdp1_accelerator`` sets the FSDP
distributed type and the plugin in Accelerate's shared state (as
accelerate_fsdp2_state.py does), and the device to plain ``cpu`` (FSDP1 refuses a
``device_id`` of ``cpu:0`` for parameters on ``cpu``). Nothing of it belongs in the
package: on GPUs ``Accelerator(fsdp_plugin=...)`` is what users run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn.parallel import DistributedDataParallel as DDP

from stepvault.errors import StateMismatchError
from stepvault.integrations.accelerate import AcceleratorCheckpointer
from stepvault.policy import Every, KeepLast

BATCHES_PER_EPOCH = 8


def cpu_fsdp1_accelerator(orig_params: bool, sharding: str = "FULL_SHARD") -> Accelerator:
    """TEST-ONLY: an Accelerator whose prepare() wraps with FSDP1 on CPU processes
    (``sharding``: FSDP1's ``FULL_SHARD`` or ``SHARD_GRAD_OP``; ``ddp``: no FSDP plugin,
    the same job under Accelerate's DDP)."""
    if sharding == "ddp":
        return Accelerator(cpu=True)  # torchrun's processes: MULTI_CPU, prepare() wraps in DDP
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=1,
        sharding_strategy=sharding,
        state_dict_type="SHARDED_STATE_DICT",
        use_orig_params=orig_params,
        sync_module_states=False,  # FSDP1 syncs module states on a GPU only
        auto_wrap_policy="size_based_wrap",
        min_num_params=100,
    )
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    # Both shared states: every AcceleratorState() made later copies PartialState's.
    PartialState().distributed_type = DistributedType.FSDP
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    PartialState().device = acc.state.device = torch.device("cpu")
    return acc


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 8)
    )


def batch(step: int, rank: int) -> torch.Tensor:
    epoch, index = divmod(step, BATCHES_PER_EPOCH)
    order = torch.randperm(BATCHES_PER_EPOCH, generator=torch.Generator().manual_seed(epoch))
    g = torch.Generator().manual_seed(1000 * int(order[index]) + rank)
    return torch.randn(4, 16, generator=g)


def final_state(accelerator: Accelerator, model, opt, sched) -> dict[str, torch.Tensor]:
    """The job's state for ``--out`` (collective): full weights, both Adam moments by
    parameter name, the LR, a draw of every rank's torch RNG and accelerator.step."""
    full_options = StateDictOptions(full_state_dict=True)
    full: dict[str, torch.Tensor] = {}
    for name, t in get_model_state_dict(model, options=full_options).items():
        full[name] = t.clone()
    osd = get_optimizer_state_dict(model, opt, options=full_options)
    for name, s in osd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            full[f"{name}.{key}"] = s[key].clone()
    full["lr"] = torch.tensor(sched.get_last_lr())
    draws = [torch.zeros(4) for _ in range(dist.get_world_size())]
    dist.all_gather(draws, torch.rand(4))  # every rank's RNG, where the run left it
    full["rng"] = torch.stack(draws)
    full["accelerate_step"] = torch.tensor(accelerator.step)
    return full


CLIP = 0.0  # --clip: accelerator.clip_grad_norm_ to this norm before each step (0: none)


def train_step(accelerator: Accelerator, model, opt, sched, step: int, rank: int) -> torch.Tensor:
    """One optimizer step on the batch of ``step``; its loss."""
    x = batch(step, rank)
    loss = (model(x) - x[:, :8].sin()).square().mean()
    accelerator.backward(loss)
    if CLIP:  # FSDP1: the wrapper's clip_grad_norm_ (norm from the shards); DDP: torch's
        accelerator.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    sched.step()
    opt.zero_grad()
    return loss.detach()


def snapshot(accelerator: Accelerator, model, opt, sched) -> dict[str, torch.Tensor]:
    """This rank's training state as FSDP1 holds it: its local (flat or original) parameter
    shards, their Adam state (moments and step), the LR, accelerator.step and its torch RNG."""
    out: dict[str, torch.Tensor] = {}
    for i, p in enumerate(model.parameters()):
        out[f"param{i}"] = p.detach().clone()
        for key, v in sorted(opt.optimizer.state[p].items()):
            out[f"param{i}.{key}"] = torch.as_tensor(v).detach().clone()
    out["lr"] = torch.tensor(sched.get_last_lr())
    out["accelerate_step"] = torch.tensor(accelerator.step)
    out["rng"] = torch.get_rng_state()
    return out


def differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors are not bitwise equal (or only one side has)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not
                  torch.equal(a[k], b[k]))  # fmt: skip


def resume_from_import(
    accelerator: Accelerator, model, opt, sched, step: int, rank: int, args: argparse.Namespace
) -> None:
    """Accelerate's own FSDP1 save of this state, imported and resumed (see the top)."""
    saved = snapshot(accelerator, model, opt, sched)
    native, imported = args.native, args.imported
    accelerator.save_state(native)
    if rank == 0:  # the user's import of it, with the CLI
        cli = [sys.executable, "-m", "stepvault.cli.main", "--root", imported, "import"]
        done = subprocess.run(
            [*cli, native, "--run", args.run, "--step", str(step), "--trust"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
        print(f"IMPORT {done.stdout}", flush=True)
    accelerator.wait_for_everyone()

    def train(n: int) -> dict[str, torch.Tensor]:
        losses = [train_step(accelerator, model, opt, sched, step + i, rank) for i in range(n)]
        return {**snapshot(accelerator, model, opt, sched), "losses": torch.stack(losses)}

    expected = train(4)  # the uninterrupted run
    uninterrupted = final_state(accelerator, model, opt, sched)  # draws from the RNG: after
    if rank == 0 and args.out:
        torch.save(uninterrupted, args.out)
    accelerator.load_state(native)  # Accelerate's own resume of its folder
    own = differ(snapshot(accelerator, model, opt, sched), saved)
    own_next = differ(train(4), expected)
    print(f"OWN-RESUME {rank} state differs: {own} next steps differ: {own_next}", flush=True)
    if args.mismatched:  # a one-process checkpoint that does not fit: refused, nothing changed
        before = snapshot(accelerator, model, opt, sched)
        other = AcceleratorCheckpointer(accelerator, args.mismatched, run=args.run)
        try:
            other.restore(strict=False)
        except StateMismatchError as exc:
            print(f"REFUSED {rank} {exc}".replace("\n", " "), flush=True)
        else:
            raise AssertionError(f"rank {rank}: {args.mismatched} was restored")
        other.close()
        wrong = differ(snapshot(accelerator, model, opt, sched), before)
        assert not wrong, f"rank {rank}: a refused restore changed {wrong}"
    from_import = AcceleratorCheckpointer(accelerator, imported, run=args.run, async_save=False)
    info = from_import.restore()
    assert info is not None and info.step == step, info
    wrong = differ(snapshot(accelerator, model, opt, sched), saved)
    assert not wrong, f"rank {rank}: the import's resume differs in {wrong}"
    wrong = differ(train(4), expected)
    assert not wrong, f"rank {rank}: the import's resume trains differently: {wrong}"
    from_import.close()
    print(f"IMPORT-RESUME {rank} OK", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--run", default="accfsdp1")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--orig-params", action="store_true")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step")
    p.add_argument("--out", default="")
    p.add_argument("--native", default="", help="save_state folder to import and resume")
    p.add_argument("--imported", default="", help="store the --native folder is imported to")
    p.add_argument("--mismatched", default="", help="a store whose checkpoint must be refused")
    p.add_argument(
        "--not-strict", action="store_true", help="restore(strict=False): an import has no extra"
    )
    p.add_argument(
        "--sharding",
        default="FULL_SHARD",
        choices=["FULL_SHARD", "SHARD_GRAD_OP", "ddp"],
        help="FSDP1's sharding strategy, or ddp: the same job without the FSDP plugin",
    )
    p.add_argument("--out-resumed", default="", help="the state right after the restore")
    p.add_argument("--clip", type=float, default=0.0, help="clip the gradient norm to this")
    args = p.parse_args()

    global CLIP
    CLIP = args.clip
    torch.set_num_threads(1)
    accelerator = cpu_fsdp1_accelerator(args.orig_params, args.sharding)
    rank = dist.get_rank()
    # FSDP1 replaces the parameters (flat ones): the model first, then its optimizer
    model = accelerator.prepare(build())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    opt, sched = accelerator.prepare(opt, sched)
    if args.sharding == "ddp":
        assert isinstance(model, DDP), model
    else:
        assert isinstance(model, FSDP) and len(FSDP.fsdp_modules(model)) == 3, model  # FSDP1
    torch.manual_seed(100 + rank)  # the ranks' RNGs differ

    progress = {"epoch": 0}
    ckpt = AcceleratorCheckpointer(
        accelerator,
        args.root,
        run=args.run,
        save=Every(steps=args.save_every),
        keep=KeepLast(3),
        extra=progress,
    )
    info = ckpt.restore(strict=not args.not_strict)
    step = 0 if info is None else info.step
    if rank == 0:
        print(
            "FRESH"
            if info is None
            else f"RESUMED {info.step} epoch={progress['epoch']} skipped={len(info.skipped)}",
            flush=True,
        )
    if args.out_resumed:  # what training starts from (collective: every rank's RNG draw)
        rng = torch.get_rng_state()
        resumed = final_state(accelerator, model, opt, sched)
        torch.set_rng_state(rng)  # the draw must not change the steps that follow
        if rank == 0:
            torch.save(resumed, args.out_resumed)

    while step < args.steps:
        if args.step_sleep:
            time.sleep(args.step_sleep)
        loss = train_step(accelerator, model, opt, sched, step, rank)
        step += 1
        progress["epoch"] = step // BATCHES_PER_EPOCH
        if ckpt.save(step, epoch=progress["epoch"], metrics={"loss": loss.item()}):
            ckpt.wait()  # committed before the test looks

    if args.native:  # the import check (see the top) writes --out
        ckpt.close()
        resume_from_import(accelerator, model, opt, sched, step, rank, args)
    else:
        full = final_state(accelerator, model, opt, sched)
        ckpt.close()
        if rank == 0 and args.out:
            torch.save(full, args.out)
            print("DONE", flush=True)
    dist.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # see tests/scripts/accelerate_ddp_state.py
