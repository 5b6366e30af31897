"""Weights & Biases: each committed checkpoint is a version of a *reference artifact*
that points at stepvault, with no tensor byte uploaded. ``pip install "stepvault[wandb]"``.

::

    import wandb, stepvault
    from stepvault.integrations.wandb import WandbTracker

    run = wandb.init(project="llm")
    mgr = stepvault.CheckpointManager(
        "ckpts", run="exp1",
        options=ManagerOptions(hooks=(WandbTracker(best_metric="val_loss"),)))
    ...
    mgr.close(); run.finish()

    art = wandb.Api().artifact("entity/llm/stepvault-exp1:best")
    stepvault.restore(checkpoint_uri(art), state)

The artifact (type ``model``, one per stepvault run, a version per checkpoint) holds one
reference entry, ``checkpoint``: its ``ref`` is ``stepvault:ROOT#RUN@STEP`` (what
``stepvault.restore`` takes), its ``digest`` the manifest's BLAKE3 (so W&B makes a new
version exactly when the checkpoint differs) and its ``size`` the checkpoint's stored
bytes; the metadata has the step, kind, epoch and metrics. Aliases: ``latest``,
``step-N`` and ``best`` (by ``best_metric``, when given).

:func:`sync_registry` mirrors a stepvault registry model into an artifact named after the
model: a version per registered version (the same reference), each with its registry
aliases, so ``wandb.Api().artifact("entity/llm/classifier:champion")`` is the champion.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from ..catalog.refs import parse_located_ref
from ..errors import RegistryError, StepvaultError
from ..manager.hooks import HookContext
from ..registry import Registry
from ..store import Store
from ._trackers import CommittedCheckpoint, TrackerHook, committed_checkpoint

try:
    import wandb
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        "stepvault.integrations.wandb needs wandb, which is not installed: "
        'pip install "stepvault[wandb]"'
    ) from exc

__all__ = ["WandbTracker", "checkpoint_uri", "reference_artifact", "sync_registry"]

#: the artifact entry that holds the reference
ENTRY = "checkpoint"


class WandbTracker(TrackerHook):
    """After-commit hook: a reference-artifact version per committed checkpoint.

    Parameters:
        run: the W&B run to log to (default: ``wandb.run`` when the manager is built).
        artifact: the artifact's name (default ``stepvault-<run>``).
        best_metric, mode: the metric that moves the ``best`` alias (none by default).
        retries, backoff, close_timeout, max_pending: see ``TrackerHook``.
    """

    tracker = "wandb"

    def __init__(
        self,
        *,
        run: Any = None,
        artifact: str | None = None,
        best_metric: str | None = None,
        mode: Literal["min", "max"] = "min",
        retries: int = 3,
        backoff: float = 1.0,
        close_timeout: float = 30.0,
        max_pending: int = 64,
    ) -> None:
        super().__init__(
            retries=retries, backoff=backoff, close_timeout=close_timeout, max_pending=max_pending
        )
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        self.run = run
        self.artifact = artifact
        self.best_metric = best_metric
        self.mode = mode
        self._best: float | None = None

    def setup(self, context: HookContext) -> None:
        if self.run is None:
            self.run = wandb.run
            if self.run is None:
                raise RuntimeError(
                    "WandbTracker logs to a W&B run: call wandb.init() before building the "
                    "manager, or give WandbTracker(run=...)"
                )
        if self.artifact is None:
            self.artifact = "stepvault-" + re.sub(r"[^A-Za-z0-9_.-]", "-", context.run)

    def record(self, ckpt: CommittedCheckpoint) -> tuple[str, str]:
        assert self.artifact is not None
        art = reference_artifact(self.artifact, ckpt)
        aliases = ["latest", f"step-{ckpt.step}", *self._aliases(ckpt)]
        self.run.log_artifact(art, aliases=aliases)
        return self._ref(ckpt.step), f"{self.artifact}:step-{ckpt.step}"

    def _aliases(self, ckpt: CommittedCheckpoint) -> list[str]:
        out = []
        value = ckpt.metrics.get(self.best_metric) if self.best_metric else None
        if value is not None and (
            self._best is None or (value < self._best if self.mode == "min" else value > self._best)
        ):
            self._best = value
            out.append("best")
        return out

    def _ref(self, step: int) -> str:
        entity = getattr(self.run, "entity", None) or ""
        project = getattr(self.run, "project", None) or ""
        return f"wandb-artifact://{entity}/{project}/{self.artifact}:step-{step}"

    def __repr__(self) -> str:
        return f"WandbTracker(artifact={self.artifact!r}, best_metric={self.best_metric!r})"


def reference_artifact(name: str, ckpt: CommittedCheckpoint) -> Any:
    """The reference artifact version of ``ckpt`` (what the tracker logs)."""
    art = wandb.Artifact(
        name,
        type="model",
        description=f"stepvault checkpoint {ckpt.uri}",
        metadata={
            "stepvault_uri": ckpt.uri,
            "step": ckpt.step,
            "kind": ckpt.kind,
            "epoch": ckpt.epoch,
            "metrics": ckpt.metrics,
            "manifest_blake3": ckpt.manifest_id,
            "logical_bytes": ckpt.logical_bytes,
            "stored_bytes": ckpt.stored_bytes,
        },
    )
    # A reference with a scheme W&B does not read: it checksums nothing and copies
    # nothing. The digest and size are stepvault's own (the manifest's BLAKE3 names
    # every byte of the checkpoint), so W&B versions the artifact by checkpoint.
    (entry,) = art.add_reference(ckpt.uri, name=ENTRY, checksum=False)
    entry.digest = ckpt.manifest_id
    entry.size = ckpt.stored_bytes
    entry.extra["blake3"] = ckpt.manifest_id
    return art


def sync_registry(
    root: str | os.PathLike[str] | Store,
    model: str,
    *,
    run: Any = None,
    artifact: str | None = None,
) -> dict[str, str]:
    """Mirror stepvault registry model ``model`` into the W&B artifact ``artifact``
    (default: the model's name) of ``run`` (default ``wandb.run``); returns alias ->
    ``RUN@STEP``.

    Each registered version, oldest first, is logged as its checkpoint's reference with
    the registry aliases it holds. W&B versions an artifact by its entries' digests (here
    the manifest's BLAKE3), so a version synced before is the same W&B version again and
    only its aliases move; an alias moved in stepvault moves in W&B, and ``latest`` ends
    on the newest registered version (W&B puts ``latest`` on every logged version, the
    last one keeps it). stepvault's registry is the source of truth: aliases set in W&B
    are not read back, and an alias removed in stepvault stays in W&B until removed
    there (the client cannot delete an alias offline). Every version's checkpoint is read
    before anything is logged: a deleted or damaged one raises :class:`RegistryError`
    and logs nothing.
    """
    run = run if run is not None else wandb.run
    if run is None:
        raise RuntimeError("sync_registry logs to a W&B run: call wandb.init() or give run=")
    reg = Registry(root)
    name = artifact or re.sub(r"[^A-Za-z0-9_.-]", "-", model)
    held: dict[int, list[str]] = {}
    for alias, number in reg.aliases(model).items():
        held.setdefault(number, []).append(alias)
    plan = []
    for version in reg.versions(model):
        try:
            ckpt = committed_checkpoint(reg.store, version.run, version.step)
        except LookupError as exc:
            raise RegistryError(
                f"cannot mirror {model} v{version.version} to W&B: {exc}; nothing was "
                f"logged. Move its aliases to a checkpoint that exists ('stepvault promote "
                f"{model} RUN@STEP --alias ALIAS') and sync again"
            ) from None
        plan.append((version, ckpt))
    for version, ckpt in plan:
        art = reference_artifact(name, ckpt)
        art.metadata = {**art.metadata, "stepvault_model": model, "version": version.version}
        run.log_artifact(art, aliases=held.get(version.version, []))
    return {alias: reg.version(model, n).ref for alias, n in reg.aliases(model).items()}


def checkpoint_uri(artifact: Any) -> str:
    """The ``stepvault:ROOT#RUN@STEP`` a W&B artifact logged by :class:`WandbTracker`
    points at (``wandb.Api().artifact(...)``, ``run.use_artifact(...)``):
    ``stepvault.restore(checkpoint_uri(art), state)``."""
    entries = artifact.manifest.entries
    entry = entries.get(ENTRY)
    ref = getattr(entry, "ref", None)
    if not ref:
        raise StepvaultError(
            f"W&B artifact {getattr(artifact, 'name', artifact)!r} has no {ENTRY!r} "
            "reference: it was not logged by stepvault.integrations.wandb.WandbTracker"
        )
    parse_located_ref(str(ref))  # a malformed one fails here, naming itself
    return str(ref)
