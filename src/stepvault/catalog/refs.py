"""Checkpoint references (``RUN``, ``RUN@STEP``, ``RUN@latest``): parsed, and resolved to a
committed step, in one place.

"latest" means one thing everywhere (``restore``, ``Vault.checkpoint``, ``hold``,
``mgr.latest_step``, every command that takes a reference): the newest **full**
checkpoint of the run, the one a plain ``restore`` resumes from. Light and weights-only
checkpoints are taken when their step is named; a damaged manifest is passed over, as a
restore would pass over it.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import CheckpointNotFoundError, InvalidNameError
from ..format.record import CheckpointRecord
from ..store import Store, validate_run_name
from .records import checkpoint_records

__all__ = [
    "LocatedRef",
    "latest_step",
    "located_ref",
    "newest_full_step",
    "parse_located_ref",
    "parse_ref",
    "resolve_ref",
]

_REF = re.compile(r"^(?P<run>[^@]+)(?:@(?P<step>[0-9]{1,18}|latest))?")

#: Manifests read per look-up while searching for the newest full checkpoint: the newest
#: one is usually full, so the first look-up reads one manifest; later ones read more.
_FIRST_PAGE = 1
_PAGE_GROWTH = 8


def parse_ref(text: str) -> tuple[str, int | str | None]:
    """Parse ``RUN``, ``RUN@STEP`` or ``RUN@latest`` into ``(run, step)``: step is an int,
    ``"latest"``, or None when absent. Reads nothing; :func:`resolve_ref` resolves."""
    m = _REF.fullmatch(text) if isinstance(text, str) else None
    if not m:
        raise InvalidNameError(
            f"bad checkpoint reference {text!r}; expected RUN, RUN@STEP or RUN@latest"
        )
    run = validate_run_name(m.group("run"))
    step = m.group("step")
    if step is None or step == "latest":
        return run, step
    return run, int(step)


def newest_full_step(store: Store, run: str, steps: Sequence[int] | None = None) -> int | None:
    """The newest full checkpoint of ``run`` (whose manifest reads), or None.

    Manifests are read newest first, a few at a time (the summary cache spares parsing
    them), so the cost does not grow with the run. ``steps``: the run's listing, when the
    caller has it.
    """
    return _newest_full(store, run, steps)[0]


def _newest_full(
    store: Store, run: str, steps: Sequence[int] | None
) -> tuple[int | None, CheckpointRecord | None]:
    """(newest full step, newest readable record of another kind) of ``run``."""
    pending = list(store.list_steps(run) if steps is None else steps)
    other: CheckpointRecord | None = None
    size = _FIRST_PAGE
    while pending:
        page, pending = pending[-size:], pending[:-size]
        records = checkpoint_records(store, run, steps=page, protected=False)
        for record in reversed(records):
            if record.valid and record.kind == "full":
                return record.step, other
            if record.valid and other is None:
                other = record
        size *= _PAGE_GROWTH
    return None, other


def latest_step(store: Store, run: str, steps: Sequence[int] | None = None) -> int:
    """The step ``RUN@latest`` names: the newest full checkpoint of ``run``.

    Raises :class:`CheckpointNotFoundError` when there is none, naming the newest
    checkpoint of another kind (light, weights-only) if the run has one: that one is
    read by naming its step.
    """
    step, other = _newest_full(store, run, steps)
    if step is not None:
        return step
    where = f"in {store.backend.url}"
    if other is not None:
        raise CheckpointNotFoundError(
            f"run {run!r} has no full checkpoint {where} ('latest' means the newest full "
            f"one); its newest checkpoint is {other.kind}: name it as {run}@{other.step}"
        )
    raise CheckpointNotFoundError(
        f"run {run!r} has no committed checkpoint {where} (see 'stepvault ls')"
    )


def resolve_ref(store: Store, ref: str) -> tuple[str, int]:
    """``RUN@STEP`` -> ``(run, step)``; ``RUN`` and ``RUN@latest`` -> the newest full
    checkpoint of the run (:func:`latest_step`).

    A malformed reference raises :class:`InvalidNameError`; a run with no checkpoint to
    name raises :class:`CheckpointNotFoundError`. An explicit step is not looked up here:
    reading it raises :class:`CheckpointNotFoundError` when it is not committed.
    """
    run, step = parse_ref(ref)
    if isinstance(step, int):
        return run, step
    return run, latest_step(store, run)


#: A checkpoint named with its store: ``stepvault:ROOT#RUN@STEP`` (what trackers record).
LOCATED_PREFIX = "stepvault:"

#: Tracker URIs ``stepvault.restore`` takes, by prefix -> the integration module that
#: resolves them (``resolve_tracker_uri(text) -> "stepvault:ROOT#RUN@STEP"``). Named, not
#: imported: an integration sits above this layer and its framework is an optional extra,
#: so it is imported only when such a URI is restored.
TRACKER_SCHEMES = {
    "models:/": ("stepvault.integrations.mlflow", "mlflow"),
    "runs:/": ("stepvault.integrations.mlflow", "mlflow"),
}


@dataclass(frozen=True)
class LocatedRef:
    """A checkpoint with its store: what a ``stepvault:`` or tracker URI names."""

    root: str
    run: str
    step: int
    #: the text it was resolved from (named in errors)
    source: str


def located_ref(root: str, run: str, step: int) -> str:
    """``stepvault:ROOT#RUN@STEP``: a checkpoint named with its store."""
    return f"{LOCATED_PREFIX}{root}#{validate_run_name(run)}@{int(step)}"


def parse_located_ref(text: str) -> LocatedRef:
    """``stepvault:ROOT#RUN@STEP``, or a tracker URI (``models:/NAME@ALIAS``,
    ``models:/NAME/VERSION``, ``models:/MODEL_ID``: resolved by the tracker's
    integration), to the checkpoint it names."""
    source = text
    if isinstance(text, str) and text.startswith("wandb-artifact://"):
        # What WandbTracker records in tracker_ref names a W&B artifact version; only the
        # W&B server knows what it holds, so it is refused rather than looked up here.
        raise InvalidNameError(
            f"{text!r} names a W&B artifact, which stepvault does not resolve: fetch it "
            "with wandb (art = wandb.Api().artifact('ENTITY/PROJECT/NAME:ALIAS') or "
            "run.use_artifact(...)) and restore "
            "stepvault.integrations.wandb.checkpoint_uri(art)"
        )
    for prefix, (module, extra) in TRACKER_SCHEMES.items():
        if isinstance(text, str) and text.startswith(prefix):
            try:
                resolver = importlib.import_module(module)
            except ImportError as exc:
                raise InvalidNameError(
                    f"{text!r} is a {extra} reference; resolving it needs "
                    f'pip install "stepvault[{extra}]" ({exc})'
                ) from exc
            text = resolver.resolve_tracker_uri(text)
            break
    if not (isinstance(text, str) and text.startswith(LOCATED_PREFIX) and "#" in text):
        raise InvalidNameError(
            f"bad checkpoint reference {source!r}: without run= give "
            "stepvault:ROOT#RUN@STEP or an MLflow models:/ URI (a W&B artifact: "
            "stepvault.integrations.wandb.checkpoint_uri(artifact)); or pass the store "
            "root with run=RUN"
        )
    root, _, ref = text[len(LOCATED_PREFIX) :].rpartition("#")
    run, step = parse_ref(ref)
    if not root or not isinstance(step, int):
        raise InvalidNameError(
            f"bad checkpoint reference {source!r}: a stepvault URI names an exact "
            "checkpoint, stepvault:ROOT#RUN@STEP"
        )
    return LocatedRef(root, run, step, source)
