"""The PyTorch Lightning integration, written once for both packages that ship Lightning.

``lightning.pytorch`` and the older standalone ``pytorch_lightning`` have the same API but
distinct classes, and a Trainer only accepts callbacks and plugins built on its own. The
behaviour lives here in two mixins that import no framework; :mod:`.lightning` and
:mod:`.pytorch_lightning` combine them with each package's ``Checkpoint`` and
``CheckpointIO``.

(Longer than most modules: one Lightning callback and the CheckpointIO it installs, which
share their state, and its take-over of a sharding strategy's save and load; loader
wrapping lives in _lightning_data.py, attachments in _attachments.py, the DeepSpeed
strategy's engine save in _lightning_deepspeed.py.)
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch

from ._attachments import hparams_files
from ._common import (
    PolicySignals,
    finite_metrics,
    gather_rng_states,
    has_full_checkpoint,
    on_rank0,
    open_manager_on_rank0,
    rank_and_world,
    read_checkpoint,
    rng_state_of_this_rank,
    warn_resume_gaps,
)
from ._staging import StagingPreparer

if TYPE_CHECKING:
    import lightning.pytorch as pl

from .._version import __version__
from ..api import RestoreInfo
from ..errors import StepvaultError, UnsupportedTypeError
from ..manager import CheckpointManager
from ..policy import Every, KeepPolicy, SavePolicy
from ..state import RNGState

#: Checkpoint paths that start with this go to the store, not to the file system.
PREFIX = "stepvault:"

#: Top-level entries of a stored Lightning checkpoint.
MODEL_KEY = "model"
LIGHTNING_KEY = "lightning"

#: Lightning strategies that shard the model and whose save/load the callback takes over:
#: every rank writes its shards through a collective manager (INTEGRATIONS.md, "Sharded
#: strategies"); DeepSpeed's through its engine (_lightning_deepspeed.py).
SHARDED_STRATEGIES = ("ModelParallelStrategy", "FSDPStrategy", "DeepSpeedStrategy")


def _parse(path: Any) -> int | Literal["latest", "best"] | None:
    """The step a ``stepvault:...`` path names, or None for any other path."""
    if not isinstance(path, str) or not path.startswith(PREFIX):
        return None
    ref = path[len(PREFIX) :]
    if ref in ("latest", "best"):
        return ref  # type: ignore[return-value]
    if ref.isdigit():
        return int(ref)
    raise ValueError(
        f"bad stepvault checkpoint path {path!r}: expected {PREFIX}latest, {PREFIX}best or "
        f"{PREFIX}<step>"
    )


class _StateDictView(torch.nn.Module):
    """A plain state dict presented as a module.

    Lightning hands over ``checkpoint["state_dict"]`` after its ``on_save_checkpoint``
    hooks (which may drop or rename keys); storing it as a module entry keeps those edits
    and records it as the checkpoint's weights, so weights-only checkpoints and
    ``stepvault export`` find it.
    """

    def __init__(self, state_dict: Mapping[str, Any]) -> None:
        super().__init__()
        self._view = state_dict

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._view


def _stringify_unencodable(value: Any, path: str, found: list[str]) -> Any:
    """``value`` with every leaf the safe encoding refuses replaced by its ``repr``."""
    from ..format import Encoder

    if isinstance(value, dict):
        return {k: _stringify_unencodable(v, f"{path}[{k!r}]", found) for k, v in value.items()}
    try:
        Encoder(None).encode(value)
        return value
    except UnsupportedTypeError:
        found.append(path)
        return repr(value)


class CheckpointIOMixin:
    """A Lightning ``CheckpointIO`` that reads and writes ``stepvault:`` paths in a store.

    Any other path goes to ``wrapped`` (the strategy's previous ``CheckpointIO``), so a
    ``ModelCheckpoint`` next to :class:`StepvaultCheckpoint` keeps writing its files.
    """

    def __init__(self, callback: CheckpointMixin, wrapped: Any) -> None:
        self.callback = callback
        self.wrapped = wrapped

    def _other(self, path: Any) -> Any:
        if self.wrapped is None:
            raise ValueError(f"{path!r} is not a {PREFIX} path and there is no other CheckpointIO")
        return self.wrapped

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        step = _parse(path)
        if step is None:
            self._other(path).save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        if not isinstance(step, int):
            raise ValueError(f"save to {PREFIX}<step>, not {path!r}")
        self.callback._store_checkpoint(checkpoint, step)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        step = _parse(path)
        if step is None:
            return self._other(path).load_checkpoint(
                path, map_location=map_location, weights_only=weights_only
            )
        return self.callback.load(step)

    def remove_checkpoint(self, path: Any) -> None:
        if _parse(path) is None:
            self._other(path).remove_checkpoint(path)
            return
        raise ValueError(
            f"{path!r}: checkpoints in a stepvault store are deleted by the keep policy "
            "(keep=...) or `stepvault gc`, never by path"
        )

    def teardown(self) -> None:
        if self.wrapped is not None:
            self.wrapped.teardown()


class CheckpointMixin:
    """Save a Lightning run through stepvault with its save/keep policies; resume from it.

    Parameters:
        root: the store (a directory or fsspec URL; created when absent).
        run: run name in the store.
        save: save policy, asked at every optimizer-step boundary (default
            ``Every(epochs=1)``, like ``ModelCheckpoint``). The epoch a policy sees is the
            number of *completed* epochs, so ``Every(epochs=1)`` saves at the last step
            of each epoch.
        keep: keep policy applied after each save (default: keep everything).
        async_save: write in the background; training waits only for the copy of the
            tensors into reusable host buffers.
        unsupported_hparams: what to do with a ``save_hyperparameters()`` value the safe
            encoding refuses (a ``Path``, an enum, a config object): ``"error"`` (default)
            fails the save with the key path; ``"str"`` stores its ``repr`` instead (with
            a warning). Hyperparameters are not needed to resume, only to rebuild a
            module from a checkpoint; anything else that cannot be encoded always fails
            with its key path (register a converter with ``stepvault.state.register_type``).
        save_rng: also store the Python, numpy and torch RNG states (Lightning saves
            none), so that dropout, shuffles and augmentations continue exactly.
        resumable_loaders: wrap the train loaders in
            :class:`~stepvault.state.dataloader.ResumableLoader` so that an ordinary
            ``DataLoader`` resumes mid-epoch exactly and a ``StatefulDataLoader`` keeps
            later epochs' shuffles (see INTEGRATIONS.md, "Exact resume").
        manager_options: passed to :class:`~stepvault.CheckpointManager` (``codec``,
            ``best_metric``, ``best_mode``, ``tiers``, ``prometheus``, and
            ``options=ManagerOptions(...)`` for staging, GC, lease and error handling).

    Every finite scalar in ``trainer.callback_metrics`` (what ``self.log`` recorded) is
    stored as a metric of the checkpoint, so ``KeepBest(3, metric="val_loss")`` and
    ``ckpt_path="best"`` work.

    Under DDP (``strategy="ddp"``) global rank 0 holds the manager (rank-local, with the
    run's lease) and writes, as Lightning writes its own checkpoints; its save policy
    decides for every rank; every rank's RNG state goes into the checkpoint; on resume
    rank 0 chooses the checkpoint and every rank loads that one. Under
    ``ModelParallelStrategy`` (FSDP2/DTensor) and ``FSDPStrategy`` (FSDP1, FULL_SHARD or
    SHARD_GRAD_OP, or over a ``device_mesh``) every rank holds a collective manager and the
    callback takes over the strategy's own ``save_checkpoint``/``load_checkpoint`` of
    ``stepvault:`` paths: every rank writes and restores its own shards (INTEGRATIONS.md,
    "Sharded strategies"). Under
    ``DeepSpeedStrategy`` (ZeRO 1/2/3) those methods run DeepSpeed's own engine save and
    load through :class:`~stepvault.integrations.deepspeed.DeepSpeedCheckpointer`. Other
    strategies that write their own files are refused.
    """

    #: The Lightning package (``lightning.pytorch`` or ``pytorch_lightning``) and the
    #: CheckpointIO class built on it; set by the concrete class.
    _pl: Any = None
    _io_class: Any = None

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        run: str,
        save: SavePolicy | None = None,
        keep: KeepPolicy | None = None,
        async_save: bool = True,
        unsupported_hparams: Literal["error", "str"] = "error",
        save_rng: bool = True,
        resumable_loaders: bool = True,
        **manager_options: Any,
    ) -> None:
        if unsupported_hparams not in ("error", "str"):
            raise ValueError(
                f"unsupported_hparams must be 'error' or 'str', got {unsupported_hparams!r}"
            )
        self.root = root
        self.run = run
        self.save_policy = save if save is not None else Every(epochs=1)
        self.keep_policy = keep
        self.async_save = async_save
        self.unsupported_hparams = unsupported_hparams
        self.save_rng = save_rng
        self.resumable_loaders = resumable_loaders
        self._uninstall_loaders: Any = None
        self.manager_options = manager_options
        self.manager: CheckpointManager | None = None
        self.last_restore: RestoreInfo | None = None
        self._io: CheckpointIOMixin | None = None
        self._boundary: int | None = None
        self._due: tuple[int, int | None, dict[str, float]] | None = None
        #: ``(step, metrics)`` of the last save: a validation run at that step (after it:
        #: Lightning validates after the batch's hooks) annotates it (on_validation_end)
        self._saved: tuple[int, dict[str, float]] | None = None
        #: the values that annotation wrote: a later save does not record them again (they
        #: were measured on the annotated checkpoint's weights, not on the later one's)
        self._annotated: dict[str, float] = {}
        self._pending_rng: dict[str, Any] | None = None
        self._at_epoch_end = False
        self._deferred: BaseException | None = None
        self._signals = PolicySignals(self.save_policy)
        self._prepare_staging = StagingPreparer()
        #: a sharding strategy (SHARDED_STRATEGIES): a collective manager on every rank
        self._sharded = False
        self._untake: Any = None  # undoes _take_over
        self._deepspeed: Any = None  # a LightningDeepSpeed under DeepSpeedStrategy

    # ------------------------------------------------------------------ Lightning paths
    @property
    def resume_path(self) -> str | None:
        """``"stepvault:latest"`` when the run has a full checkpoint, else None.

        Pass it as ``trainer.fit(..., ckpt_path=ckpt.resume_path)``: the same command line
        starts fresh the first time and resumes after every interruption. Which checkpoint
        is taken is decided when Lightning loads it: the newest that verifies.
        """
        return f"{PREFIX}latest" if has_full_checkpoint(self.root, self.run) else None

    @property
    def last_model_path(self) -> str:
        """Lightning's name for :attr:`resume_path` (``""`` when there is none)."""
        return self.resume_path or ""

    @property
    def best_model_path(self) -> str:
        """``"stepvault:best"`` when a best metric is configured, so ``ckpt_path="best"`` works."""
        if self._best() is None or not has_full_checkpoint(self.root, self.run):
            return ""
        return f"{PREFIX}best"

    def _best(self) -> tuple[str, str] | None:
        metric = self.manager_options.get("best_metric")
        if metric is not None:
            return metric, self.manager_options.get("best_mode", "min")
        from ..policy import KeepAny, KeepBest

        todo = [self.keep_policy]
        while todo:
            p = todo.pop(0)
            if isinstance(p, KeepBest):
                return p.metric, p.mode
            if isinstance(p, KeepAny):
                todo.extend(p.policies)
        return None

    # ------------------------------------------------------------------------ hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        self._sharded = self._sharding_strategy(strategy)
        self._live_module: Any = pl_module  # a sharded job's checkpoint read under DDP
        if trainer.world_size > 1 and not self._sharded:
            self._check_strategy(strategy)
        if self._sharded:
            _check_fsdp1(strategy)
        if self._sharded and trainer.world_size == 1:
            raise StepvaultError(
                f"StepvaultCheckpoint does not support {type(strategy).__name__} on one "
                "device: its sharded state (DTensors, DeepSpeed's ZeRO partitions) is saved "
                "collectively, which needs more than one rank. "
                'Train one device with strategy="auto" (a plain module), or use two or more '
                "devices"
            )
        if self._sharded and self._untake is None:
            self._untake = self._take_over(strategy)
        if not isinstance(strategy.checkpoint_io, CheckpointIOMixin):
            self._io = self._io_class(self, strategy.checkpoint_io)
            strategy.checkpoint_io = self._io  # type: ignore[assignment]  # a CheckpointIO subclass
        if stage != "fit" or self.manager is not None:
            return
        if self.resumable_loaders and self._uninstall_loaders is None:
            from ._lightning_data import install_resumable_loaders

            self._uninstall_loaders = install_resumable_loaders(trainer.fit_loop)
        options = dict(self.manager_options)
        if trainer.max_steps and trainer.max_steps > 0:
            options.setdefault("total_steps", trainer.max_steps)  # lets LastStep() fire
        if self._sharded:
            # Every rank writes its own shards: a collective manager on every rank (its
            # save policy's decisions are agreed across the ranks by the manager).
            self.manager = CheckpointManager(
                self.root,
                self.run,
                save=self.save_policy,
                keep=self.keep_policy,
                async_save=self.async_save,
                **options,
            )
        else:
            # Lightning writes checkpoints on global rank 0 only (Strategy.save_checkpoint),
            # so only rank 0 has a manager; the other ranks take its decisions
            # (on_train_batch_end).
            open_manager_on_rank0(self, options)
        self._prepare_staging.reset()
        if self.manager is None:
            self._signals.install()  # the other ranks survive a preemption notice

    def _sharding_strategy(self, strategy: Any) -> bool:
        """Whether ``strategy`` shards the model and is one whose save and load this
        callback takes over (``ModelParallelStrategy``: FSDP2/DTensor; ``FSDPStrategy``)."""
        kinds = tuple(
            getattr(self._pl.strategies, name)
            for name in SHARDED_STRATEGIES
            if hasattr(self._pl.strategies, name)
        )
        return isinstance(strategy, kinds)

    def _check_strategy(self, strategy: Any) -> None:
        """Several processes: strategies that save a full, replicated checkpoint through
        the CheckpointIO on rank 0 (DDP and its variants), and the sharding strategies of
        :data:`SHARDED_STRATEGIES` (taken over by :meth:`_take_over`)."""
        base = self._pl.strategies.Strategy
        if type(strategy).save_checkpoint is not base.save_checkpoint:
            name = type(strategy).__name__
            raise StepvaultError(
                f"StepvaultCheckpoint does not support {name} with several processes: it "
                "shards the model or writes its own checkpoint files, and a checkpoint "
                "written from rank 0 alone would miss the other ranks' shards. "
                'Use strategy="ddp" (or "ddp_spawn"), or for a sharded model '
                "ModelParallelStrategy (FSDP2/DTensor), FSDPStrategy or DeepSpeedStrategy "
                '(see INTEGRATIONS.md, "Sharded strategies")'
            )

    def _take_over(self, strategy: Any) -> Any:
        """Route the strategy's own ``save_checkpoint``/``load_checkpoint`` of
        ``stepvault:`` paths through this callback; returns the function that undoes it.

        A sharding strategy never hands a sharded save to its ``CheckpointIO`` (it writes
        its DCP directory itself on every rank), so the ``stepvault:`` paths are taken at
        the strategy: every rank saves its shards through the collective manager and
        loads them back in place. Other paths go to the strategy's own methods.
        """
        own_save, own_load = strategy.save_checkpoint, strategy.load_checkpoint
        store, load = self._store_sharded, self._load_sharded
        from ._lightning_deepspeed import LightningDeepSpeed, is_deepspeed_strategy

        if is_deepspeed_strategy(self._pl, strategy):
            # DeepSpeed's engine writes and reads its own partitions: through it.
            self._deepspeed = LightningDeepSpeed(self, strategy)
            store, load = self._deepspeed.save, self._deepspeed.load

        def save_checkpoint(
            checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
        ) -> None:
            step = _parse(filepath)
            if step is None:
                own_save(checkpoint, filepath, storage_options=storage_options)
                return
            if not isinstance(step, int):
                raise ValueError(f"save to {PREFIX}<step>, not {filepath!r}")
            store(checkpoint, step, strategy)

        def load_checkpoint(checkpoint_path: Any, weights_only: bool | None = None) -> Any:
            step = _parse(checkpoint_path)
            if step is None:
                return own_load(checkpoint_path, weights_only=weights_only)
            return load(step, strategy)

        # Instance attributes shadow the class's methods; deleting them restores those.
        strategy.save_checkpoint = save_checkpoint
        strategy.load_checkpoint = load_checkpoint

        def undo() -> None:
            for name in ("save_checkpoint", "load_checkpoint"):
                strategy.__dict__.pop(name, None)
            part, self._deepspeed = self._deepspeed, None
            if part is not None:
                part.release()

        return undo

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Restored (or fresh) step: a boundary already behind us.
        self._boundary = trainer.global_step
        mgr = self.manager
        if mgr is not None and mgr.total_steps is None:
            total = trainer.estimated_stepping_batches  # lets LastStep() fire (epoch-based runs)
            if isinstance(total, int) or (isinstance(total, float) and total.is_integer()):
                mgr.total_steps = int(total)
        if self._deepspeed is not None and mgr is not None:
            self._deepspeed.attach()  # a fresh start: the engine exists now
        if self._sharded and self._deepspeed is None:
            _fsdp1_mesh(trainer.strategy)  # before staging is prepared from its state
        # After a resume has loaded the optimizers: the first due save only copies.
        self._prepare_staging(mgr, _bulk(trainer, pl_module))
        if self._sharded:
            _without_sigterm_collective(trainer)

    def state_dict(self) -> dict[str, Any]:
        """Lightning stores no RNG state; this callback adds Python/numpy/torch RNGs so
        that dropout, shuffles and augmentations continue exactly after a resume.

        With several processes every rank's RNG state is gathered (Lightning asks every
        rank for its callbacks' state, then writes rank 0's dict): ``rng_ranks`` holds
        them in rank order and each rank takes its own back on resume.
        """
        if not self.save_rng:
            return {}
        states = gather_rng_states()  # a collective call with several processes
        own = states[rank_and_world()[0]]
        out: dict[str, Any] = {"rng": own, "at_epoch_end": self._at_epoch_end}
        if len(states) > 1:
            out["rng_ranks"] = states
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.save_rng or state_dict.get("rng") is None:
            return
        rng = rng_state_of_this_rank(
            state_dict.get("rng_ranks"), state_dict["rng"], "this Lightning checkpoint"
        )
        if state_dict.get("at_epoch_end"):
            # Lightning goes straight to the next epoch and builds its data iterator
            # before any batch hook; that iterator must draw from the restored RNG, as
            # the next epoch's iterator did in the run that saved.
            assert rng is not None  # state_dict["rng"] is not None (checked above)
            RNGState().load_state_dict(rng)
        else:
            # Mid-epoch: the data iterator is rebuilt (drawing a seed) before the first
            # batch; the run that saved had built it already. Apply at the first batch.
            self._pending_rng = rng

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._pending_rng is not None:
            rng, self._pending_rng = self._pending_rng, None
            RNGState().load_state_dict(rng)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        # Only optimizer-step boundaries: with gradient accumulation several batches end at
        # the same global step, and a save in the middle would lose the accumulated grads.
        # fast_dev_run: set on the Trainer by Lightning's _init_debugging_flags, not declared.
        if step == self._boundary or trainer.sanity_checking or trainer.fast_dev_run:  # type: ignore[attr-defined]
            return
        self._boundary = step
        progress = trainer.fit_loop.epoch_loop.batch_progress
        self._at_epoch_end = bool(getattr(progress, "is_last_batch", False))
        epoch = trainer.current_epoch + (1 if self._at_epoch_end else 0)
        if self._sharded:
            # A collective manager on every rank: it agrees on the decision itself.
            due = self.manager is not None and self.manager.should_save(step, epoch)
        elif trainer.world_size > 1:
            # Rank 0 holds the manager and decides (clocks and signals differ between
            # ranks); every rank must then call trainer.save_checkpoint (it dumps the
            # state on every rank and ends with a barrier).
            due = on_rank0(
                # on_rank0 runs it on rank 0, the one with a manager (setup())
                lambda: self.manager.should_save(step, epoch),  # type: ignore[union-attr]
                "the save decision",
            )
        else:
            due = self.manager is not None and self.manager.should_save(step, epoch)
        if not due:
            # A fresh Adam has its moments now (after its first step): prepare for them.
            self._prepare_staging(self.manager, _bulk(trainer, pl_module))
            return
        metrics = finite_metrics(trainer.callback_metrics)
        metrics = {k: v for k, v in metrics.items() if self._annotated.get(k) != v}
        self._due = (step, epoch, metrics)
        self._deferred = None
        try:
            trainer.save_checkpoint(f"{PREFIX}{step}", weights_only=False)
            self._saved = (step, self._due[2])
        finally:
            self._due = None
        if trainer.world_size > 1 and not self._sharded:
            # A failure (or a preemption exit) of rank 0's save was kept until every rank
            # left save_checkpoint's barrier; now every rank raises (exits) together.
            deferred, self._deferred = self._deferred, None

            def outcome() -> None:
                if deferred is not None:
                    raise deferred

            on_rank0(outcome, f"the stepvault save of step {step}")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A validation right after a save, at its step, measured that checkpoint's weights:
        its metrics are annotated onto it (KeepBest and ``restore("best")`` use them). The
        save itself recorded the previous validation's values, of older weights."""
        saved, self._saved = self._saved, None
        if trainer.sanity_checking or saved is None or saved[0] != trainer.global_step:
            return
        now = finite_metrics(trainer.callback_metrics)
        fresh = {k: v for k, v in now.items() if saved[1].get(k) != v}
        if self.manager is None or not fresh:
            return
        self.manager.wait()  # every rank with a manager (a sharded job's are collective)
        self._annotated = fresh
        if not trainer.is_global_zero:
            return  # one process annotates: rank 0, which holds (or leads) the manager
        if saved[0] not in self.manager.store.list_steps(self.manager.run):
            return  # the save was skipped or failed: nothing to annotate
        from ..catalog.annotations import annotate

        annotate(
            self.manager.store, self.manager.run, saved[0], fresh, note="validation at this step"
        )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.manager is not None:
            self.manager.wait()  # the last save is committed when fit() returns

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close(quiet=True)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            if self._uninstall_loaders is not None:
                self._uninstall_loaders()
                self._uninstall_loaders = None
            self._close(quiet=False)
        if self._io is not None and trainer.strategy.checkpoint_io is self._io:
            trainer.strategy.checkpoint_io = self._io.wrapped  # the trainer without us again
        self._io = None
        if self._untake is not None:
            self._untake()
            self._untake = None

    def _close(self, *, quiet: bool) -> None:
        self._signals.uninstall()
        mgr, self.manager = self.manager, None
        if mgr is None:
            return
        try:
            mgr.close()
        except BaseException:
            if not quiet:
                raise

    # ------------------------------------------------------------------ save and load
    def _split(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Lightning's checkpoint dict as a stepvault state (model weights + the rest)."""
        rest = self._rest(checkpoint, ("state_dict",))
        return {MODEL_KEY: _StateDictView(checkpoint.get("state_dict", {})), LIGHTNING_KEY: rest}

    def _rest(self, checkpoint: dict[str, Any], drop: tuple[str, ...]) -> dict[str, Any]:
        """Lightning's checkpoint dict without ``drop`` (what is stored apart), its
        unencodable hyperparameters stringified when asked to."""
        rest = {k: v for k, v in checkpoint.items() if k not in drop}
        hparams = rest.get("hyper_parameters")
        if isinstance(hparams, dict) and self.unsupported_hparams == "str":
            found: list[str] = []
            rest["hyper_parameters"] = _stringify_unencodable(hparams, "hyper_parameters", found)
            if found:
                warnings.warn(
                    "stepvault: stored the repr of hyperparameters the safe encoding refuses: "
                    + ", ".join(found),
                    RuntimeWarning,
                    stacklevel=4,
                )
        return rest

    def _store_checkpoint(self, checkpoint: dict[str, Any], step: int) -> None:
        """Called by the plugin with Lightning's checkpoint dict for ``stepvault:<step>``."""
        mgr = self.manager
        if mgr is None:
            raise StepvaultError(
                "saving to a stepvault: path needs a fitting Trainer with StepvaultCheckpoint"
            )
        due = self._due if self._due is not None and self._due[0] == step else None
        epoch = due[1] if due else checkpoint.get("epoch")
        metrics = due[2] if due else {}
        metadata = self._metadata()
        try:
            try:
                # A due save follows the policy's decision (its kind, urgency, exit); a
                # direct trainer.save_checkpoint("stepvault:N") always saves a full one.
                mgr.save(
                    step,
                    self._split(checkpoint),
                    epoch=epoch,
                    metrics=metrics,
                    metadata=metadata,
                    force=due is None,
                    # issue 19: hparams.json/yaml, for `stepvault export`
                    attachments=hparams_files(checkpoint.get("hyper_parameters")),
                )
            except UnsupportedTypeError as exc:
                raise UnsupportedTypeError(
                    f"{exc}\n(state['lightning'] is Lightning's checkpoint dict: callbacks' "
                    "state_dict(), on_save_checkpoint() additions and save_hyperparameters(); "
                    "state['model'] is the module's state_dict)"
                ) from None
        except BaseException as exc:
            if due is None or rank_and_world()[1] == 1:
                raise
            # Several processes: the other ranks wait in save_checkpoint's barrier; raising
            # here would leave them there. on_train_batch_end raises it on every rank.
            self._deferred = exc

    def _metadata(self) -> dict[str, Any]:
        return {
            "framework": "lightning",
            "lightning_version": self._pl.__version__,
            "stepvault_version": __version__,
        }

    def _sharded_state(self, strategy: Any, rest: Any) -> dict[str, Any]:
        """The live sharded objects of a sharding strategy, as the collective manager
        saves and restores them: the (wrapped) module, each optimizer, Lightning's dict."""
        _fsdp1_mesh(strategy)
        state: dict[str, Any] = {MODEL_KEY: strategy.model}
        for i, opt in enumerate(strategy.optimizers):
            state[f"optimizer_{i}"] = getattr(opt, "_optimizer", opt)  # a LightningOptimizer
        state[LIGHTNING_KEY] = rest
        return state

    def _store_sharded(self, checkpoint: dict[str, Any], step: int, strategy: Any) -> None:
        """Every rank: Lightning's dict of ``step`` under a sharding strategy, saved by the
        collective manager (each rank writes its own shards; one commit).

        The module and optimizers are saved from the live objects (their DCP state dicts,
        FQN-keyed and sharded, as the strategy's own save takes them); the rest of
        Lightning's dict (loops, callbacks with every rank's RNG state, schedulers,
        hyperparameters) is one value of typed JSON (no pickle), written once.
        """
        from ..distributed.planners import encode_value

        mgr = self.manager
        if mgr is None:
            raise StepvaultError(
                "saving to a stepvault: path needs a fitting Trainer with StepvaultCheckpoint"
            )
        due = self._due if self._due is not None and self._due[0] == step else None
        rest = self._rest(checkpoint, ("state_dict", "optimizer_states"))
        try:
            # One string (a leaf for DCP): a restore then needs no template of its shape.
            encoded = encode_value(rest, LIGHTNING_KEY).decode()
        except UnsupportedTypeError as exc:
            raise UnsupportedTypeError(
                f"{exc}\n(state['lightning'] is Lightning's checkpoint dict: callbacks' "
                "state_dict(), on_save_checkpoint() additions and save_hyperparameters())"
            ) from None
        mgr.save(
            step,
            self._sharded_state(strategy, encoded),
            epoch=due[1] if due else checkpoint.get("epoch"),
            metrics=due[2] if due else {},
            metadata={**self._metadata(), "lightning_strategy": type(strategy).__name__},
            force=due is None,
        )

    def _load_sharded(self, step: int | Literal["latest", "best"], strategy: Any) -> dict[str, Any]:
        """Every rank: restore ``step`` into the live sharded module and optimizers (the
        ranks agree on the checkpoint and fall back together past a damaged one) and
        return the rest of Lightning's dict, as the strategy's own ``load_checkpoint``."""
        from ..distributed.planners import decode_value_bytes

        mgr = self.manager
        if mgr is None:
            raise StepvaultError(
                f"loading {PREFIX}{step} under {type(strategy).__name__} needs a fitting "
                "Trainer with StepvaultCheckpoint (the restore is collective)"
            )
        state = self._sharded_state(strategy, "")
        info = self._accept(mgr.restore(state, step))
        encoded = state[LIGHTNING_KEY]
        if not isinstance(encoded, str) or not encoded:
            raise StepvaultError(
                f"{self.run}@{info.step} holds no Lightning state of a sharded save; it "
                "cannot resume a Trainer under this strategy"
            )
        checkpoint: dict[str, Any] = decode_value_bytes(encoded.encode())
        return checkpoint

    def load(self, step: int | Literal["latest", "best"] = "latest") -> dict[str, Any]:
        """Lightning's checkpoint dict of ``step``, read and verified from the store.

        ``"latest"`` is the newest full checkpoint that verifies (damaged ones are skipped,
        reported in :attr:`last_restore`); an int is exactly that step. With several
        processes (Lightning loads on every rank) rank 0 chooses the checkpoint and the
        other ranks read exactly that step, so that every rank resumes from the same one.
        """
        rank, world = rank_and_world()
        if world == 1:
            return self._read(step)
        mine: dict[str, Any] = {}

        def choose() -> RestoreInfo:
            mine["checkpoint"] = self._read(step)
            assert self.last_restore is not None  # _read() sets it
            return self.last_restore

        chosen = on_rank0(choose, "loading the stepvault checkpoint")
        if rank == 0:
            return mine["checkpoint"]
        checkpoint = self._read(chosen.step)
        assert self.last_restore is not None  # _read() sets it
        self.last_restore = dataclasses.replace(self.last_restore, skipped=chosen.skipped)
        return checkpoint

    def _accept(self, info: RestoreInfo | None) -> RestoreInfo:
        """The restore a load takes (sharded or not): none is an error naming the way out;
        the damaged checkpoints it passed over are warned about, once each."""
        if info is None:
            raise StepvaultError(
                f"run {self.run!r} has no checkpoint in {self.root}: start without "
                "ckpt_path (ckpt.resume_path is None on a fresh start)"
            )
        self.last_restore = info
        for skipped in info.skipped:
            warnings.warn(
                f"stepvault: skipped damaged checkpoint {self.run}@{skipped.step}: "
                f"{skipped.reason}",
                RuntimeWarning,
                stacklevel=4,
            )
        return info

    def _read(self, step: int | Literal["latest", "best"]) -> dict[str, Any]:
        live = self._live_holder(step)
        holder: dict[str, Any] = live or {MODEL_KEY: None, LIGHTNING_KEY: None}
        if self.manager is not None:
            info = self._accept(self.manager.restore(holder, step, strict=False))
        else:
            info = self._accept(
                read_checkpoint(self.root, self.run, holder, step, best=self._best())
            )
        if live is not None:
            return _resharded_checkpoint(holder, info)
        if holder[LIGHTNING_KEY] is None:
            # A weights-only checkpoint: enough for validate/test/predict; fit() stops with
            # Lightning's own "checkpoint contains only the model" error.
            weights = holder[MODEL_KEY] or {}
            return {"state_dict": weights, "pytorch-lightning_version": self._pl.__version__}
        metadata = info.metadata if isinstance(info.metadata, dict) else {}
        layout = metadata.get("lightning_layout")
        if isinstance(layout, dict):
            return self._imported(holder, info, layout, metadata)
        checkpoint = dict(holder[LIGHTNING_KEY])
        checkpoint["state_dict"] = holder[MODEL_KEY] or {}
        return checkpoint

    def _live_holder(self, step: int | Literal["latest", "best"]) -> dict[str, Any] | None:
        """DDP (or one process) reading a checkpoint a sharding strategy wrote (the newest
        candidate is one several ranks wrote): the live LightningModule and fresh optimizers
        from its ``configure_optimizers`` to restore it into, each rank reading the full
        tensors alone (the restore planner's rank-local reshard; Lightning loads a DDP
        checkpoint before it builds its own optimizers). None otherwise."""
        module = getattr(self, "_live_module", None)
        if self._sharded or module is None or getattr(module, "_trainer", None) is None:
            return None
        from ..catalog import checkpoint_records
        from ..core.planner import Source
        from ..format import parse_manifest
        from ..store import Store

        try:
            store = Store.open(self.root)
            source = Source(
                store,
                self.run,
                records=lambda: checkpoint_records(store, self.run, protected=False),
            )
            steps = source.choose(step, best=self._best()).steps
            if not steps:
                return None
            data = store.read_manifest(self.run, steps[0])
            if not parse_manifest(data, f"{self.run}@{steps[0]}").sharded:
                return None
        except (StepvaultError, ValueError):
            return None  # damaged, absent, no metric for "best": the restore reports it
        import importlib  # Lightning's own parsing of configure_optimizers()

        core = importlib.import_module(f"{self._pl.__name__}.core.optimizer")
        optimizers, _ = core._init_optimizers_and_lr_schedulers(module)
        holder: dict[str, Any] = {MODEL_KEY: module}
        for i, opt in enumerate(optimizers):
            holder[f"optimizer_{i}"] = opt
        holder[LIGHTNING_KEY] = ""  # the rest of Lightning's dict: one typed-JSON string
        return holder

    def _imported(
        self,
        holder: dict[str, Any],
        info: RestoreInfo,
        layout: dict[str, Any],
        metadata: dict[str, Any],
    ) -> dict[str, Any]:
        """Lightning's dict of a checkpoint imported from a ``.ckpt`` (``stepvault
        import``): the importer moved ``optimizer_states``/``lr_schedulers`` into entries of
        their own (``optimizer``, ``scheduler_1``...), listed in ``lightning_layout``; read
        those too (from the same step) and put them back where Lightning looks."""
        from ..ops.migrate import to_lightning_checkpoint

        keys = [k for ks in layout.values() if isinstance(ks, list) for k in ks]
        extra: dict[str, Any] = dict.fromkeys(keys)
        if extra:  # read-only, not a second restore of the run (no event, no counts)
            store = self.manager.store if self.manager is not None else self.root
            read_checkpoint(store, self.run, extra, info.step)
        absent = [k for k in keys if extra[k] is None]
        if absent:
            raise StepvaultError(
                f"{self.run}@{info.step}: its lightning_layout names {', '.join(absent)} but "
                "the checkpoint does not hold them; re-import the .ckpt (`stepvault import "
                "... --overwrite`)"
            )
        missing = metadata.get("missing")
        if self.manager is not None and isinstance(missing, dict):
            # fit(): Lightning resumes with these fresh (empty lists), not where they were.
            warn_resume_gaps(self.run, info.step, metadata, list(missing))
        return to_lightning_checkpoint({**extra, **holder}, layout)


def _resharded_checkpoint(holder: dict[str, Any], info: RestoreInfo) -> dict[str, Any]:
    """Lightning's checkpoint dict of a sharded job's checkpoint restored into the live
    module and fresh optimizers (:meth:`StepvaultCheckpoint._live_holder`): the weights and
    the optimizers' state in their one-process form, for Lightning's DDP restore."""
    from ..distributed.planners import decode_value_bytes

    encoded = holder[LIGHTNING_KEY]
    if not isinstance(encoded, str) or not encoded:
        raise StepvaultError(
            f"{info.run}@{info.step} holds no Lightning state of a sharded save; it cannot "
            "resume a Trainer"
        )
    checkpoint: dict[str, Any] = decode_value_bytes(encoded.encode())
    checkpoint["state_dict"] = {k: v.clone() for k, v in holder[MODEL_KEY].state_dict().items()}
    opts = sorted((k for k in holder if k.startswith("optimizer_")), key=lambda k: int(k[10:]))
    checkpoint["optimizer_states"] = [holder[k].state_dict() for k in opts]
    return checkpoint


def _check_fsdp1(strategy: Any) -> None:
    """Refuse, at setup (before any collective), an ``FSDPStrategy`` without a
    ``device_mesh`` that :func:`._fsdp1.give_world_mesh` cannot give the 1-D world mesh:
    hybrid sharding, ``NO_SHARD`` and a ``process_group`` of its own. Without a mesh FSDP1
    shards its state as ``ShardedTensor``s, which torch 2.13's asynchronous staging cannot
    copy; with the world mesh attached after wrapping (:func:`_fsdp1_mesh`) the same
    shards are DTensors, as ``device_mesh=(world_size,)`` would make them."""
    from ._fsdp1 import FLAT_STRATEGIES

    if type(strategy).__name__ == "ModelParallelStrategy" or not hasattr(strategy, "kwargs"):
        return
    if strategy.kwargs.get("device_mesh") is not None:
        return  # FSDP1 over the user's mesh: DTensor state dicts already
    name = type(strategy).__name__
    sharding = getattr(getattr(strategy, "sharding_strategy", None), "name", "FULL_SHARD")
    if sharding not in FLAT_STRATEGIES:
        raise StepvaultError(
            f"StepvaultCheckpoint does not support {name}(sharding_strategy="
            f'"{sharding}") without a device_mesh: its state is not sharded over one '
            "world-sized group, which the collective save needs. Use FULL_SHARD or "
            "SHARD_GRAD_OP, or ModelParallelStrategy (FSDP2 fully_shard over a 2-D mesh in "
            'configure_model) for hybrid sharding; NO_SHARD is DDP: use strategy="ddp"'
        )
    if strategy.kwargs.get("process_group") is not None:
        raise StepvaultError(
            f"StepvaultCheckpoint does not support {name}(process_group=...): an FSDP1 "
            "module sharded over a group other than the world is not saved collectively. "
            "Leave process_group out (the world), or use ModelParallelStrategy (FSDP2) "
            "with a device mesh"
        )


def _fsdp1_mesh(strategy: Any) -> None:
    """Give a wrapped FSDP1 model (``FSDPStrategy`` without a ``device_mesh``) the 1-D
    world mesh, so that its state dicts are DTensors (see :mod:`._fsdp1`). Called once the
    strategy has wrapped the module: before the first save, restore or staging. A no-op
    for FSDP2 and for FSDP1 built over a mesh."""
    from ._fsdp1 import give_world_mesh, is_fsdp1

    model = getattr(strategy, "model", None)
    if model is not None and is_fsdp1(model):
        give_world_mesh(model, f"StepvaultCheckpoint under {type(strategy).__name__}")


def _without_sigterm_collective(trainer: pl.Trainer) -> None:
    """Keep Lightning's SIGTERM handler from running a collective inside a signal handler
    when a save policy answers SIGTERM (``OnSignal``) in a sharded job.

    Lightning's notifier broadcasts a tensor from inside the handler; a rank that is in
    another collective at that moment (a sharded save's DCP exchange, the manager's
    agreement on a decision) pairs it with the wrong peer call and the job hangs. The
    policy's handler already records the signal; the manager's agreed decision then saves
    on every rank and exits them together. Lightning's notifier is replaced by one that
    only passes the signal on to the processes Lightning started (as Lightning's does).
    """
    import signal

    from ..policy.signals import OnSignal

    composed = signal.getsignal(signal.SIGTERM)
    handlers = getattr(composed, "signal_handlers", None)
    connector = getattr(trainer, "_signal_connector", None)
    if not isinstance(handlers, list) or connector is None:
        return
    notifier = getattr(connector, "_sigterm_notifier_fn", None)
    answered = any(
        getattr(h, "__func__", None) is OnSignal._handle and signal.SIGTERM in h.__self__.signals
        for h in handlers
    )
    if notifier not in handlers or not answered:
        return
    passed_on: list[int] = []

    def pass_on(signum: int, frame: Any) -> None:
        launcher = trainer.strategy.launcher
        if not passed_on and launcher is not None:
            passed_on.append(signum)
            launcher.kill(signum)

    handlers[handlers.index(notifier)] = pass_on


def _bulk(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """The module and optimizers: the bytes of Lightning's checkpoint dict, to prepare."""
    bulk: dict[str, Any] = {"model": pl_module}
    for i, opt in enumerate(trainer.optimizers):
        bulk[f"optimizer_{i}"] = opt
    return bulk
