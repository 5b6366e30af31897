"""Hugging Face Transformers: a ``Trainer`` whose checkpoints live in a stepvault store.

::

    from stepvault import Every, KeepLast
    from stepvault.integrations.transformers import StepvaultCallback, StepvaultTrainer

    ckpt = StepvaultCallback("ckpts", run="gpt2-tiny", save=Every(steps=200), keep=KeepLast(3))
    trainer = StepvaultTrainer(model=model, args=args, train_dataset=ds, callbacks=[ckpt])
    trainer.train(resume_from_checkpoint=ckpt.has_checkpoint)   # newest checkpoint that verifies

``StepvaultCallback`` holds the :class:`~stepvault.CheckpointManager` and decides *when*:
with ``save=`` its policy replaces ``save_strategy``/``save_steps`` (it sets
``control.should_save`` at each step and epoch end); without, the Trainer's own
``save_strategy`` decides. ``StepvaultTrainer`` (or :class:`StepvaultTrainerMixin` mixed
into your own ``Trainer`` subclass, first in the bases) does the *how*: it overrides the
Trainer's checkpoint hooks so that a save writes the model, optimizer, scheduler, grad
scaler, RNGs (Python, numpy, torch, CUDA) and the ``TrainerState`` (step, epoch, log
history, best metric, stateful callbacks) as one stepvault checkpoint instead of a
``checkpoint-N`` folder of pickles, and ``train(resume_from_checkpoint=True)`` loads the
newest checkpoint that verifies (an int: exactly that step; a path string: an ordinary
``checkpoint-N`` folder, loaded by the Trainer as usual).

Under DDP (``torchrun --nproc_per_node N``) the world process zero writes the checkpoint
(a rank-local manager that holds the run's lease) with every rank's RNG state gathered
into it, takes the save decisions for all ranks, and chooses the checkpoint every rank
resumes from.

With DeepSpeed (ZeRO 1/2/3), FSDP2 or FSDP1 the model and optimizer are sharded: every rank
holds a collective manager and writes its own shards into one checkpoint (DeepSpeed's files
through :class:`~stepvault.integrations.deepspeed.DeepSpeedCheckpointer`'s checkpoint
engine; the FSDP DTensor shards through the collective path; FSDP1 is given the 1-D world
device mesh that makes its state DTensors, see _fsdp1.py). A resume chooses the
checkpoint before the Trainer builds the engine or shards the model (rank 0 proposes, the
ranks agree), then loads exactly that step once they exist; the load verifies what it
reads, and damage anywhere falls back on every rank.

Hooks overridden (Transformers 5.x): ``_save_checkpoint``, ``_load_from_checkpoint``,
``_load_optimizer_and_scheduler``, ``_load_scaler``, ``_load_rng_state``,
``_prepare_for_training`` (sharded jobs: the load once the engine or shards exist), and
``train`` (to pick the checkpoint).

(Longer than most modules: the HF callback and the Trainer mixin are one integration and
share their state; the sharded saves and the choose-first resume override the Trainer's own
methods, so they live on the one mixin too. The shared pieces are in _common.py and
_attachments.py; DeepSpeed's engine side in deepspeed.py.)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
import warnings
from typing import TYPE_CHECKING, Any

from ._common import (
    PolicySignals,
    finite_metrics,
    gather_rng_states,
    has_full_checkpoint,
    missing_framework,
    on_rank0,
    open_manager_on_rank0,
    read_checkpoint,
    rng_state_of_this_rank,
    sharded_collective,
    warn_resume_gaps,
)

try:
    import transformers
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import ExportableState, TrainerState
    from transformers.training_args import ParallelMode
except ImportError as exc:
    raise ImportError(
        missing_framework("transformers", "Hugging Face Transformers", "transformers")
    ) from exc

from .._rank import rank_and_world
from .._version import __version__
from ..api import RestoreInfo
from ..api import open as stepvault_open
from ..errors import StepvaultError, StoreNotFoundError
from ..manager import CheckpointManager
from ..policy import KeepPolicy, SavePolicy
from ..state import RNGState
from ._attachments import transformers_files
from ._staging import StagingPreparer

__all__ = ["StepvaultCallback", "StepvaultTrainer", "StepvaultTrainerMixin"]

#: The file the Trainer reads its state from when resuming (the only file we write).
_TRAINER_STATE_NAME = "trainer_state.json"
_KEYS = ("model", "optimizer", "scheduler", "scaler", "rng", "trainer_state")


class StepvaultCallback(TrainerCallback):
    """When to save, and the manager that saves; use it with :class:`StepvaultTrainer`.

    Parameters:
        root: the store (a directory or fsspec URL; created when absent).
        run: run name in the store.
        save: save policy asked at every optimizer step and epoch end (its epoch is the
            number of completed epochs). None: the Trainer's ``save_strategy`` decides.
        keep: keep policy applied after each save (replaces ``save_total_limit``).
        async_save: write in the background; training waits only for the copy of the
            tensors into reusable host buffers.
        manager_options: passed to :class:`~stepvault.CheckpointManager` (``codec``,
            ``best_metric``, ``best_mode``, ``options=ManagerOptions(...)``, ...).

    The metrics of a checkpoint are the finite numbers logged at its step (``loss``,
    ``learning_rate``, ``eval_loss``...), so ``KeepBest(2, metric="eval_loss")`` works.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        run: str,
        save: SavePolicy | None = None,
        keep: KeepPolicy | None = None,
        async_save: bool = True,
        **manager_options: Any,
    ) -> None:
        self.root = root
        self.run = run
        self.save_policy = save
        self.keep_policy = keep
        self.async_save = async_save
        self.manager_options = manager_options
        self.manager: CheckpointManager | None = None
        self.last_restore: RestoreInfo | None = None
        self._opened = False
        self._signals = PolicySignals(save) if save is not None else None
        self._prepare_staging = StagingPreparer()
        #: set by StepvaultTrainer for DeepSpeed and FSDP: every rank holds a collective
        #: manager (each writes its own shards) and asks it every question together
        self.collective = False

    @property
    def has_checkpoint(self) -> bool:
        """Whether the run has a full checkpoint to resume from (valid or not: which one
        verifies is decided when it is loaded)."""
        return has_full_checkpoint(self.root, self.run)

    def open(self, total_steps: int | None = None) -> CheckpointManager | None:
        """The manager (created, and the run's lease taken, on first use).

        With several processes (DDP) only the world process zero has one (rank-local: the
        Trainer saves from that process only); the others get None. The first call is
        then a collective one: every rank makes it at the same point of ``train``.
        """
        if not self._opened:
            options = self._options(total_steps)
            if self.collective:  # every rank: the collective path (manager/collective_saving)
                self.manager = CheckpointManager(
                    self.root,
                    self.run,
                    save=self.save_policy,
                    keep=self.keep_policy,
                    async_save=self.async_save,
                    collective=sharded_collective(),
                    **options,
                )
            else:
                open_manager_on_rank0(self, options)
            self._opened = True
            self._prepare_staging.reset()
            if self.manager is None and self._signals is not None:
                self._signals.install()  # the other ranks survive a preemption notice
        return self.manager

    def _options(self, total_steps: int | None = None) -> dict[str, Any]:
        options = dict(self.manager_options)
        if total_steps:
            options.setdefault("total_steps", total_steps)
        return options

    def adopt(self, manager: CheckpointManager) -> None:
        """Use ``manager`` (a collective one another object built, e.g. the DeepSpeed
        checkpointer's) as this callback's."""
        self.manager = manager
        self._opened = True
        self._prepare_staging.reset()

    def close(self, *, quiet: bool = False) -> None:
        """Wait for the save in flight and release the run (done at the end of ``train``)."""
        mgr, self.manager = self.manager, None
        self._opened = False
        if self._signals is not None:
            self._signals.uninstall()
        if mgr is None:
            return
        try:
            mgr.close()
        except BaseException:
            if not quiet:
                raise

    # ---------------------------------------------------------------- Trainer events
    def on_train_begin(self, args, state, control, **kwargs):
        mgr = self.open(state.max_steps or None)
        if mgr is not None and mgr.total_steps is None and state.max_steps:
            mgr.total_steps = state.max_steps  # opened by a resume, before max_steps was known
        # The optimizer exists (and a resume has loaded it): the first due save only copies.
        if not self.collective:  # (sharded: the state saved is the shards, not these)
            self._prepare_staging(mgr, _bulk(kwargs))

    def _decide(self, state, control) -> None:
        if self.save_policy is None:
            return  # the Trainer's save_strategy decides
        epoch = math.floor(state.epoch) if state.epoch is not None else None
        mgr = self.open()
        if self.collective:  # every rank asks; the collective manager agrees the answer
            assert mgr is not None
            control.should_save = mgr.should_save(state.global_step, epoch)
            return
        # Several processes: process zero decides for all (clocks and signals differ),
        # every rank then enters _save_checkpoint together.
        control.should_save = on_rank0(
            # on_rank0 runs it on process zero, the one with a manager (open() above)
            lambda: self.manager.should_save(state.global_step, epoch),  # type: ignore[union-attr]
            "the save decision",
        )

    def on_step_end(self, args, state, control, **kwargs):
        self._decide(state, control)
        if not control.should_save and not self.collective:
            # A fresh Adam has its moments now (after its first step): prepare for them.
            self._prepare_staging(self.manager, _bulk(kwargs))

    def on_epoch_end(self, args, state, control, **kwargs):
        self._decide(state, control)

    def on_train_end(self, args, state, control, **kwargs):
        if self.manager is not None:
            self.manager.wait()  # the last save is committed when train() returns


def _bulk(event: dict[str, Any]) -> dict[str, Any]:
    """The model and optimizer of a callback event: the bytes a save writes, to prepare."""
    return {k: event[k] for k in ("model", "optimizer") if event.get(k) is not None}


def _step_metrics(log_history: list[dict[str, Any]], step: int) -> dict[str, float]:
    merged: dict[str, Any] = {}
    for entry in log_history:
        if entry.get("step") == step:
            merged.update(entry)
    merged.pop("step", None)
    merged.pop("epoch", None)
    return finite_metrics(merged)


if TYPE_CHECKING:  # always mixed into a Trainer: checked as one, a plain class at run time
    _TrainerBase = Trainer
else:
    _TrainerBase = object


class StepvaultTrainerMixin(_TrainerBase):
    """Trainer hooks that save to and resume from a stepvault store.

    Mix it in *before* ``Trainer`` (or a Trainer subclass such as TRL's):
    ``class MyTrainer(StepvaultTrainerMixin, SFTTrainer): ...``; pass a
    :class:`StepvaultCallback` in ``callbacks``.
    """

    _stepvault_resume: tuple[str, dict[str, Any]] | None = None
    #: "deepspeed", "fsdp2" or "fsdp1" while a sharded job trains (every rank saves its
    #: shards)
    _stepvault_sharding: str | None = None
    #: the DeepSpeed engine's checkpointer (DeepSpeed jobs, once the engine exists)
    _stepvault_ds: Any = None

    def _stepvault_callback(self) -> StepvaultCallback:
        for cb in self.callback_handler.callbacks:
            if isinstance(cb, StepvaultCallback):
                return cb
        raise StepvaultError(
            f"{type(self).__name__} needs a StepvaultCallback in callbacks=[...] (it names "
            "the store, the run and the policies)"
        )

    def _stepvault_sharded_mode(self) -> str | None:
        """``"deepspeed"``, ``"fsdp2"``, ``"fsdp1"`` or None (DDP / one process)."""
        if self.is_deepspeed_enabled:
            return "deepspeed"
        if not self.is_fsdp_enabled:
            return None
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        return "fsdp2" if getattr(plugin, "fsdp_version", 1) == 2 else "fsdp1"

    def _stepvault_check(self) -> None:
        args = self.args
        sharded = self._stepvault_sharded_mode()
        if sharded is not None and rank_and_world()[1] < 2:
            raise StepvaultError(
                f"the stepvault Trainer integration saves a {sharded} job collectively, "
                "which needs a process group of 2 or more ranks (torchrun "
                f"--nproc_per_node N); train one process without {sharded}"
            )
        if sharded is not None and args.save_only_model:
            raise StepvaultError(
                f"save_only_model is not supported with {sharded} by the stepvault Trainer "
                "integration (every checkpoint holds the sharded training state); use "
                "keep=KeepLast(n) to bound the store, and `stepvault export` for the weights"
            )
        if (
            sharded is None
            and args.world_size > 1
            and args.parallel_mode != ParallelMode.DISTRIBUTED
        ):
            raise StepvaultError(
                f"the stepvault Trainer integration supports DDP (torchrun) with several "
                f"processes, not {args.parallel_mode}; see INTEGRATIONS.md"
            )
        if self.model_init is not None:
            raise StepvaultError(
                "model_init is not supported by the stepvault Trainer integration (train() "
                "would build a new model after the checkpoint was loaded into the old one)"
            )
        if args.load_best_model_at_end:
            raise StepvaultError(
                "load_best_model_at_end reads checkpoint-N folders, which this Trainer does "
                "not write; keep the best with keep=KeepBest(...) and load it after "
                "training with ckpt.open().restore({'model': model}, 'best', strict=False)"
            )

    # ------------------------------------------------------------------------ train
    # **kwargs, not Transformers 5's ignore_keys_for_eval: passed through to any version.
    def train(self, resume_from_checkpoint: Any = None, trial: Any = None, **kwargs: Any):  # type: ignore[override]
        """``Trainer.train``; ``resume_from_checkpoint=True`` resumes from the newest
        stepvault checkpoint that verifies, an int from exactly that step; a string is an
        ordinary checkpoint folder (loaded by the Trainer as usual)."""
        cb = self._stepvault_callback()
        self._stepvault_check()
        self._stepvault_sharding = self._stepvault_sharded_mode()
        cb.collective = self._stepvault_sharding is not None
        scratch = None
        try:
            exact = type(resume_from_checkpoint) is int
            if resume_from_checkpoint is True or exact:
                step = "latest" if resume_from_checkpoint is True else resume_from_checkpoint
                if self._stepvault_sharding is not None:
                    scratch = self._stepvault_choose_sharded(cb, step)
                else:  # DDP / one process: a sharded job's checkpoint is resharded
                    scratch = self._stepvault_choose_sharded(cb, step, reshard=True)
                    scratch = scratch or self._stepvault_prepare_resume(cb, step)
                resume_from_checkpoint = scratch
            result = super().train(
                resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs
            )
        except BaseException:
            cb.close(quiet=True)
            self._stepvault_release(quiet=True)
            raise
        finally:
            self._stepvault_resume = None
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        cb.close()
        self._stepvault_release()
        return result

    def _stepvault_release(self, *, quiet: bool = False) -> None:
        """Give DeepSpeed back its checkpoint engine (the manager is closed by then)."""
        ds, self._stepvault_ds = self._stepvault_ds, None
        if ds is None:
            return
        try:
            ds.close()
        except BaseException:
            if not quiet:
                raise

    def _stepvault_prepare_resume(self, cb: StepvaultCallback, step: Any) -> str:
        """Load the checkpoint (verified; the model in place, the rest kept for the hooks)
        and write the one file the Trainer insists on reading: ``trainer_state.json``.

        Several processes: process zero chooses the checkpoint (the newest that verifies,
        through its manager) and the other ranks read exactly that step, so that every
        rank resumes from the same one.
        """
        mgr = cb.open()
        holder = _holder(cb, self.model, step)

        def choose() -> RestoreInfo:
            assert mgr is not None  # on_rank0 runs this on process zero, which has the manager
            info = mgr.restore(holder, step)
            if info is None:
                raise ValueError(
                    f"No valid checkpoint found in stepvault run {cb.run!r} of {cb.root} "
                    "(resume_from_checkpoint=ckpt.has_checkpoint starts fresh when there is "
                    "none)"
                )
            return info

        info = on_rank0(choose, "choosing the checkpoint to resume from")
        if mgr is None:  # not process zero: the same step, exactly
            holder = _holder(cb, self.model, info.step)
            mine = read_checkpoint(cb.root, cb.run, holder, info.step)
            info = dataclasses.replace(mine, skipped=info.skipped)
        cb.last_restore = info
        if mgr is not None:
            for skipped in info.skipped:
                warnings.warn(
                    f"stepvault: skipped damaged checkpoint {cb.run}@{skipped.step}: "
                    f"{skipped.reason}",
                    RuntimeWarning,
                    stacklevel=3,
                )
        self._stepvault_report_missing(cb, holder, info)
        scratch = tempfile.mkdtemp(prefix="stepvault-resume-")
        with open(os.path.join(scratch, _TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            json.dump(holder["trainer_state"], f)
        self._stepvault_resume = (scratch, holder)
        return scratch

    def _stepvault_report_missing(
        self, cb: StepvaultCallback, holder: dict[str, Any], info: RestoreInfo
    ) -> None:
        """Warn (on process zero) naming the training state the checkpoint lacks — an
        import of a ``checkpoint-N`` folder without ``optimizer.pt``, say — which the
        resume starts fresh; a checkpoint without ``trainer_state`` resumes at its step."""
        absent = [k for k in _KEYS[1:] if k != "scaler" and holder.get(k) is None]
        if getattr(self.accelerator, "scaler", None) is not None and holder.get("scaler") is None:
            absent.append("scaler")  # training with a GradScaler the checkpoint has no state of
        if holder.get("trainer_state") is None:
            epoch = float(info.epoch) if info.epoch is not None else 0.0
            holder["trainer_state"] = dataclasses.asdict(
                TrainerState(global_step=info.step, epoch=epoch)
            )
        if not absent or rank_and_world()[0] != 0:
            return
        warn_resume_gaps(cb.run, info.step, info.metadata, absent)

    def _stepvault_restored(self, checkpoint: Any) -> dict[str, Any] | None:
        resume = self._stepvault_resume
        if resume is not None and checkpoint == resume[0]:
            return resume[1]
        return None

    # --------------------------------------------------------- sharded (DeepSpeed, FSDP2)
    def _stepvault_choose_sharded(
        self, cb: StepvaultCallback, step: Any, *, reshard: bool = False
    ) -> str | None:
        """Collective: the checkpoint a sharded job resumes from, proposed before the
        Trainer builds its engine or shards its model (``train()`` reads
        ``trainer_state.json`` first). ``reshard``: a DDP (or one-process) job, which
        takes this path only when the newest candidate was written by several ranks (an
        FSDP job's: None otherwise); it is then loaded once the Trainer has built the
        optimizer, every rank reading the full tensors in its own process
        (:meth:`_stepvault_load_resharded`).

        Rank 0 proposes the newest full checkpoint (or exactly ``step``) from the manifests
        alone; no object is read here. The load (:meth:`_stepvault_load_early`) reads each
        object once, verifying it as it loads, and damage on any rank makes every rank fall
        back together; ``trainer_state.json`` is then rewritten for the step loaded.
        """
        from ..catalog import checkpoint_records
        from ..core.planner import Source, share_choice
        from ..store import Store

        try:
            store = Store.open(cb.root)
        except StoreNotFoundError:
            if reshard:  # nothing to reshard: the DDP resume says what is missing
                return None
            raise
        source = Source(
            store, cb.run, records=lambda: checkpoint_records(store, cb.run, protected=False)
        )
        ref: Any = "latest" if step == "latest" else int(step)
        offer = share_choice(source, lambda: source.choose(ref))
        if reshard and not _sharded_offer(cb.run, offer):
            return None  # one process wrote it: the DDP resume (_stepvault_prepare_resume)
        if not offer.steps:
            raise ValueError(
                f"No checkpoint found in stepvault run {cb.run!r} of {cb.root} "
                "(resume_from_checkpoint=ckpt.has_checkpoint starts fresh when there is none)"
            )
        scratch = tempfile.mkdtemp(prefix="stepvault-resume-")
        _write_trainer_state(scratch, cb, max(offer.steps) if ref == "latest" else ref)
        self._stepvault_resume = (
            scratch,
            {"sharded": ref, **({"reshard": True} if reshard else {})},
        )
        return scratch

    # Transformers 5.x: called by the training loop right before it reads the checkpoint's
    # trainer_state.json (which places the data); a sharded stepvault resume loads here.
    def set_initial_training_values(self, args: Any, dataloader: Any) -> Any:
        values = super().set_initial_training_values(args, dataloader)
        resume = self._stepvault_resume
        if resume is not None and "sharded" in resume[1] and "early" not in resume[1]:
            max_steps = values[-1]
            resume[1]["early"] = self._stepvault_load_early(max_steps, dataloader, resume)
        return values

    def _stepvault_load_early(
        self, max_steps: Any, dataloader: Any, resume: tuple[str, dict[str, Any]]
    ) -> tuple[Any, Any]:
        """Collective: build the engine / shard the model (the Trainer's own
        ``_prepare_for_training``, which the training loop would run next), load the newest
        checkpoint that verifies on every rank into it, and write the loaded step's
        ``trainer_state.json`` for the training loop to place the data by."""
        scratch, tree = resume
        cb = self._stepvault_callback()
        if "reshard" in tree:  # DDP: the Trainer's own preparation (wraps, builds the optimizer)
            model, loader = super()._prepare_for_training(max_steps, dataloader, None)
            info = self._stepvault_load_resharded(cb, tree)
        else:
            model, loader = self._stepvault_prepare_sharded(max_steps, dataloader, None)
            info = self._stepvault_load_sharded(cb, tree)
        cb.last_restore = info
        if rank_and_world()[0] == 0:
            for sk in info.skipped:
                warnings.warn(
                    f"stepvault: skipped damaged checkpoint {cb.run}@{sk.step}: {sk.reason}",
                    RuntimeWarning,
                    stacklevel=3,
                )
        _write_trainer_state(scratch, cb, info.step, info.epoch)
        return model, loader

    # Transformers 5.x: wraps, shards (FSDP) or builds the DeepSpeed engine, creates the
    # optimizer and scheduler, then loads a checkpoint into them.
    def _prepare_for_training(
        self, max_steps: Any, train_dataloader: Any, resume_from_checkpoint: Any
    ) -> tuple[Any, Any]:
        tree = self._stepvault_restored(resume_from_checkpoint)
        if tree is not None and "early" in tree:  # prepared and loaded already
            early: tuple[Any, Any] = tree.pop("early")
            return early
        if self._stepvault_sharding is None:
            return super()._prepare_for_training(
                max_steps, train_dataloader, resume_from_checkpoint
            )
        # An ordinary checkpoint folder is loaded by the Trainer as usual.
        return self._stepvault_prepare_sharded(max_steps, train_dataloader, resume_from_checkpoint)

    def _stepvault_prepare_sharded(
        self, max_steps: Any, train_dataloader: Any, resume_from_checkpoint: Any
    ) -> tuple[Any, Any]:
        """The Trainer's own ``_prepare_for_training``, then every rank's collective
        manager (DeepSpeed's: the engine's checkpointer)."""
        mode = self._stepvault_sharding
        model, loader = super()._prepare_for_training(
            max_steps, train_dataloader, resume_from_checkpoint
        )
        cb = self._stepvault_callback()
        # The collective writer takes no attachments: the model's files are attached to
        # each checkpoint once it is committed (for `stepvault export` to a model folder).
        files = _model_files(self.model, _processing_class(self))
        options = _with_hook(cb._options(max_steps), _AttachAfterCommit(files))
        if mode == "deepspeed":
            from .deepspeed import DeepSpeedCheckpointer

            ds = DeepSpeedCheckpointer(
                self.model_wrapped,
                cb.root,
                cb.run,
                save=cb.save_policy,
                keep=cb.keep_policy,
                async_save=cb.async_save,
                **options,
            )
            self._stepvault_ds = ds
            cb.adopt(ds.manager)
        else:
            if mode == "fsdp1":  # its state dicts as DTensors, as with device_mesh= (_fsdp1.py)
                from ._fsdp1 import give_world_mesh

                give_world_mesh(model, "the stepvault Trainer integration")
            cb.adopt(
                CheckpointManager(
                    cb.root,
                    cb.run,
                    save=cb.save_policy,
                    keep=cb.keep_policy,
                    async_save=cb.async_save,
                    collective=sharded_collective(),
                    **options,
                )
            )
        return model, loader

    def _stepvault_sharded_state(self) -> dict[str, Any]:
        """FSDP2 / FSDP1: what every rank saves and restores (its shards of the model and of the
        optimizer's moments, its own RNG; the replicated values written once)."""
        scaler = getattr(self.accelerator, "scaler", None)
        state: dict[str, Any] = {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.lr_scheduler,
            "rng": RNGState(),
            "trainer_state": None,
        }
        if scaler is not None:
            state["scaler"] = scaler
        return state

    def _stepvault_load_sharded(self, cb: StepvaultCallback, tree: dict[str, Any]) -> RestoreInfo:
        """Collective: load the newest checkpoint that verifies on every rank (or exactly
        the step asked for) into the engine (DeepSpeed's own loader, fed by the checkpoint
        engine) or the FSDP shards (the collective restore). Each object is read once and
        verified as it is read; damage on any rank makes every rank fall back together.
        Keeps this rank's RNG state for the Trainer's ``_load_rng_state``, which it calls
        once the data is in place."""
        ref = tree["sharded"]
        info: RestoreInfo | None
        if self._stepvault_ds is not None:
            ds = self._stepvault_ds
            info = ds.resume(ref, load_module_strict=True)
            scheduler = ds.client_state.get(_HF_SCHEDULER)
            if scheduler is not None:  # the Trainer's own scheduler (not DeepSpeed's)
                self.lr_scheduler.load_state_dict(scheduler)  # type: ignore[union-attr]
        else:
            mgr = cb.open()
            assert mgr is not None
            info = mgr.restore(self._stepvault_sharded_state(), ref)
        if info is None:  # deleted since the choice
            raise ValueError(f"No checkpoint found in stepvault run {cb.run!r} of {cb.root}")
        tree["rng"] = RNGState().state_dict()  # this rank's, as just restored
        return info

    def _stepvault_load_resharded(self, cb: StepvaultCallback, tree: dict[str, Any]) -> RestoreInfo:
        """DDP (or one process) resuming a sharded (FSDP2) job's checkpoint: the whole
        model, optimizer and scheduler on every rank, each rank reading the full tensors
        in its own process (the restore planner's rank-local reshard). Process zero's
        manager chooses the newest that verifies (every object of it, every rank's part);
        the other ranks read exactly that step. Each rank takes the RNG state the same
        rank saved (a rank the checkpoint lacks keeps its own, with a warning), kept for
        ``_load_rng_state``."""
        ref = tree["sharded"]
        state = self._stepvault_sharded_state()
        mgr = cb.open()  # a collective call: every rank, process zero gets the manager

        def choose() -> RestoreInfo:
            assert mgr is not None  # on_rank0 runs this on process zero
            info = mgr.restore(state, ref)
            if info is None:  # deleted since the choice
                raise ValueError(f"No checkpoint found in stepvault run {cb.run!r} of {cb.root}")
            return info

        info: RestoreInfo = on_rank0(choose, "choosing the checkpoint to resume from")
        if mgr is None:  # not process zero: the same step, exactly
            mine = read_checkpoint(cb.root, cb.run, state, info.step)
            info = dataclasses.replace(mine, skipped=info.skipped)
        tree["rng"] = RNGState().state_dict()  # this rank's, as just restored
        return info

    def _stepvault_save_sharded(self, cb: StepvaultCallback) -> None:
        """Collective: every rank writes its shards into one checkpoint (the collective
        manager; DeepSpeed's files through its checkpoint engine)."""
        self._stepvault_stateful_callbacks()
        step = self.state.global_step
        epoch = math.floor(self.state.epoch) if self.state.epoch is not None else None
        trainer_state = json.dumps(dataclasses.asdict(self.state))
        metadata = self._stepvault_metadata(rank_and_world()[1])
        metrics = _step_metrics(self.state.log_history, step)
        force = cb.save_policy is None  # the Trainer's save_strategy decided
        if self._stepvault_ds is not None:
            from accelerate.utils import DeepSpeedSchedulerWrapper

            client: dict[str, Any] = {}
            if not isinstance(self.lr_scheduler, DeepSpeedSchedulerWrapper):
                client[_HF_SCHEDULER] = self.lr_scheduler.state_dict()  # type: ignore[union-attr]
            self._stepvault_ds.save(
                step,
                client_state=client,
                metrics=metrics,
                force=force,
                epoch=epoch,
                metadata={**metadata, "trainer_state": trainer_state},
            )
        else:
            mgr = cb.open()
            assert mgr is not None
            state = self._stepvault_sharded_state()
            state["trainer_state"] = trainer_state  # one JSON value, kept in the manifest
            mgr.save(step, state, epoch=epoch, metrics=metrics, metadata=metadata, force=force)

    # ------------------------------------------------------------------ load hooks
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._stepvault_restored(resume_from_checkpoint) is not None:
            return  # the model was restored in place (verified) by train()
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        tree = self._stepvault_restored(checkpoint)
        if tree is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        # The Trainer creates both before it calls this hook; one the checkpoint lacks (an
        # incomplete import) starts fresh, as train() warned.
        if tree.get("optimizer") is not None:
            self.optimizer.load_state_dict(tree["optimizer"])  # type: ignore[union-attr]
        if tree.get("scheduler") is not None:
            self.lr_scheduler.load_state_dict(tree["scheduler"])  # type: ignore[union-attr]

    def _load_scaler(self, checkpoint: Any) -> None:
        tree = self._stepvault_restored(checkpoint)
        if tree is None:
            return super()._load_scaler(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and tree.get("scaler") is not None:
            scaler.load_state_dict(tree["scaler"])

    def _load_rng_state(self, checkpoint: Any) -> None:
        tree = self._stepvault_restored(checkpoint)
        if tree is None:
            return super()._load_rng_state(checkpoint)
        if "sharded" in tree:  # this rank's own state, kept when the shards were loaded
            RNGState().load_state_dict(tree["rng"])
            return
        rng = tree.get("rng")
        if rng is None:
            return  # an import without rng_state.pth: train() warned
        # Written by several processes: "ranks" holds each rank's state (what the Trainer
        # keeps in rng_state_{rank}.pth; an import of those files has them in "rng_ranks");
        # every rank takes its own.
        ranks = rng.get("ranks") if isinstance(rng, dict) else None
        ranks = ranks or tree.get("rng_ranks")
        what = f"stepvault run {self._stepvault_callback().run}"
        own = rng_state_of_this_rank(ranks, rng, what)
        if own is None:
            raise StepvaultError(f"{what}: the checkpoint holds no RNG state to resume from")
        RNGState().load_state_dict(own)

    # ------------------------------------------------------------------ save hook
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        cb = self._stepvault_callback()
        cb.open()
        if self.hp_search_backend is None and trial is None:
            self.store_flos()  # a collective with several processes: on every rank
        if self._stepvault_sharding is not None:
            self._stepvault_save_sharded(cb)
            return
        # Every rank's RNG (the Trainer writes rng_state_{rank}.pth on each); the rest of the
        # state is replicated and written by process zero, which reports to every rank how
        # the save went (an error, or a policy's exit after a preemption save, stops all).
        rng_states = gather_rng_states()
        on_rank0(
            lambda: self._stepvault_write(cb, rng_states),
            f"the stepvault save of step {self.state.global_step}",
        )

    def _stepvault_write(self, cb: StepvaultCallback, rng_states: list[dict[str, Any]]) -> None:
        mgr = cb.open()
        assert mgr is not None  # on_rank0 runs this on process zero, which has the manager
        self._stepvault_stateful_callbacks()
        scaler = getattr(self.accelerator, "scaler", None)
        rng: Any = RNGState()
        if len(rng_states) > 1:
            rng = {**rng_states[0], "ranks": rng_states}  # process zero's, and every rank's
        state = {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.lr_scheduler,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rng": rng,
            # The JSON that TrainerState.save_to_json writes, as plain values.
            "trainer_state": json.loads(json.dumps(dataclasses.asdict(self.state))),
        }
        metadata = self._stepvault_metadata(len(rng_states))
        step = self.state.global_step
        epoch = math.floor(self.state.epoch) if self.state.epoch is not None else None
        mgr.save(
            step,
            state,
            epoch=epoch,
            metrics=_step_metrics(self.state.log_history, step),
            metadata=metadata,
            # Without a save policy the Trainer's save_strategy decided: always save.
            force=cb.save_policy is None,
            kind="weights" if self.args.save_only_model else None,
            # issue 19: config, generation config and tokenizer files, for `stepvault export`
            attachments=transformers_files(self.model, _processing_class(self)),
        )

    def _stepvault_stateful_callbacks(self) -> None:
        """What Trainer._save_checkpoint does before writing the state: record the state
        of the ExportableState callbacks (early stopping...) and of TrainerControl."""
        # Annotated as a list, a dict by name once TrainerState.__post_init__ has run.
        stateful: dict[str, Any] = self.state.stateful_callbacks  # type: ignore[assignment]
        for obj in [*self.callback_handler.callbacks, self.control]:
            if isinstance(obj, ExportableState):
                name = obj.__class__.__name__
                if isinstance(stateful.get(name), list):
                    stateful[name].append(obj.state())
                else:
                    stateful[name] = obj.state()

    def _stepvault_metadata(self, world_size: int) -> dict[str, Any]:
        config = getattr(self.model, "config", None)
        return {
            "framework": "transformers",
            "transformers_version": transformers.__version__,
            "stepvault_version": __version__,
            "model_class": _model_class(self.model).__name__,
            "model_config": json.loads(config.to_json_string()) if config is not None else None,
            "world_size": world_size,
            **({"sharding": self._stepvault_sharding} if self._stepvault_sharding else {}),
        }


#: The client_state key of the Trainer's own LR scheduler in a DeepSpeed checkpoint (the
#: engine saves only a scheduler DeepSpeed built from its config).
_HF_SCHEDULER = "stepvault_hf_scheduler"


def _model_class(model: Any) -> type:
    """The model's own class: FSDP2's ``fully_shard`` swaps in a subclass named
    ``FSDP<name>``; ``architectures`` and exports name the model's."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    while isinstance(model, FSDP):  # FSDP1 wraps the model
        model = model.module
    cls = type(model)
    if isinstance(model, FSDPModule):
        cls = next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
    return cls


def _model_files(model: Any, processing_class: Any) -> dict[str, bytes]:
    """The files attached to each checkpoint (config, generation config, tokenizer), with
    ``architectures`` naming the model's own class (not FSDP2's ``FSDP<name>``)."""
    files = transformers_files(model, processing_class)
    if "config.json" in files:
        config = json.loads(files["config.json"])
        config["architectures"] = [_model_class(model).__name__]
        files["config.json"] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    return files


class _AttachAfterCommit:
    """After-commit hook of a sharded job's manager: the coordinator attaches the model's
    files to each committed checkpoint (``stepvault attach``'s record)."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.context: Any = None

    def attach(self, context: Any) -> None:
        self.context = context

    def __call__(self, info: Any) -> None:
        ctx = self.context
        if ctx is None or not ctx.coordinator or not self.files:
            return
        from ..catalog.attachments import attach_after

        attach_after(ctx.store, ctx.run, info.step, self.files, note="model files (Trainer)")


def _with_hook(options: dict[str, Any], hook: Any) -> dict[str, Any]:
    """``options`` with ``hook`` added to ``ManagerOptions.hooks`` (the user's kept)."""
    from ..manager import ManagerOptions

    base = options.get("options") or ManagerOptions()
    return {**options, "options": dataclasses.replace(base, hooks=(*base.hooks, hook))}


def _trainer_state_of(manifest: Any, metadata: Any) -> dict[str, Any] | None:
    """The ``TrainerState`` a sharded checkpoint holds, read from its manifest alone: an
    FSDP2 checkpoint keeps it as one JSON value in its state, a DeepSpeed one in its
    metadata (the state is DeepSpeed's files)."""
    text: Any = None
    if manifest.sharded:
        entry = manifest.sharded.get("entries", {}).get("trainer_state")
        if isinstance(entry, dict) and entry.get("type") == "value":
            text = entry.get("value")
    if text is None and isinstance(metadata, dict):
        text = metadata.get("trainer_state")
    if isinstance(text, str):
        loaded = json.loads(text)
        return loaded if isinstance(loaded, dict) else None
    return None


def _write_trainer_state(
    folder: str, cb: StepvaultCallback, step: int, epoch: float | None = None
) -> None:
    """Write ``folder/trainer_state.json``: the ``TrainerState`` checkpoint ``run@step``
    holds (read from its manifest alone), or one at its step when it holds none."""
    from ..format import decode_value, parse_manifest
    from ..store import Store

    manifest = parse_manifest(Store.open(cb.root).read_manifest(cb.run, step), f"{cb.run}@{step}")
    metadata = decode_value(manifest.metadata, lambda kind, name: None)
    state = _trainer_state_of(manifest, metadata)
    if state is None:
        epoch = epoch if epoch is not None else manifest.epoch
        state = dataclasses.asdict(TrainerState(global_step=step, epoch=float(epoch or 0)))
    with open(os.path.join(folder, _TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
        json.dump(state, f)


def _sharded_offer(run: str, offer: Any) -> bool:
    """Whether the first candidate of ``offer`` was written by several ranks."""
    from ..format import parse_manifest

    first = offer.first
    if not offer.steps or not isinstance(first, bytes):
        return False  # none, or unreadable: the DDP resume reports it (and falls back)
    return bool(parse_manifest(first, f"{run}@{offer.steps[0]}").sharded)


def _holder(cb: StepvaultCallback, model: Any, step: Any) -> dict[str, Any]:
    """What the resume restores into: the model in place, and a slot for each other entry
    the checkpoint to resume from holds. An imported ``checkpoint-N`` folder may lack some
    (no ``scaler.pt`` without fp16, no ``optimizer.pt`` when it was not saved): those are
    reported, not refused, while the model's keys are still checked strictly."""
    holder: dict[str, Any] = {"model": model}
    try:
        manifest = stepvault_open(cb.root).checkpoint(cb.run, step).manifest
    except (StepvaultError, OSError, ValueError):  # damaged or absent: the restore says so
        return holder | dict.fromkeys(_KEYS[1:])
    return holder | {k: None for k in manifest.state_kinds if k != "model"}


def _processing_class(trainer: Any) -> Any:
    """The Trainer's tokenizer/processor (``processing_class``; ``tokenizer`` before 4.46)."""
    return getattr(trainer, "processing_class", None) or getattr(trainer, "tokenizer", None)


class StepvaultTrainer(StepvaultTrainerMixin, Trainer):
    """``transformers.Trainer`` with its checkpoints in a stepvault store (see the module
    docstring); pass a :class:`StepvaultCallback` in ``callbacks``."""
