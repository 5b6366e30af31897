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
"""

from __future__ import annotations

import re
from typing import Any, Literal

from ..catalog.refs import parse_located_ref
from ..errors import StepvaultError
from ..manager.hooks import HookContext
from ._trackers import CommittedCheckpoint, TrackerHook

try:
    import wandb
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        "stepvault.integrations.wandb needs wandb, which is not installed: "
        'pip install "stepvault[wandb]"'
    ) from exc

__all__ = ["WandbTracker", "checkpoint_uri"]

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
        art = wandb.Artifact(
            self.artifact,
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
        # every byte of the checkpoint).
        (entry,) = art.add_reference(ckpt.uri, name=ENTRY, checksum=False)
        entry.digest = ckpt.manifest_id
        entry.size = ckpt.stored_bytes
        entry.extra["blake3"] = ckpt.manifest_id
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
