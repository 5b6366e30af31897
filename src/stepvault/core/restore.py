"""``stepvault.restore``: the public restore, through the one planner (:mod:`.planner`).

It builds the source (the store, its cold tiers, this node's mem tier first), lets the
source choose the candidates (the catalog's rules), and hands them to the planner: in
this process (:func:`.planner.restore_local`: open once, check, verify, place, falling
back past damage), or on every rank under a process group (:func:`.planner.restore_offer`:
rank 0 chooses, one broadcast, one parse per rank, the ranks agree before placing).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any, Literal

import torch

from .._progress import ProgressFn
from ..errors import (
    CheckpointNotFoundError,
    IntegrityError,
    NoValidCheckpointError,
    StoreNotFoundError,
)
from ..store import Store, validate_run_name
from .gaps import recorded_gaps, warn_resume_gaps
from .info import RestoreInfo
from .planner import (
    RestorePlanner,
    Source,
    place,
    restore_local,
    restore_offer,
    restore_progress,
    share_choice,
)
from .scope import is_collective

Root = str | os.PathLike[str]


def restore_candidates(
    store: Store,
    state: MutableMapping[str, Any],
    run: str,
    candidates: list[int],
    *,
    fallback: bool,
    strict: bool = True,
    workers: int | None = None,
    full_only: bool = False,
    assign: bool = False,
) -> RestoreInfo:
    """Restore the first of ``candidates`` that verifies (see :meth:`RestorePlanner.restore`)."""
    return RestorePlanner(store, run, workers=workers).restore(
        state, candidates, fallback=fallback, strict=strict, full_only=full_only, assign=assign
    )


def restore(
    root: Root,
    state: MutableMapping[str, Any],
    *,
    run: str | None = None,
    step: int | Literal["latest"] = "latest",
    strict: bool = True,
    missing_ok: bool = False,
    workers: int | None = None,
    collective: bool | None = None,
    assign: bool = False,
    progress: bool | ProgressFn | None = None,
    resume_from_light: bool = False,
    mem: bool | str = True,
    verify: Literal["fast", "full"] = "fast",
) -> RestoreInfo | None:
    """Load checkpoint ``run@step`` into the live objects of ``state``.

    ``step="latest"`` takes the newest committed checkpoint that verifies completely; a
    damaged one is reported in ``RestoreInfo.skipped`` and the next older one is tried. An
    explicit step never falls back. A damaged object is moved to ``quarantine/`` so that
    no later save deduplicates against it. Everything is read and verified, and the
    checkpoint is checked against the live state (keys, shapes, dtypes, types), before
    anything in ``state`` is changed: a failed restore leaves the training state as it was.

    ``assign=True`` (for inference, evaluation or export jobs that read a checkpoint once):
    instead of copying into the live tensors, modules take the verified stored tensors
    themselves (``load_state_dict(assign=True)``; top-level tensors are replaced in
    ``state``). A tensor in one raw object of a local store is then a view of that object's
    private copy-on-write mapping: no copy, and writing to it (training it) never changes
    the store. Larger tensors and other codecs decode into fresh memory. Create optimizers
    after such a restore: the modules hold new parameter objects. Not for checkpoints
    written by several ranks.

    A light checkpoint (lossy: ``RestoreInfo.lossy``) is restored when its step is given,
    and by ``"latest"`` only with ``resume_from_light=True`` and no newer full checkpoint;
    one whose base is damaged or gone is reported in ``skipped`` like a damaged one.

    ``progress``: a ``progress(done, total)`` callback (stored bytes fetched and verified),
    True for a bar on stderr, False for none; None (default) draws a bar when the store (or
    a tier it reads from) is remote and stderr is a terminal.

    ``mem``: when this node holds the run's mem tier (a manager with ``tiers={"mem":
    ...}`` committed there; after a crash its newest steps may be only in memory), read it
    first, as the manager does: True looks under the default mem root
    (``$STEPVAULT_MEM_ROOT`` or ``/dev/shm/stepvault``), a path names the root, False
    reads the store's own tiers only.

    ``verify``: ``"fast"`` (default) checks each object with the xxh3-128 checksums of its
    segments recorded at save (BLAKE3 for objects written without them); ``"full"``
    re-hashes every object with BLAKE3 against its name. A signed checkpoint is always
    read ``"full"``. Either way damage is found before anything is placed (FORMAT.md §3.3).

    Returns None when the run has no checkpoint and ``missing_ok`` is true (a fresh start).
    Under a process group every rank calls it; a checkpoint saved on N ranks loads on M.

    Without ``run``, ``root`` is a reference that names its store and step: what a tracker
    recorded (``stepvault:ROOT#RUN@STEP``) or hands back (``models:/NAME@ALIAS``,
    ``models:/NAME/VERSION`` or a LoggedModel's ``models:/ID`` from MLflow): that exact
    checkpoint, no fallback; a deleted or damaged one is an error naming it and the run's
    checkpoints left (INTEGRATIONS.md).
    """
    located = None
    if run is None:
        from ..catalog.refs import parse_located_ref

        located = parse_located_ref(str(root))
        root, run, step = located.root, located.run, located.step
    validate_run_name(run)
    from ..engine.fetch import check_verify_mode

    check_verify_mode(verify)
    if is_collective(state, collective):
        _no_assign(assign)
        return restore_collective(root, state, run, step, missing_ok, workers, strict=strict)
    try:
        store = Store.open(root)
    except StoreNotFoundError:
        if missing_ok:
            return None
        raise
    from ..tiers.view import read_view, with_mem_tier

    store = read_view(store)  # a store with cold tiers restores from any tier, hot first
    if mem is not False:  # this node's memory first, when it holds the run's mem tier
        store = with_mem_tier(store, run, None if mem is True else str(mem))
    source = Source(store, run)
    if located is not None:
        return _restore_located(located, store, source, state, strict, workers, progress)
    chosen = source.choose(step, light=resume_from_light)
    if not chosen.steps:
        if missing_ok:
            return None
        raise CheckpointNotFoundError(
            f"run {run!r} has no committed checkpoint in {store.backend.url} "
            f"(runs: {', '.join(store.list_runs()) or 'none'})"
        )
    info = restore_local(
        source,
        state,
        chosen,
        strict=strict,
        # Like the manager: "latest" of a training state is the newest *full* checkpoint; a
        # state of modules alone also takes weights-only ones (kinds checked as each
        # candidate is opened: no manifest is read ahead of the restore).
        full_only=step == "latest"
        and any(not isinstance(v, torch.nn.Module) for v in state.values()),
        assign=assign,
        # an explicit step may be a light one; "latest" only with resume_from_light
        light=resume_from_light or step != "latest",
        workers=workers,
        progress=progress,
        on_sharded=lambda _step: _no_assign(assign),
        verify=verify,
    )
    served = getattr(store, "served", None)
    if served is not None:  # read through the tiers: where the bytes came from, as mgr.restore
        info.tier_bytes = dict(served)
        info.tier = max(served, key=lambda t: served[t]) if served else "hot"
    _warn_lacking(info, state)
    return info


def _restore_located(
    located: Any,
    store: Store,
    source: Source,
    state: MutableMapping[str, Any],
    strict: bool,
    workers: int | None,
    progress: bool | ProgressFn | None,
) -> RestoreInfo:
    """The exact checkpoint a tracker's reference names; deleted or damaged is an error
    that says which, and which checkpoints of the run are left."""
    run, step = located.run, located.step
    what = f"{located.source!r} points at {run}@{step} in {located.root}"

    def left() -> str:
        steps = [s for s in store.list_steps(run) if s != step]
        shown = ", ".join(f"{run}@{s}" for s in steps[-8:])
        return (
            f"the run's checkpoints left: {shown} (restore one with run={run!r}, step=N)"
            if steps
            else f"run {run!r} has no other checkpoint there"
        )

    if step not in store.list_steps(run):
        raise CheckpointNotFoundError(f"{what}, which is deleted (not committed); {left()}")
    chosen = source.choose(step, light=True)
    try:
        info = restore_local(
            source, state, chosen, strict=strict, light=True, workers=workers, progress=progress
        )
    except (IntegrityError, NoValidCheckpointError) as exc:
        raise type(exc)(f"{what}, which is damaged: {exc}; {left()}") from exc
    _warn_lacking(info, state)
    return info


def _warn_lacking(info: RestoreInfo | None, state: MutableMapping[str, Any]) -> None:
    """An import that recorded what its source lacked (``metadata["missing"]``; e.g. a
    weights-only file has no optimizer): warn when the live state expected it (a
    ``strict=False`` restore leaves it fresh)."""
    if info is None:
        return
    gaps = recorded_gaps(info.metadata)
    absent = [
        key
        for key, obj in state.items()
        if key in gaps or ("optimizer" in gaps and isinstance(obj, torch.optim.Optimizer))
    ]
    warn_resume_gaps(info.run, info.step, info.metadata, absent, stacklevel=3)


def _no_assign(assign: bool) -> None:
    if assign:
        raise ValueError(
            "restore(assign=True) reads checkpoints of one process; a checkpoint written by "
            "several ranks (or a restore under a process group) is restored in place: "
            "pass assign=False"
        )


def restore_collective(
    root: Root | Store,
    state: MutableMapping[str, Any],
    run: str,
    step: int | Literal["latest"],
    missing_ok: bool,
    workers: int | None,
    *,
    strict: bool = True,
) -> RestoreInfo | None:
    """Every rank restores its part of ``run@step`` through the planner's collective path
    (rank 0 chooses; candidates and manifest shared once; resharding as needed);
    ``strict`` as for :func:`restore`."""
    from ..distributed.agreement import handshake

    handshake(f"restore {run}", 60.0)  # every rank must call it: a clear error if not
    try:
        store = root if isinstance(root, Store) else Store.open(root)
    except StoreNotFoundError:
        if missing_ok:
            return None
        raise
    source = Source(store, run)
    offer = share_choice(source, lambda: source.choose(step))
    if not offer.steps:
        if missing_ok:
            return None
        raise CheckpointNotFoundError(f"run {run!r} has no committed checkpoint")
    return restore_offer(source, state, offer, strict=strict, workers=workers)


__all__ = [
    "RestorePlanner",
    "place",
    "restore",
    "restore_candidates",
    "restore_collective",
    "restore_progress",
]
