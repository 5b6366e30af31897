"""torchtitan: the trainer's checkpoints go through stepvault's collective save.

torchtitan builds its checkpointer from the trainer config's ``checkpoint`` field
(``BaseCheckpointManager.Config``; ``Config.build()`` makes the manager the Config is
nested in). :class:`StepvaultCheckpointManager` is such a manager, so a job switches by
one config line in its ``config_registry`` function::

    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from stepvault.integrations.torchtitan import StepvaultCheckpointManager

    def llama3_stepvault():
        config = llama3_debugmodel()
        config.checkpoint = StepvaultCheckpointManager.Config(
            enable=True, folder="checkpoint", interval=10, run="llama3", keep_last=3
        )
        return config

and runs as before (``torchrun ... -m torchtitan.train --module mypkg.configs --config
llama3_stepvault``). Every rank holds one collective :class:`~stepvault.CheckpointManager`
(the path the other sharded integrations use): at each due step every rank writes its own
shards of the model (FSDP2/TP DTensors) and of the optimizer, rank 0 writes the lr
schedulers and the train state, each rank its own dataloader position; rank 0 commits once
every rank succeeded (one atomic manifest), then applies the keep policy (``keep_last``,
``keep_every``: stepvault's retention replaces ``keep_latest_k``). With ``async_save`` the
training step waits only for the copy into host buffers.

Resume (``Trainer.train`` calls ``checkpointer.load``): rank 0 chooses the newest full
checkpoint, every rank verifies what it reads and the ranks agree before any state is
changed; a damaged shard on any rank makes every rank fall back to the previous
checkpoint. A run with no checkpoint in the store takes torchtitan's own initial load
(``initial_load_path``, HF weights) or starts fresh, as torchtitan does.

Nothing is pickled: torchtitan's dataloader pickles its state into the checkpoint; this
manager stores the state of the underlying ``StatefulDataLoader`` in stepvault's safe
encoding instead (one value per data-parallel rank) and loads it back without pickle.
That position cannot be split or joined, so a resume with another data-parallel degree is
refused before anything is loaded (``exclude_from_loading`` names the way out).

Preemption: torchtitan has no signal handling, but calls the checkpointer's ``save``
after every step on every rank; with ``preemption`` (default) a SIGTERM/SIGUSR1 makes the
ranks write one collective checkpoint at the next step's end and exit with the policy's
code (stepvault's ``OnSignal``). :func:`export_hf` writes a Hugging Face folder of a
checkpoint's model through torchtitan's own state-dict adapter.

(Its length: one torchtitan extension point, the ``CheckpointManager`` subclass its
``[checkpoint]`` config names, holds every piece torchtitan hands stepvault: save, load,
preemption and the data-parallel check share its configuration and state.)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torchtitan.components.checkpointer import dcp as _tt_dcp
from torchtitan.components.checkpointer.base import DATALOADER
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.tools.logging import logger

from .._version import __version__
from ..catalog.vault import Vault
from ..distributed.planners import decode_value_bytes, encode_value
from ..errors import StepvaultError
from ..format.encoding import torch_dtype
from ..manager import CheckpointManager
from ..ops.export import weight_tensors
from ..ops.safetensors_stream import write_streamed
from ..policy import Every, KeepEvery, KeepLast, KeepPolicy, OnSignal
from ..store import Store

__all__ = ["StepvaultCheckpointManager", "export_hf"]


class _Stateful:
    """One torchtitan state object as stepvault sees it: a ``state_dict()`` object.

    torchtitan's optimizer container *is* a ``torch.optim.Optimizer`` whose state dict is
    already flattened to parameter names (DTensor shards); stepvault would otherwise pair it
    with a module. Seen as a plain stateful object it is saved exactly as torchtitan's own
    DCP save takes it.
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self.obj.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(state_dict)


class _Loader(_Stateful):
    """A ``ParallelAwareDataloader``: its ``StatefulDataLoader`` state in the safe encoding,
    one string per data-parallel rank (``dp_rank_<r>``, as torchtitan keys it), instead of
    the pickle torchtitan's ``state_dict`` returns."""

    def state_dict(self) -> dict[str, Any]:
        loader = self.obj
        inner = super(ParallelAwareDataloader, loader).state_dict()
        key = loader._rank_id
        # One string leaf: a restore needs no template of the loader state's shape.
        return {
            key: encode_value(inner, f"{DATALOADER}.{key}").decode(),
            "world_size": loader.dp_world_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        loader = self.obj
        encoded = state_dict.get(loader._rank_id)
        if not isinstance(encoded, str) or not encoded:
            raise StepvaultError(
                f"the checkpoint holds no dataloader state for {loader._rank_id}: it was "
                "saved with another data-parallel degree. Resume with the same degree, or "
                'add "dataloader" to checkpoint.exclude_from_loading to restart the data'
            )
        if state_dict.get("world_size") != loader.dp_world_size:
            raise StepvaultError(
                f"the checkpoint's dataloader state is of {state_dict.get('world_size')} "
                f"data-parallel ranks, this job has {loader.dp_world_size}: resume with the "
                'same degree, or add "dataloader" to checkpoint.exclude_from_loading'
            )
        super(ParallelAwareDataloader, loader).load_state_dict(decode_value_bytes(encoded.encode()))


class StepvaultCheckpointManager(_tt_dcp.CheckpointManager):
    """torchtitan's checkpoint manager, saving and resuming through stepvault.

    Built by torchtitan from :class:`StepvaultCheckpointManager.Config` (the trainer
    config's ``checkpoint`` field). ``folder`` (under the trainer's ``dump_folder``, or
    any URL stepvault opens, e.g. ``s3://``) is the stepvault store; ``interval`` and
    ``enable_first_step_checkpoint`` say when to save, as in torchtitan; ``load_step``
    (an exact step, never a fallback) and ``exclude_from_loading`` apply to the resume.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(_tt_dcp.CheckpointManager.Config):
        """torchtitan's checkpoint settings plus stepvault's (run, retention, async)."""

        run: str = "torchtitan"
        """The stepvault run the checkpoints belong to."""

        keep_last: int = 3
        """Keep the newest ``keep_last`` checkpoints (stepvault's KeepLast); 0 keeps all."""

        keep_every: int = 0
        """Also keep every checkpoint whose step is a multiple of this (0: none)."""

        async_save: bool = True
        """Write in the background: the step waits only for the copy to host memory."""

        codec: str | None = None
        """stepvault's codec for the hot tier (None: raw chunks)."""

        preemption: bool = True
        """SIGTERM or SIGUSR1 (a scheduler's preemption notice) to the ranks: every rank
        writes one collective checkpoint after the step it is in, then exits with
        ``preemption_exit_code`` (stepvault's ``OnSignal``). False: torchtitan's default
        (the signal ends the process at once)."""

        preemption_exit_code: int | None = None
        """The exit code after a preemption save (None: 128 + the signal, 143 for SIGTERM)."""

        keep_latest_k: int = 0
        """Not used: retention is stepvault's (``keep_last``, ``keep_every``)."""

        last_save_model_only: bool = False
        """Must stay False: the last checkpoint is a full one (export it with stepvault)."""

        def __post_init__(self) -> None:
            _tt_dcp.CheckpointManager.Config.__post_init__(self)
            if self.keep_latest_k:
                raise ValueError(
                    f"checkpoint.keep_latest_k={self.keep_latest_k}: with stepvault the "
                    "retention is its keep policy; set keep_last (and keep_every) instead "
                    "and keep_latest_k=0"
                )
            if self.async_mode != "disabled":
                raise ValueError(
                    f"checkpoint.async_mode={self.async_mode!r}: stepvault saves in the "
                    "background itself; leave async_mode='disabled' and use async_save"
                )
            if self.last_save_model_only or self.last_save_in_hf:
                raise ValueError(
                    "checkpoint.last_save_model_only/last_save_in_hf: with stepvault the "
                    "last checkpoint is a full one; export its weights with `stepvault "
                    "export` (safetensors or a Hugging Face folder). Set both to False"
                )
            if self.keep_last < 0 or self.keep_every < 0:
                raise ValueError("checkpoint.keep_last and keep_every must be >= 0")
            code = self.preemption_exit_code
            if code is not None and not 0 <= code <= 255:
                raise ValueError(
                    f"checkpoint.preemption_exit_code={code}: an exit code is 0..255; leave "
                    "it unset for 128 + the signal (143 for SIGTERM)"
                )

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self.run: str = config.run
        #: stepvault's signal rule (None: preemption off). torchtitan decides its saves
        #: itself (``_should_save``: interval, first and last step); the manager's own
        #: policy is asked at every other step only for a signal.
        self.on_signal: OnSignal | None = (
            OnSignal(exit_code=config.preemption_exit_code) if config.preemption else None
        )
        self.manager = CheckpointManager(
            self.folder,
            config.run,
            # The manager installs the signal handlers on every rank (main thread: torchtitan
            # builds its checkpointer in Trainer.__init__) and the ranks agree at each step.
            save=self.on_signal if self.on_signal is not None else Every(steps=config.interval),
            keep=_keep_policy(config),
            async_save=config.async_save,
            codec=config.codec,
        )
        #: the RestoreInfo of the last load (its ``skipped``: damaged checkpoints passed over)
        self.last_restore: Any = None

    def _states(self, keys: list[str] | None = None) -> dict[str, Any]:
        """The trainer's states as stepvault saves them (``keys``: only those)."""
        out: dict[str, Any] = {}
        for key, obj in self.states.items():
            if obj is None or (keys is not None and key not in keys):
                continue
            if key == DATALOADER and isinstance(obj, ParallelAwareDataloader):
                out[key] = _Loader(obj)
            else:
                out[key] = _Stateful(obj)
        return out

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        # torchtitan calls this after every step on every rank (Trainer.train): its own
        # schedule is the same on every rank; a preemption signal may reach the ranks at
        # different steps, so then the manager asks every rank at each step (one small
        # all-gather) and they save together at the first step after any rank got it.
        due = self._should_save(curr_step, last_step)
        if not due and (self.on_signal is None or self.load_only):
            return False
        begin = time.monotonic()
        # The manager's save is collective: each rank its shards, one commit. After a
        # preemption save it closes itself and raises SystemExit with the policy's code on
        # every rank (synchronous: the checkpoint is committed first).
        handle = self.manager.save(
            curr_step,
            self._states(),
            force=due,
            metadata={
                "framework": "torchtitan",
                "stepvault_version": __version__,
                "torchtitan_states": sorted(k for k, v in self.states.items() if v is not None),
            },
        )
        if handle is None:  # not due, no signal
            return False
        logger.info(
            "stepvault: checkpoint of step %d staged in %.2f s (run %r in %s)",
            curr_step,
            time.monotonic() - begin,
            self.run,
            self.folder,
        )
        return True

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        if step == -1 and self.manager.latest_step is None:
            # No stepvault checkpoint yet: torchtitan's own first load (initial_load_path,
            # HF weights) or a fresh start. Its folder scan finds no step-N folder here.
            return bool(super()._load(step))
        for key in self.exclude_from_loading:
            if key not in self.states:
                raise StepvaultError(
                    f"checkpoint.exclude_from_loading names {key!r}, not one of the "
                    f"trainer's states {sorted(self.states)}"
                )
        keys = [k for k in self.states if k not in self.exclude_from_loading]
        if DATALOADER in keys:
            # Before anything is loaded: a refused resume changes no training state.
            self._check_loader_degree(self.manager.latest_step if step == -1 else step)
        state = self._states(keys)
        begin = time.monotonic()
        info = self.manager.restore(state, "latest" if step == -1 else step)
        if info is None:  # latest_step said there was one: removed meanwhile
            raise StepvaultError(
                f"run {self.run!r} in {self.folder} has no checkpoint to resume from"
            )
        self.last_restore = info
        for skipped in info.skipped:
            logger.warning(
                "stepvault: skipped damaged checkpoint %s@%d: %s",
                self.run,
                skipped.step,
                skipped.reason,
            )
        logger.info(
            "stepvault: resumed from %s@%d in %.2f s", self.run, info.step, time.monotonic() - begin
        )
        return True

    def _check_loader_degree(self, step: int | None) -> None:
        """Refuse a checkpoint whose dataloader state is of another data-parallel degree
        (torchtitan's data position is one per dp rank: it cannot be split or joined)."""
        loader = self.states.get(DATALOADER)
        if step is None or not isinstance(loader, ParallelAwareDataloader):
            return
        try:
            manifest = Vault(self.manager.store).manifest(self.run, step)
        except (StepvaultError, OSError):
            return  # damaged or not in this tier: the restore falls back or says so itself
        entries = (manifest.sharded or {}).get("entries", {})
        saved = entries.get(f"{DATALOADER}.world_size", {}).get("value")
        if saved is not None and saved != loader.dp_world_size:
            raise StepvaultError(
                f"{self.run}@{step} holds the dataloader position of {saved} data-parallel "
                f"ranks; this job has {loader.dp_world_size} (the position is one per dp "
                "rank: it cannot be split or joined). Resume with the same data-parallel "
                'degree, or add "dataloader" to checkpoint.exclude_from_loading to load '
                "the model, optimizer and schedulers (resharded) and restart the data"
            )

    def _maybe_wait_for_staging(self) -> None:
        # stepvault's staging (the copy to host buffers) finishes inside save().
        return None

    def _wait_for_saving(self) -> None:
        self.manager.wait()
        self.save_future = None

    def _close(self) -> None:
        super()._close()
        manager = getattr(self, "manager", None)
        if manager is not None:
            manager.close()  # waits for the save in flight: its commit is not lost


def _keep_policy(config: StepvaultCheckpointManager.Config) -> KeepPolicy | None:
    rules: list[KeepPolicy] = []
    if config.keep_last:
        rules.append(KeepLast(config.keep_last))
    if config.keep_every:
        rules.append(KeepEvery(steps=config.keep_every))
    if not rules:
        return None
    policy = rules[0]
    for rule in rules[1:]:
        policy = policy | rule
    return policy


def export_hf(
    root: str | os.PathLike[str] | Store,
    run: str,
    out: str | os.PathLike[str],
    *,
    adapter: Any,
    config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    step: int | str = "latest",
) -> Path:
    """Write a Hugging Face folder (``config.json`` + ``model.safetensors``) of the model
    in a torchtitan checkpoint, for ``from_pretrained``.

    ``adapter``: torchtitan's state-dict adapter of the model, e.g.
    ``Llama3StateDictAdapter(model_config, hf_assets_path)`` (``model_spec.state_dict_adapter``):
    its ``to_hf`` gives the Hugging Face names and layouts (the q/k permutation of llama).
    ``config``: the Hugging Face model config, a dict or a ``config.json`` path; None takes
    ``config.json`` from the adapter's ``hf_assets_path``. Each tensor is joined from the
    ranks' shards, converted and written one at a time: the model is never whole in memory.
    Returns ``out``.
    """
    target = Path(out)
    if config is None:
        assets = getattr(adapter, "hf_assets_path", None)
        if not assets or not (Path(assets) / "config.json").is_file():
            raise StepvaultError(
                f"no Hugging Face config for the export: the adapter's hf_assets_path "
                f"({assets!r}) has no config.json; pass config= (a dict or a config.json path)"
            )
        config = Path(assets) / "config.json"
    hf_config = (
        dict(config) if isinstance(config, Mapping) else json.loads(Path(config).read_text())
    )
    store = root if isinstance(root, Store) else Store.open(root)
    items = []
    for name, load in weight_tensors(Vault(store), run, step, "model"):
        assert load.shape is not None and load.dtype is not None  # a sharded manifest's entry
        # The plan (names, dtypes, shapes) from meta tensors: nothing is read yet.
        meta = torch.empty(load.shape, dtype=torch_dtype(load.dtype), device="meta")
        outs = [(k, v.dtype, tuple(v.shape)) for k, v in adapter.to_hf({name: meta}).items()]
        if outs:  # e.g. a tied lm_head the adapter drops
            items.append((name, load, outs))
    if not items:
        raise StepvaultError(f"{run}@{step} holds no model weights the adapter maps to HF names")

    def produce(name: str, load: Any) -> dict[str, torch.Tensor]:
        converted: dict[str, torch.Tensor] = adapter.to_hf({name: load()})
        return {k: v.contiguous() for k, v in converted.items()}

    target.mkdir(parents=True, exist_ok=True)
    write_streamed(str(target / "model.safetensors"), items, {"format": "pt"}, produce)
    (target / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return target
