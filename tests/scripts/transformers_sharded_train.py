"""A 2-rank Hugging Face ``Trainer`` job with a sharded model, for
tests/test_sharded_transformers.py: launch with ``python -m torch.distributed.run
--standalone --nproc_per_node 2 transformers_sharded_train.py ...`` (gloo on CPU,
``DS_ACCELERATOR=cpu``).

A tiny GPT-2 (built here, no download; dropout on, so every rank's RNG matters) trained
by the Trainer itself on 40 token rows, 4 per device: 5 optimizer steps an epoch on 2
ranks, so a run of 12 steps crosses two epoch boundaries. ``--shard zero1|zero2|zero3``:
DeepSpeed ZeRO through ``TrainingArguments(deepspeed=...)``; ``--shard fsdp2``: FSDP2
through ``TrainingArguments(fsdp=True, fsdp_config={"version": 2})``; ``--shard fsdp1``: FSDP1
(flat parameters) through ``fsdp="full_shard"``, ``fsdp_config={"version": 1}``.

``--backend stepvault`` checkpoints through :class:`StepvaultTrainer` +
:class:`StepvaultCallback` (``Every(steps=--save-every)``); ``--backend native`` through
the Trainer's own ``checkpoint-N`` folders (``save_steps``), for comparison. ``--resume``:
``train(resume_from_checkpoint=True)``. ``--hold-after N``: once the checkpoint of step N
is committed, rank 0 prints ``COMMITTED N`` and every rank waits to be killed
(``--pid-dir``: each rank writes its pid there). At the end rank 0 writes ``--final``
(``torch.save``): the full weights, the optimizer's moments by parameter name, the
scheduler's last LR and every rank's next RNG draw; ``RESUMED <step> skipped=<n>`` is
printed after a stepvault resume.

TEST-ONLY PATCH (fsdp2): Accelerate honours an FSDP plugin only for GPU-like distributed
types; on CPU processes the Trainer silently trains with DDP. ``_cpu_fsdp2`` sets the FSDP
distributed type in Accelerate's shared state (as tests/scripts/accelerate_fsdp2_state.py
does) before the Trainer prepares the model, so that ``fully_shard`` runs on CPU (gloo).
Nothing of it belongs in the package: on GPUs ``TrainingArguments(fsdp=...)`` is what
users run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from stepvault import Every, KeepLast, OnSignal
from stepvault.integrations.transformers import StepvaultCallback, StepvaultTrainer


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 64, (40, 16), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class Hold(TrainerCallback):
    """After the checkpoint of ``step`` is committed: say so and wait to be killed."""

    def __init__(self, step: int, ckpt: StepvaultCallback | None, out: str) -> None:
        self.step, self.ckpt, self.out = step, ckpt, out

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.step + 1:
            return
        if self.ckpt is not None and self.ckpt.manager is not None:
            self.ckpt.manager.wait()
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"COMMITTED {self.step}", flush=True)
        time.sleep(600)


class Sleep(TrainerCallback):
    """Slow steps, for a signal to land mid-run."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        if dist.get_rank() == 0:
            print(f"STEP {state.global_step}", flush=True)
        time.sleep(self.seconds)


def _cpu_fsdp2() -> None:
    """TEST-ONLY: make Accelerate shard with FSDP2 on CPU processes (see the top)."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    real_init = AcceleratorState.__init__

    def init(self, *a, fsdp_plugin=None, **kw):
        real_init(self, *a, fsdp_plugin=fsdp_plugin, **kw)
        if fsdp_plugin is not None:  # accelerate keeps it for GPU-like types only
            # Both shared states: every AcceleratorState() made later copies PartialState's.
            PartialState().distributed_type = DistributedType.FSDP
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            if getattr(fsdp_plugin, "fsdp_version", 1) == 1:
                # FSDP1 compares its device_id (Accelerate's "cpu:<local rank>") with the
                # parameters' device ("cpu") and refuses the difference
                PartialState().device = self.device = torch.device("cpu")

    AcceleratorState.__init__ = init  # type: ignore[method-assign]


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def _final(trainer: Trainer, shard: str) -> dict[str, torch.Tensor]:
    """Full weights, the optimizer's moments by parameter name, the LR and every rank's
    next RNG draw (collective)."""
    out: dict[str, torch.Tensor] = {}
    if shard.startswith("zero"):
        from deepspeed.utils import safe_get_full_fp32_param

        engine = trainer.model_wrapped
        for name, p in engine.module.named_parameters():
            out[f"w.{name}"] = safe_get_full_fp32_param(p).clone()
        # Every rank's partition: the flat fp32 groups and their Adam moments, as the
        # base optimizer holds them
        base = engine.optimizer.optimizer
        mine = {}
        for g, group in enumerate(base.param_groups):
            for i, flat in enumerate(group["params"]):
                mine[f"fp32.{g}.{i}"] = flat.detach().clone()
                for key, value in base.state.get(flat, {}).items():
                    if torch.is_tensor(value):
                        mine[f"{key}.{g}.{i}"] = value.clone()
        ranks: list = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        for r, part in enumerate(ranks):
            for key, value in part.items():
                out[f"rank{r}.{key}"] = value
    else:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True, cpu_offload=False)
        for name, t in get_model_state_dict(trainer.model, options=full).items():
            out[f"w.{name}"] = t.clone()
        osd = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=full)
        for name, s in osd["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{key}.{name}"] = s[key].clone()
    out["lr"] = torch.tensor(trainer.lr_scheduler.get_last_lr())
    draws = [torch.zeros(3) for _ in range(dist.get_world_size())]
    dist.all_gather(draws, torch.rand(3))
    for r, d in enumerate(draws):
        out[f"rng.rank{r}"] = d
    return out


def _count_reads(folder: str, rank: int) -> None:
    """Record every object this rank reads from the store (one ``<digest>`` line per read,
    in ``folder/rank<r>.txt``): the test counts how often a resume reads each object.
    Instrumentation only; the reads themselves are unchanged."""
    from stepvault.store import Store

    for name in ("read_object", "map_object"):
        real = getattr(Store, name)

        def counted(self, digest, *a, _real=real, **kw):
            with open(os.path.join(folder, f"rank{rank}.txt"), "a") as f:
                f.write(digest + "\n")
            return _real(self, digest, *a, **kw)

        setattr(Store, name, counted)


def _fsdp1_refused(root: str) -> int:
    """One process, FSDP1: StepvaultTrainer refuses it when train() starts (a sharded job
    saves collectively, on 2 or more ranks); prints why."""
    from stepvault.errors import StepvaultError

    _cpu_fsdp2()
    args = TrainingArguments(
        output_dir=os.path.join(root, "out"),
        max_steps=2,
        use_cpu=True,
        report_to=[],
        fsdp=True,
        # FSDP1 syncs module states on a GPU only
        fsdp_config={"version": 1, "sync_module_states": False},
    )
    ckpt = StepvaultCallback(root, run="gpt")
    trainer = StepvaultTrainer(model=_model(), args=args, train_dataset=Tokens(), callbacks=[ckpt])
    try:
        trainer.train()
    except StepvaultError as exc:
        print(f"REFUSED {exc}", flush=True)
        return 0
    return 1


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shard", choices=["zero1", "zero2", "zero3", "fsdp2", "fsdp1"], required=True)
    p.add_argument("--backend", choices=["stepvault", "native"], default="stepvault")
    p.add_argument("--root", required=True, help="the store (stepvault) or output_dir")
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--state-dict-type", default="FULL_STATE_DICT", help="FSDP, native saves")
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--hold-after", type=int, default=0)
    p.add_argument("--pid-dir", default="")
    p.add_argument("--final", default="")
    p.add_argument("--fsdp1-refused", action="store_true", help="one process, FSDP1: refused")
    p.add_argument("--on-signal", action="store_true", help="the policy also saves on SIGTERM")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step")
    p.add_argument("--reads-dir", default="", help="record each object read (per rank)")
    args = p.parse_args()
    if args.fsdp1_refused:
        return _fsdp1_refused(args.root)

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if args.reads_dir:
        _count_reads(args.reads_dir, rank)
    if args.pid_dir:  # torchrun starts its workers in sessions of their own
        with open(os.path.join(args.pid_dir, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    options: dict = dict(
        output_dir=os.path.join(args.root, "out") if args.backend == "stepvault" else args.root,
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        warmup_steps=2,
        report_to=[],
        use_cpu=True,
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        ddp_backend="gloo",
        save_strategy="no" if args.backend == "stepvault" else "steps",
        save_steps=args.save_every,
    )
    if args.shard.startswith("zero"):
        options["deepspeed"] = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": int(args.shard[-1])},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10_000,
        }
    elif args.shard == "fsdp2":
        _cpu_fsdp2()
        options["fsdp"] = True
        options["fsdp_config"] = {"version": 2, "reshard_after_forward": True}
        if args.state_dict_type != "FULL_STATE_DICT":  # the Trainer's own save's layout
            options["fsdp_config"]["state_dict_type"] = args.state_dict_type
    else:  # FSDP1, flat parameters (use_orig_params=False), each GPT-2 block wrapped
        _cpu_fsdp2()
        options["fsdp"] = "full_shard"
        options["fsdp_config"] = {
            "version": 1,
            "use_orig_params": False,
            "sync_module_states": False,  # FSDP1 syncs module states on a GPU only
            "transformer_layer_cls_to_wrap": ["GPT2Block"],
        }
        if args.state_dict_type != "FULL_STATE_DICT":  # FULL: torch's FSDP1 fails on CPU
            options["fsdp_config"]["state_dict_type"] = args.state_dict_type
    training_args = TrainingArguments(**options)
    callbacks: list = []
    ckpt = None
    if args.backend == "stepvault":
        policy = Every(steps=args.save_every)
        if args.on_signal:
            policy = policy | OnSignal()  # then every rank exits with the policy's code
        ckpt = StepvaultCallback(args.root, run="gpt", save=policy, keep=KeepLast(3))
        callbacks.append(ckpt)
    if args.step_sleep:
        callbacks.append(Sleep(args.step_sleep))
    if args.hold_after:
        callbacks.append(Hold(args.hold_after, ckpt, args.root))
    cls = StepvaultTrainer if args.backend == "stepvault" else Trainer
    trainer = cls(model=_model(), args=training_args, train_dataset=Tokens(), callbacks=callbacks)
    if args.backend == "stepvault":
        assert ckpt is not None
        trainer.train(resume_from_checkpoint=ckpt.has_checkpoint if args.resume else None)
        info = ckpt.last_restore
        if info is not None and rank == 0:
            print(f"RESUMED {info.step} skipped={len(info.skipped)}", flush=True)
    else:
        trainer.train(resume_from_checkpoint=True if args.resume else None)
    if args.shard == "fsdp2":
        from torch.distributed.tensor import DTensor

        assert any(isinstance(q, DTensor) for q in trainer.model.parameters()), "not sharded"
    if args.shard == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        assert len(FSDP.fsdp_modules(trainer.model)) == 3, "not FSDP1-wrapped"  # root, 2 blocks
    final = _final(trainer, args.shard)
    if args.final and rank == 0:
        torch.save(final, args.final)
        print("FINAL " + json.dumps(sorted(final)[:3]), flush=True)
    dist.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown (see tests/scripts/accelerate_ddp_state.py)
