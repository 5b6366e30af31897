"""DeepSpeed ZeRO 1/2/3: the engine's checkpoints go through stepvault's collective save.

::

    import deepspeed
    from stepvault import Every, KeepLast
    from stepvault.integrations.deepspeed import DeepSpeedCheckpointer

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=opt,
                                                           config=ds_config)
    ckpt = DeepSpeedCheckpointer(engine, "ckpts", run="exp1",
                                 save=Every(steps=500), keep=KeepLast(3))
    ckpt.resume()                         # every rank; the newest that verifies, None if fresh
    for batch in loader:
        loss = engine(batch); engine.backward(loss); engine.step()
        ckpt.save()                       # every rank; the policy decides
    ckpt.close()

How it plugs in: DeepSpeed writes a checkpoint through its ``checkpoint_engine``
(``create``, one ``save(state_dict, path)`` per file, ``commit``). The checkpointer puts a
:class:`StepvaultCheckpointEngine` there: ``save`` keeps each file's tree in memory and
``commit`` hands every rank's files to one collective :class:`~stepvault.CheckpointManager`
save — each rank writes its own ZeRO partitions in parallel through
``torch.distributed.checkpoint`` with stepvault's storage (checksums, dedup, async staging),
rank 0 commits once every rank succeeded (one atomic manifest), applies retention and
holds the run's lease. Nothing is pickled: every file is stored packed
(:func:`stepvault.ops.migrate.deepspeed.pack_file`), DeepSpeed's objects in the safe
encoding. Each rank's RNG states (Python, numpy, torch) are saved beside them.

Resume: rank 0 chooses the newest full checkpoint, every rank reads and verifies the files
it needs (its own partition, the module states) and the ranks agree before any byte is
placed; damage on any rank makes every rank fall back to the previous checkpoint together.
Then DeepSpeed's own ``load_checkpoint`` loads those trees through the engine, so what
DeepSpeed restores (module, ZeRO partitions, moments, scheduler, counters, client state)
is exactly what its own save/load restores.

:func:`load_fp32_state_dict` reads a checkpoint of any number of ranks in one process, as
the full fp32 weights (for evaluation and export).

(Its length is the checkpointer's: installing the engine, the collective save at commit,
the agreed resume and the hand-over to DeepSpeed's loader share one state per engine.)
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ._common import missing_framework

try:
    import deepspeed  # noqa: F401
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
        CheckpointCommitInfo,
        CheckpointEngine,
    )
except ImportError as exc:
    raise ImportError(missing_framework("deepspeed", "DeepSpeed", "deepspeed")) from exc

import torch.distributed as dist

from .._rank import current_rank
from ..core.info import RestoreInfo, SkippedCheckpoint
from ..core.planner import Source, share_choice
from ..errors import ResumeGapWarning, StepvaultError
from ..format import decode_value
from ..manager import CheckpointManager, SaveHandle
from ..manager.restoring import record_restored
from ..ops.migrate.deepspeed import (
    MODEL_STATES,
    OPTIM_STATES,
    pack_file,
    register_deepspeed_types,
    unpack_file,
)
from ..ops.migrate.deepspeed_merge import checkpoint_weights
from ..policy import KeepPolicy, SavePolicy
from ..state import RNGState
from ..store import Store

__all__ = [
    "DeepSpeedCheckpointer",
    "StepvaultCheckpointEngine",
    "load_fp32_state_dict",
]

_TAG = re.compile(r"global_step(\d+)$")


class StepvaultCheckpointEngine(CheckpointEngine):
    """DeepSpeed's checkpoint engine, backed by a :class:`DeepSpeedCheckpointer`.

    ``save`` keeps each file's tree (no byte is written); ``commit`` saves every rank's
    files in one collective checkpoint; ``load`` answers from the checkpoint the last
    :meth:`DeepSpeedCheckpointer.resume` read and verified.
    """

    def __init__(self, owner: DeepSpeedCheckpointer) -> None:
        super().__init__(None)
        self.name = "StepvaultCheckpointEngine"
        self.owner = owner
        self.files: dict[str, Any] = {}
        self.loaded: dict[str, Any] = {}

    def create(self, info: CheckpointCommitInfo) -> None:
        self.files = {}

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        # DeepSpeed writes its 'latest' file and zero_to_fp32.py into the save directory
        # itself: the directory must exist (the checkpoint's bytes never go there).
        os.makedirs(path, exist_ok=True)

    def save(self, state_dict: Any, path: str) -> None:
        self.files[os.path.basename(path)] = state_dict

    def load(self, path: str, map_location: Any = None) -> Any:
        name = os.path.basename(path)
        if name not in self.loaded:
            raise StepvaultError(
                f"DeepSpeed asked for {name!r}, which the checkpoint restored on rank "
                f"{current_rank()} does not hold ({sorted(self.loaded)}); load through "
                "DeepSpeedCheckpointer.resume()"
            )
        return self.loaded[name]

    def commit(self, info: CheckpointCommitInfo) -> bool:
        files, self.files = self.files, {}
        self.owner._commit(info.tag, files)
        return True

    def preserves_storage_sharing(self) -> bool:
        # DeepSpeed clones views before save() when this is False; the collective save
        # stages its own copies, so the live tensors are handed over as they are.
        return True


class DeepSpeedCheckpointer:
    """Save and resume a DeepSpeed engine (ZeRO 1/2/3) through a collective
    :class:`~stepvault.CheckpointManager`; every rank calls every method.

    Parameters: ``engine`` (what ``deepspeed.initialize`` returned), ``root``, ``run``,
    ``save``/``keep`` policies and the manager's other keywords (``async_save``,
    ``options``, ``tiers``...); ``rng``: save and restore each rank's RNG states
    (DeepSpeed's own files hold none).
    """

    def __init__(
        self,
        engine: Any,
        root: str | os.PathLike[str] | Store,
        run: str,
        *,
        save: SavePolicy | None = None,
        keep: KeepPolicy | None = None,
        rng: bool = True,
        **manager: Any,
    ) -> None:
        self._install(engine, CheckpointManager(root, run, save=save, keep=keep, **manager), rng)

    @classmethod
    def with_manager(
        cls, engine: Any, manager: CheckpointManager, *, rng: bool = True
    ) -> DeepSpeedCheckpointer:
        """A checkpointer on a collective ``manager`` made by the caller (a framework
        integration that opens its manager before DeepSpeed's engine exists); its
        policies and options are the manager's, and :meth:`close` closes it too."""
        self = cls.__new__(cls)
        self._install(engine, manager, rng)
        return self

    def _install(self, engine: Any, manager: CheckpointManager, rng: bool) -> None:
        register_deepspeed_types()
        self.engine = engine
        self.rng = RNGState() if rng else None
        self.manager = manager
        self.run = self.manager.run
        #: DeepSpeed writes 'latest' and zero_to_fp32.py into its save directory and globs
        #: the model-state names of a load there: a scratch folder of this process
        self._scratch = tempfile.mkdtemp(prefix="stepvault-deepspeed-")
        self.checkpoint_engine = StepvaultCheckpointEngine(self)
        #: DeepSpeed's engine before this one (kept for saves the user makes on their own)
        self.original_engine = engine.checkpoint_engine
        engine.checkpoint_engine = self.checkpoint_engine
        self._pending: dict[str, Any] = {}
        self._handle: SaveHandle | None = None
        #: the RestoreInfo of the last resume (None before one, or after a fresh start)
        self.last_restore: RestoreInfo | None = None
        #: what DeepSpeed's load returned besides its own state: the ``client_state`` given
        #: to :meth:`save` (empty before a resume)
        self.client_state: dict[str, Any] = {}

    # ------------------------------------------------------------------------- saving
    def save(
        self,
        step: int | None = None,
        *,
        client_state: Mapping[str, Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
        force: bool = False,
        epoch: int | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SaveHandle | None:
        """Save when the policy says so (always with ``force``); ``step`` defaults to
        ``engine.global_steps``. ``client_state``: extra values DeepSpeed stores with the
        module states (its ``save_checkpoint(client_state=)``). ``epoch`` is what the
        policy sees (completed epochs); ``metadata`` is recorded with the checkpoint
        beside DeepSpeed's own. Returns the save's handle or None when no save was due."""
        step = self.engine.global_steps if step is None else int(step)
        if not force and not self.manager.should_save(step, epoch):
            return None
        self._pending = {"metrics": metrics, "step": step, "epoch": epoch, "metadata": metadata}
        self._handle = None
        try:
            self.engine.save_checkpoint(
                self._scratch,
                tag=f"global_step{step}",
                client_state=dict(client_state or {}),
                save_latest=False,
            )
        finally:
            self._pending = {}
        return self._handle

    def _commit(self, tag: str, files: dict[str, Any]) -> None:
        """Every rank's files of one DeepSpeed save → one collective checkpoint."""
        step = self._pending.get("step")
        if step is None:  # a save_checkpoint() the framework made itself
            m = _TAG.search(tag)
            step = int(m.group(1)) if m else int(self.engine.global_steps)
        state: dict[str, Any] = {"deepspeed": {n: pack_file(t) for n, t in files.items()}}
        if self.rng is not None:
            state["rng"] = self.rng
        # The decision the policy took for (step, epoch) is kept (an OnSignal exit code).
        self._handle = self.manager.save(
            step,
            state,
            epoch=self._pending.get("epoch"),
            force=True,
            metrics=self._pending.get("metrics"),
            metadata={
                **dict(self._pending.get("metadata") or {}),
                "deepspeed": {"tag": tag, "world_size": _world()},
            },
        )

    def wait(self) -> None:
        """Wait for the save in flight (its error is raised here)."""
        self.manager.wait()

    # ------------------------------------------------------------------------ resuming
    def resume(self, step: int | str = "latest", **load_options: Any) -> RestoreInfo | None:
        """Load the newest checkpoint that verifies on every rank (or ``step`` exactly)
        into the engine; None when the run has none. Damage on any rank makes every rank
        fall back together (``info.skipped``). ``load_options`` go to DeepSpeed's
        ``engine.load_checkpoint`` (``load_optimizer_states``, ``load_lr_scheduler_states``,
        ``load_module_strict``...)."""
        if step != "latest" and not (isinstance(step, int) or str(step).isdigit()):
            raise ValueError(
                f"DeepSpeedCheckpointer.resume(step={step!r}): give 'latest' or a step "
                "number (a DeepSpeed resume takes a full checkpoint of the run)"
            )
        from ..distributed.agreement import try_candidates

        t0 = time.perf_counter()
        self.manager.wait()
        store = self.manager.store
        source = Source(store, self.run)
        ref: Any = step if step == "latest" else int(step)
        offer = share_choice(source, lambda: source.choose(ref))
        session = self.manager._p.session  # the run's event log, as every resume writes
        if not offer.steps:
            self.last_restore = None
            session.event("restore", step=None, result="fresh start")
            return None
        loaded: dict[str, Any] = {}

        def attempt(candidate: int, manifest: Any) -> None:
            loaded.clear()
            if manifest.sharded:
                loaded.update(self._read(store, candidate, manifest))
            else:  # one process wrote it: an import of DeepSpeed's own folder
                loaded.update(self._read_whole(store, candidate, manifest))

        try:
            chosen, manifest, skipped = try_candidates(store, self.run, offer, attempt)
            files = {n: unpack_file(p) for n, p in loaded.get("deepspeed", {}).items()}
            tag = f"global_step{chosen}"
            folder = os.path.join(self._scratch, tag)
            os.makedirs(folder, exist_ok=True)
            for name in files:  # DeepSpeed lists the model-state files with glob
                open(os.path.join(folder, name), "w").close()
            self.checkpoint_engine.loaded = files
            try:
                path, _client = self.engine.load_checkpoint(self._scratch, tag=tag, **load_options)
            finally:
                self.checkpoint_engine.loaded = {}
                shutil.rmtree(folder, ignore_errors=True)
            if path is None:
                raise StepvaultError(f"{self.run}@{chosen}: DeepSpeed loaded nothing from it")
        except BaseException as exc:
            # As the manager's restore does (manager/restoring.py): the failure, and the
            # checkpoints passed over before it, go to the run's event log and stats.
            passed = [
                k if isinstance(k, tuple) else (k.step, k.reason)
                for k in getattr(exc, "skipped", [])
            ]
            session.stats.restored(False, len(passed))
            if session.metrics:
                session.metrics.restored(False, len(passed))
            session.event(
                "restore_failed",
                requested=str(step),
                error=f"{type(exc).__name__}: {exc}",
                skipped=[{"step": s, "reason": r} for s, r in passed],
            )
            raise
        if self.rng is not None:
            mine = (loaded.get("rng") or {}).get(f"rank{current_rank()}")
            if mine is not None:
                self.rng.load_state_dict(mine)
            else:
                warnings.warn(
                    f"{self.run}@{chosen} holds no RNG state for rank {current_rank()} (an "
                    "import of DeepSpeed's own files, or saved with rng=False): the RNGs "
                    "continue from their current state, so dropout and sampling differ from "
                    "an uninterrupted run",
                    ResumeGapWarning,
                    stacklevel=2,
                )
        metadata = decode_value(manifest.metadata, lambda kind, name: None)
        self.last_restore = RestoreInfo.of_manifest(
            manifest,
            metadata,
            [SkippedCheckpoint(s, r) for s, r in skipped],
            time.perf_counter() - t0,
        )
        self.client_state = dict(_client or {})
        record_restored(session, self.last_restore, step, t0)
        return self.last_restore

    def _needed(self, name: str) -> bool:
        """Whether DeepSpeed's load on this rank reads file ``name``."""
        rank = _dp_rank(self.engine)
        own = name.startswith((f"zero_pp_rank_{rank}_", f"bf16_zero_pp_rank_{rank}_"))
        if name.endswith(MODEL_STATES):
            return own or "zero_pp_rank_" not in name
        if name.endswith(OPTIM_STATES):
            return own or bool(self.engine.zero_elastic_checkpoint())
        return False

    def _read(self, store: Store, step: int, manifest: Any) -> dict[str, Any]:
        """Collective: the entries this rank needs of ``run@step``, read and verified on
        every rank, the ranks agreeing before any rank uses a byte."""
        import torch.distributed.checkpoint as dcp

        from ..distributed.agreement import agree
        from ..distributed.planners import SafeLoadPlanner, set_element
        from ..distributed.storage import StepvaultReader
        from ..format.encoding import torch_dtype

        sharded = manifest.sharded or {}
        entries, paths = sharded.get("entries", {}), sharded.get("paths", {})
        targets: dict[str, Any] = {}
        rank_key = f"rank{current_rank()}"
        for fqn, entry in entries.items():
            path = paths.get(fqn, [fqn])
            top = path[0]
            if top == "deepspeed":
                if len(path) < 2 or not self._needed(str(path[1])):
                    continue
            elif top == "rng":
                if self.rng is None or len(path) < 2 or path[1] != rank_key:
                    continue
            else:
                continue
            if entry["type"] == "tensor":
                value: Any = torch.empty(entry["size"], dtype=torch_dtype(entry["dtype"]))
            else:
                value = None
            set_element(targets, tuple(path), value)
        reader = StepvaultReader(
            store,
            self.run,
            step,
            manifest=manifest,
            verified=lambda damage: agree(store, damage, f"{self.run}@{step}"),
        )
        dcp.load(targets, storage_reader=reader, planner=SafeLoadPlanner())
        return targets

    def _read_whole(self, store: Store, step: int, manifest: Any) -> dict[str, Any]:
        """Collective: a checkpoint one process wrote (``stepvault import`` of a
        ``global_stepN`` folder), read on every rank and verified, the ranks agreeing
        before any rank uses a byte; only the files this rank's load asks for are kept."""
        from ..distributed.agreement import agree
        from ..engine import CheckpointReader
        from ..errors import IntegrityError

        damage: BaseException | None = None
        tree: dict[str, Any] = {}
        try:
            arrays = CheckpointReader(store, manifest).read_all(private=True)
            tree = decode_value(manifest.state, lambda kind, name: arrays[name])
        except IntegrityError as exc:
            damage = exc
        agree(store, damage, f"{self.run}@{step}")
        files = tree.get("deepspeed")
        if not isinstance(files, Mapping):
            raise StepvaultError(
                f"{self.run}@{step} is not a DeepSpeed checkpoint (no 'deepspeed' entry); "
                "DeepSpeedCheckpointer resumes checkpoints it saved or imports of "
                "global_stepN folders"
            )
        return {"deepspeed": {n: p for n, p in files.items() if self._needed(str(n))}}

    # --------------------------------------------------------------------------- close
    def close(self) -> None:
        """Wait for the save in flight, release the run and give DeepSpeed back its engine."""
        try:
            self.manager.close()
        finally:
            if self.engine.checkpoint_engine is self.checkpoint_engine:
                self.engine.checkpoint_engine = self.original_engine
            shutil.rmtree(self._scratch, ignore_errors=True)

    def __enter__(self) -> DeepSpeedCheckpointer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # do not mask the training error with a save error
            self.close()
        except BaseException:
            pass


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _dp_rank(engine: Any) -> int:
    group = getattr(getattr(engine, "optimizer", None), "dp_process_group", None)
    if group is not None and dist.is_initialized():
        return dist.get_rank(group=group)
    return current_rank()


def load_fp32_state_dict(
    root: str | os.PathLike[str] | Store, run: str, step: int | str = "latest"
) -> dict[str, torch.Tensor]:
    """The full fp32 weights of a DeepSpeed checkpoint written by any number of ranks, in
    one process and without a process group (for evaluation and export), equal to
    DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint``: the ZeRO partitions joined
    (:func:`stepvault.ops.migrate.deepspeed_merge.consolidate`), frozen and tied weights included.
    Only the weights' bytes are read, each verified, never the optimizer moments
    (:func:`stepvault.ops.migrate.deepspeed_merge.checkpoint_weights`). It holds the whole model;
    ``stepvault export`` writes the same weights one tensor at a time
    (:mod:`stepvault.ops.export_zero3`)."""
    import stepvault

    vault = stepvault.open(root)
    ref = run if step == "latest" else f"{run}@{int(step)}"
    return checkpoint_weights(vault.checkpoint(ref))
