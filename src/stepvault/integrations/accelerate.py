"""Hugging Face Accelerate: ``save_state``/``load_state`` of an ``Accelerator`` through stepvault.

::

    from accelerate import Accelerator
    from stepvault import Every, KeepLast
    from stepvault.integrations.accelerate import AcceleratorCheckpointer

    accelerator = Accelerator()
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    progress = {"epoch": 0}
    ckpt = AcceleratorCheckpointer(accelerator, "ckpts", run="exp1", extra=progress,
                                   save=Every(steps=500), keep=KeepLast(3))
    ckpt.restore()                        # newest checkpoint that verifies; None when fresh
    for step in ...:
        ...
        ckpt.save(step + 1)               # the policy decides; async by default
    ckpt.close()

or, one checkpoint at a time, the equivalents of ``accelerator.save_state(dir)`` /
``accelerator.load_state(dir)``::

    save_state(accelerator, "ckpts", run="exp1", step=step)
    load_state(accelerator, "ckpts", run="exp1")            # newest that verifies

What is saved is what ``Accelerator.save_state`` saves — every prepared model (unwrapped),
optimizer and scheduler, the ``GradScaler``, the state of stateful data loaders
(``DataLoaderConfiguration(use_stateful_dataloader=True)``), the RNGs (Python, numpy,
torch, CUDA), ``accelerator.step`` and each object registered with
``accelerator.register_for_checkpointing`` — as one verified, pickle-free checkpoint,
plus the ``extra`` values you pass. A stateful loader saved right after the last batch of
an epoch, before the loop has seen the epoch end, resumes with the end of that epoch (its
first ``iter()`` yields nothing, so a ``for batch in loader`` loop runs its end-of-epoch
code and then asks for the next epoch), as :class:`~stepvault.ResumableLoader` does.
With several processes (DDP under ``accelerate launch`` or ``torchrun``) every rank calls
these together, as it calls ``accelerator.save_state``:
replicated tensors are written once, each rank's RNG state is kept apart, and the
checkpoint is committed only once every rank has written its part. With an FSDP plugin
(``FullyShardedDataParallelPlugin(fsdp_version=2)``, or FSDP1 with FULL_SHARD or
SHARD_GRAD_OP, flat or original parameters) the prepared models and optimizers are sharded:
every rank writes and restores its own shards (DTensors; FSDP1 is given the 1-D world
device mesh that makes its state dicts DTensors), the optimizer's moments are loaded into
the live optimizer through ``set_state_dict``, and the checkpoint restores on another
number of ranks or in one process. With a
DeepSpeed plugin (ZeRO 1/2/3) :class:`AcceleratorCheckpointer` saves and resumes the
prepared model's DeepSpeed engine through
:class:`~stepvault.integrations.deepspeed.DeepSpeedCheckpointer` (every rank its own ZeRO
partitions, one collective checkpoint), with the schedulers, stateful loaders,
registered objects, ``accelerator.step``, ``extra`` and every rank's RNGs beside; the
one-shot :func:`save_state`/:func:`load_state` refuse it. Megatron-LM configurations, and
FSDP1's hybrid and NO_SHARD strategies, are refused, saying why and what to use. Accelerate's own
``register_save_state_pre_hook`` / ``register_load_state_pre_hook`` only change how model
weights are written next to pickled optimizer and RNG files in a folder, so they are not
used (and not called).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Any, Literal

from ._common import missing_framework, sharded_collective
from ._fsdp1 import give_world_mesh, is_fsdp1
from ._staging import StagingPreparer
from .accelerate_loaders import _epoch_end_positions, _stateful_loaders

try:
    import accelerate
    from accelerate import Accelerator
except ImportError as exc:
    raise ImportError(
        missing_framework("accelerate", "Hugging Face Accelerate", "accelerate")
    ) from exc

from .._version import __version__
from ..api import RestoreInfo, restore, save
from ..errors import StepvaultError
from ..manager import CheckpointManager, SaveHandle
from ..policy import KeepPolicy, SavePolicy
from ..state import RNGState

__all__ = ["AcceleratorCheckpointer", "accelerator_state", "load_state", "save_state"]

#: Key of ``accelerator.step`` (the gradient-accumulation step counter) in a checkpoint.
STEP_KEY = "accelerate_step"


def _name(kind: str, i: int) -> str:
    return kind if i == 0 else f"{kind}_{i}"


def accelerator_state(
    accelerator: Accelerator, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The stepvault state of everything ``accelerator.save_state`` would save.

    Keys: ``model``, ``optimizer``, ``scheduler`` (``model_1``... for the second and later
    ones), ``dataloader``... (stateful data loaders only), ``scaler``, ``rng``,
    ``accelerate_step``, ``custom_0``... (``register_for_checkpointing``), then ``extra``.
    :func:`save_state` and :class:`AcceleratorCheckpointer` also record whether the loop,
    at an epoch's last batch, has still to see the epoch end (:mod:`.accelerate_loaders`).
    """
    _check_distributed_type(accelerator)
    state: dict[str, Any] = {}
    for i, model in enumerate(accelerator._models):
        if _kind(accelerator) == "FSDP" and is_fsdp1(model):
            # FSDP1: the wrapper itself, whose state dicts are each rank's shards keyed by
            # the model's own names (DTensors once it has the world mesh, see _fsdp1.py)
            give_world_mesh(model, "the stepvault Accelerate integration")
            _check_fsdp1_optimizers(accelerator, model)
            state[_name("model", i)] = model
            continue
        # Unwrapped, so that keys have no "module." prefix and the checkpoint loads (and
        # exports) the same whatever wrapper the next run uses.
        state[_name("model", i)] = accelerator.unwrap_model(model)
    for i, opt in enumerate(accelerator._optimizers):
        state[_name("optimizer", i)] = opt
    for i, sched in enumerate(accelerator._schedulers):
        state[_name("scheduler", i)] = sched
    for i, loader in enumerate(_stateful_loaders(accelerator)):
        state[_name("dataloader", i)] = loader
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    state["rng"] = RNGState()
    state[STEP_KEY] = int(accelerator.step)
    for i, obj in enumerate(accelerator._custom_objects):
        state[f"custom_{i}"] = obj
    for key, value in (extra or {}).items():
        if key in state:
            raise ValueError(f"extra key {key!r} clashes with the accelerator's own {key!r}")
        state[key] = value
    return state


def _check_fsdp1_optimizers(accelerator: Accelerator, model: Any) -> None:
    """Refuse an optimizer made before FSDP1 wrapped the model: its parameters are the
    replaced originals (Accelerate remaps them only for ``use_orig_params=True``), so it
    trains nothing the model holds and its state cannot be keyed by parameter name."""
    live = {id(p) for p in model.parameters()}
    for i, opt in enumerate(accelerator._optimizers):
        params = [p for g in opt.param_groups for p in g["params"]]
        if len(accelerator._models) == 1 and any(id(p) not in live for p in params):
            raise StepvaultError(
                f"optimizer {i} does not hold the parameters of the FSDP1 model (it was "
                "created before accelerator.prepare wrapped the model, which replaced them "
                "with flat parameters): prepare the model first, then create the optimizer "
                "from model.parameters() and prepare it (Accelerate's FSDP1 recipe), or set "
                "use_orig_params=True"
            )


#: Accelerate's sharding engines: their models and optimizers are not what
#: ``unwrap_model`` and the optimizer's ``state_dict`` return on one rank.
_REFUSED = ("DEEPSPEED", "FSDP", "MEGATRON_LM")


def _kind(accelerator: Accelerator) -> str:
    return str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))


def _check_distributed_type(accelerator: Accelerator) -> None:
    kind = _kind(accelerator)
    if kind == "DEEPSPEED":
        raise StepvaultError(
            "save_state/load_state/accelerator_state do not support a DeepSpeed "
            "accelerator: its model and optimizer are a DeepSpeed engine whose ZeRO "
            "partitions only the engine saves and loads. Use AcceleratorCheckpointer, which "
            "drives the engine's own save and load through stepvault on every rank"
        )
    if kind == "FSDP":
        # FSDP2: the prepared models are fully_shard modules (DTensor parameters); FSDP1:
        # FullyShardedDataParallel wrappers, given the world mesh that makes their state
        # dicts DTensors (_fsdp1.py). Every rank saves and restores its own shards through
        # the collective manager (get_state_dict/set_state_dict, not Accelerate's loader).
        return
    if kind in _REFUSED:
        raise StepvaultError(
            f"the stepvault Accelerate integration does not support {kind}: it shards or "
            "wraps the model and optimizer in ways this integration does not save or "
            "restore. Use DDP, FSDP (fsdp_version=2, or FSDP1) or DeepSpeed "
            "(AcceleratorCheckpointer); for another sharded model, put the model and "
            "optimizer in a stepvault.CheckpointManager state called on every rank "
            "(see INTEGRATIONS.md)"
        )


def _metadata() -> dict[str, Any]:
    return {
        "framework": "accelerate",
        "accelerate_version": accelerate.__version__,
        "stepvault_version": __version__,
    }


def _apply_values(
    accelerator: Accelerator, state: Mapping[str, Any], extra: MutableMapping[str, Any] | None
) -> None:
    """Plain values come back in ``state``; put them where they live."""
    accelerator.step = int(state[STEP_KEY])
    if extra is not None:
        for key in extra:
            extra[key] = state[key]


def save_state(
    accelerator: Accelerator,
    root: str | os.PathLike[str],
    *,
    run: str,
    step: int,
    extra: Mapping[str, Any] | None = None,
    **save_options: Any,
) -> Any:
    """``accelerator.save_state`` into checkpoint ``run@step`` of the store at ``root``.

    ``extra``: more values or stateful objects to save with it (e.g. ``{"epoch": 3}``).
    ``save_options`` go to :func:`stepvault.save` (``metrics``, ``codec``, ``overwrite``,
    ...). Returns its :class:`~stepvault.SaveInfo`.
    """
    save_options.setdefault("metadata", _metadata())
    with _epoch_end_positions(accelerator):
        return save(root, accelerator_state(accelerator, extra), run=run, step=step, **save_options)


def load_state(
    accelerator: Accelerator,
    root: str | os.PathLike[str],
    *,
    run: str,
    step: int | Literal["latest"] = "latest",
    extra: MutableMapping[str, Any] | None = None,
    strict: bool = True,
    missing_ok: bool = False,
) -> RestoreInfo | None:
    """``accelerator.load_state`` from the store: the newest checkpoint that verifies
    (``step="latest"``, falling back past damaged ones) or exactly ``step``.

    Like :func:`stepvault.restore`, ``"latest"`` means the newest checkpoint of the run;
    :func:`save_state` always writes full ones. For a run that also has weights-only
    checkpoints (a ``what="weights"`` save policy), use
    :meth:`AcceleratorCheckpointer.restore`, which takes the newest *full* checkpoint.

    Everything is read and verified, and checked against the live objects, before
    anything changes. The plain values of ``extra`` are replaced in that dict. Returns
    None when the run has no checkpoint and ``missing_ok``.
    """
    state = accelerator_state(accelerator, extra)
    info = restore(root, state, run=run, step=step, strict=strict, missing_ok=missing_ok)
    if info is not None:
        _apply_values(accelerator, state, extra)
    return info


def _bulk(state: Mapping[str, Any]) -> dict[str, Any]:
    """The models and optimizers of an accelerator state: its bytes, to prepare."""
    return {k: v for k, v in state.items() if k.startswith(("model", "optimizer"))}


class AcceleratorCheckpointer:
    """A :class:`~stepvault.CheckpointManager` for an ``Accelerator``: save/keep policies,
    asynchronous saves, retention, resume from the newest checkpoint that verifies.

    ``extra`` is a dict of values and stateful objects saved with the accelerator's state;
    :meth:`restore` writes the restored plain values back into it. ``manager_options`` go
    to :class:`~stepvault.CheckpointManager` (``codec``, ``best_metric``,
    ``options=ManagerOptions(...)``...).

    Under DeepSpeed (a ``DeepSpeedPlugin``; create the checkpointer after
    ``accelerator.prepare``) the engine's own save and load run through a
    :class:`~stepvault.integrations.deepspeed.DeepSpeedCheckpointer` (:attr:`deepspeed`):
    every rank writes its ZeRO partitions into one collective checkpoint and a resume
    falls back on every rank together past a damaged one; the schedulers, stateful
    loaders, registered objects, ``accelerator.step`` and ``extra`` travel in the engine's
    ``client_state``, each rank's RNGs beside.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        root: str | os.PathLike[str],
        *,
        run: str,
        save: SavePolicy | None = None,
        keep: KeepPolicy | None = None,
        async_save: bool = True,
        extra: MutableMapping[str, Any] | None = None,
        **manager_options: Any,
    ) -> None:
        self.accelerator = accelerator
        self.extra = extra
        #: the DeepSpeed checkpointer of the prepared engine (None without DeepSpeed)
        self.deepspeed: Any = None
        if _kind(accelerator) == "DEEPSPEED":
            from ._accelerate_deepspeed import deepspeed_engine
            from .deepspeed import DeepSpeedCheckpointer

            self.deepspeed = DeepSpeedCheckpointer(
                deepspeed_engine(accelerator),
                root,
                run,
                save=save,
                keep=keep,
                async_save=async_save,
                **manager_options,
            )
            self.manager = self.deepspeed.manager
        else:
            if _kind(accelerator) == "FSDP":  # its DTensors, on one rank too
                manager_options.setdefault("collective", sharded_collective())
            self.manager = CheckpointManager(
                root, run, save=save, keep=keep, async_save=async_save, **manager_options
            )
        self._prepare_staging = StagingPreparer()

    def restore(
        self, step: int | Literal["latest", "best"] = "latest", *, strict: bool = True
    ) -> RestoreInfo | None:
        """Load the newest full checkpoint that verifies (or ``"best"``, or exactly an int
        step) into the accelerator's objects; None on a fresh start."""
        if self.deepspeed is not None:
            if step == "best":
                raise ValueError(
                    "restore('best') is not available under DeepSpeed: give 'latest' or a "
                    "step number (`stepvault ls` lists them with their metrics)"
                )
            from ._accelerate_deepspeed import apply_client_state

            info = self.deepspeed.resume(step)
            if info is not None:
                where = f"{self.manager.run}@{info.step}"
                apply_client_state(self.accelerator, self.deepspeed.client_state, self.extra, where)
            return info
        state = accelerator_state(self.accelerator, self.extra)
        info = self.manager.restore(state, step, strict=strict)
        if info is not None:
            _apply_values(self.accelerator, state, self.extra)
        # The optimizers as they will be saved (loaded): the first due save only copies.
        self._prepare_staging(self.manager, _bulk(state))
        return info

    def should_save(self, step: int, epoch: int | None = None) -> bool:
        return self.manager.should_save(step, epoch)

    def save(
        self,
        step: int,
        *,
        epoch: int | None = None,
        metrics: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> SaveHandle | None:
        """Save at this step boundary if the policy says so (always with ``force``).

        Call it after the optimizer step, outside ``accelerator.accumulate`` (a save in the
        middle of an accumulation would not hold the accumulated gradients).
        """
        if self.deepspeed is not None:
            from ._accelerate_deepspeed import client_state

            if not (self.manager.should_save(step, epoch) or force):
                return None
            with _epoch_end_positions(self.accelerator):
                client = client_state(self.accelerator, self.extra)
            return self.deepspeed.save(
                step,
                client_state=client,
                metrics=metrics,
                force=True,
                epoch=epoch,
                metadata=_metadata(),
            )
        if self.manager.should_save(step, epoch) or force:
            state = accelerator_state(self.accelerator, self.extra)
            with _epoch_end_positions(self.accelerator):  # the state is taken in save()
                return self.manager.save(
                    step, state, epoch=epoch, metrics=metrics, metadata=_metadata(), force=force
                )
        # Not due: a fresh Adam has its moments now (after its first step), or restore()
        # was never called; prepare for the state as it will be saved.
        self._prepare_staging(self.manager, _bulk(accelerator_state(self.accelerator)))
        return None

    def wait(self) -> Any:
        return self.manager.wait()

    def close(self) -> None:
        if self.deepspeed is not None:
            self.deepspeed.close()  # also gives DeepSpeed back its checkpoint engine
        else:
            self.manager.close()

    def __enter__(self) -> AcceleratorCheckpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.deepspeed is not None:
            self.deepspeed.__exit__(exc_type, exc, tb)
            return
        self.manager.__exit__(exc_type, exc, tb)
