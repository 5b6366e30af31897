"""Light checkpoints: a training state stored as quantised deltas against the run's newest
full checkpoint (its *base*), opt-in and honest about their error.

Saving (:func:`build_light`): every float tensor of the modules (and, with
``optimizer="delta"``, of the optimizers) becomes a block-quantised delta
(:mod:`stepvault.engine.light_delta`) stored as a uint8 tensor under its own name; with
``optimizer="base"`` (default) an optimizer tensor is the base's own (its objects are
reused, no new bytes) and its error against the exact value is recorded like a delta's.
Everything else (ints, small tensors, inf/nan, plain values, RNG, scheduler) is stored
exactly. The manifest's ``light`` section names the base and, per tensor, its encoding and
measured error (FORMAT.md §12).

Restoring (:func:`prepare_light`, then :func:`place_light`): the base is opened and
verified too; a base that is gone, damaged or replaced since raises
:class:`LightBaseError` (an :class:`IntegrityError`, so a restore of "latest" reports it
and falls back to an exact checkpoint).
"""

from __future__ import annotations

import threading
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..catalog.events import log_event
from ..catalog.records import checkpoint_records
from ..engine.light_delta import (
    DEFAULT_BLOCK,
    DeltaError,
    check_encodable,
    decode_light_delta,
    encode_light_delta,
)
from ..engine.staging import HostArray, to_host
from ..errors import IntegrityError, LightBaseError, StateMismatchError, StepvaultError
from ..format import Manifest, TensorEntry, decode_value, parse_manifest
from ..format.hashing import content_hash
from ..state import apply, validate
from ..state.snapshot import Snapshot
from ..store import Store
from .opened import OpenedCheckpoint, open_checkpoint

OptimizerMode = Literal["base", "delta", "exact"]


@dataclass(frozen=True)
class LightOptions:
    """How light checkpoints encode a state.

    ``bits``: 8 or 4 (int8 / int4 codes per element); ``block``: elements per float32
    scale; ``optimizer``: what optimizer tensors get: ``"base"`` (the base's values, no new
    bytes; the error against the exact values is recorded), ``"delta"`` (quantised like the
    weights) or ``"exact"`` (stored exactly); ``min_elements``: float tensors smaller than
    this are stored exactly (their bytes do not matter, their exactness may: Adam's
    ``step``).
    """

    bits: int = 8
    block: int = DEFAULT_BLOCK
    optimizer: OptimizerMode = "base"
    min_elements: int = 1024

    def __post_init__(self) -> None:
        if self.bits not in (8, 4):
            raise ValueError(f"LightOptions(bits=) must be 8 or 4, got {self.bits!r}")
        if not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"LightOptions(block=) must be a positive int, got {self.block!r}")
        if self.optimizer not in ("base", "delta", "exact"):
            raise ValueError(
                f"LightOptions(optimizer=) must be 'base', 'delta' or 'exact', "
                f"got {self.optimizer!r}"
            )
        if not isinstance(self.min_elements, int) or self.min_elements < 0:
            raise ValueError(
                f"LightOptions(min_elements=) must be an int >= 0, got {self.min_elements!r}"
            )


class _BaseCache:
    """The tensors of the last base read (one entry): consecutive light saves of a run
    share one base, which is then read from the store once, not at every save."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[str, str, int, str] | None = None
        self._tensors: dict[str, Any] = {}

    def get(self, store: Store, run: str, step: int) -> dict[str, Any]:
        data = store.read_manifest(run, step)
        key = (store.backend.url, run, step, content_hash(data))
        with self._lock:
            if key == self._key:
                return self._tensors
        opened = open_checkpoint(store, run, step)
        try:
            opened.verify_all()
            tensors = {n: opened.reader.read(n, private=True) for n in opened.manifest.tensors}
        finally:
            opened.release()
        with self._lock:
            self._key, self._tensors = key, tensors
        return tensors


_BASES = _BaseCache()


def newest_full_step(store: Store, run: str, before: int) -> int | None:
    """The newest valid full checkpoint of ``run`` older than ``before``, or None."""
    records = checkpoint_records(store, run, protected=False)
    full = [r.step for r in records if r.valid and r.kind == "full" and r.step < before]
    return full[-1] if full else None


def build_light(
    store: Store,
    run: str,
    step: int,
    snapshot: Snapshot,
    options: LightOptions | None = None,
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The arrays and the manifest ``light`` section of a light checkpoint of ``snapshot``;
    None when the run has no full checkpoint before ``step`` (the save is then a full one).
    """
    options = options or LightOptions()
    base_step = newest_full_step(store, run, step)
    if base_step is None:
        return None
    base = _BASES.get(store, run, base_step)
    arrays: dict[str, Any] = {}
    entries: dict[str, Any] = {}
    exact: dict[str, str] = {}
    for name, value in snapshot.arrays.items():
        arrays[name] = value
        group = "optimizer" if snapshot.kinds.get(name.split("/", 1)[0]) == "optimizer" else ""
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue  # ints, bools, numpy arrays: exact
        if value.numel() < options.min_elements:
            continue
        if group and options.optimizer == "exact":
            continue
        held = base.get(name)
        why = "not in the base" if held is None else check_encodable(held, value)
        if held is None or why is not None:
            exact[name] = why or "not in the base"
            continue
        new = value.detach().cpu()
        dtype = str(new.dtype).removeprefix("torch.")
        entry: dict[str, Any] = {"dtype": dtype, "shape": list(new.shape)}
        if group and options.optimizer == "base":
            # Not written: the manifest names the base's own chunks (adopt_base_tensors),
            # which a bundle of this save could not deduplicate against.
            del arrays[name]
            entry.update(encoding="base", error=DeltaError.between(held, new).to_json())
        else:
            payload, err = encode_light_delta(held, new, bits=options.bits, block=options.block)
            arrays[name] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            entry.update(
                encoding="delta", bits=options.bits, block=options.block, error=err.to_json()
            )
        entries[name] = entry
    base_id = content_hash(store.read_manifest(run, base_step))
    section = {"base_step": base_step, "base_manifest": base_id, "tensors": entries}
    if exact:
        section["exact"] = exact  # float tensors stored exactly, and why
    return arrays, section


def adopt_base_tensors(store: Store, manifest: Manifest) -> None:
    """Point the ``"base"``-encoded tensors of a light ``manifest`` at the base's chunks
    (run right before the commit, once the written tensors are in its tables)."""
    assert manifest.light is not None
    names = [n for n, e in manifest.light["tensors"].items() if e["encoding"] == "base"]
    if not names:
        return
    base_step = int(manifest.light["base_step"])
    data = store.read_manifest(manifest.run, base_step)
    if content_hash(data) != manifest.light["base_manifest"]:
        raise LightBaseError(f"base {manifest.run}@{base_step} was replaced during the save")
    base = parse_manifest(data, f"{manifest.run}@{base_step}")
    for name in names:
        entry = base.tensors[name]
        manifest.tensors[name] = TensorEntry(entry.dtype, list(entry.shape), list(entry.chunks))
        for digest, _, _ in entry.chunks:
            manifest.objects[digest] = base.objects[digest]


def light_error_summary(light: dict[str, Any]) -> dict[str, float]:
    """The worst error over the tensors of a light checkpoint (for listings and events)."""
    errors = [e["error"] for e in light.get("tensors", {}).values() if "error" in e]
    return {
        "max_abs": max((e["max_abs"] for e in errors), default=0.0),
        "max_rel": max((e["max_rel"] for e in errors), default=0.0),
        "mean_rel": max((e["mean_rel"] for e in errors), default=0.0),
    }


@dataclass
class PreparedLight:
    """A light checkpoint and its base, both verified and checked against the live state:
    placing it touches nothing in the store any more."""

    opened: OpenedCheckpoint
    base: OpenedCheckpoint
    tensors: dict[str, torch.Tensor]  # decoded tensors of the delta entries

    @property
    def manifest(self) -> Manifest:
        return self.opened.manifest

    def release(self) -> None:
        self.opened.release()
        self.base.release()


def _open_base(store: Store, m: Manifest, workers: int | None) -> OpenedCheckpoint:
    assert m.light is not None
    base_step = int(m.light["base_step"])
    where = f"base {m.run}@{base_step} of light checkpoint {m.run}@{m.step}"
    try:
        data = store.read_manifest(m.run, base_step)
    except StepvaultError as exc:
        raise LightBaseError(f"{where} cannot be read ({exc}); the light one is unusable") from exc
    if content_hash(data) != m.light.get("base_manifest"):
        raise LightBaseError(f"{where} was replaced since the light one was saved")
    try:
        base = open_checkpoint(store, m.run, base_step, workers=workers)
        base.verify_all()
    except IntegrityError as exc:
        raise LightBaseError(f"{where} is damaged: {exc}") from exc
    return base


def prepare_light(
    store: Store,
    opened: OpenedCheckpoint,
    state: MutableMapping[str, Any],
    *,
    strict: bool = True,
    workers: int | None = None,
    progress: Any = None,
) -> PreparedLight:
    """Open and verify the base of ``opened`` (a light checkpoint), check the rebuilt state
    against ``state`` and decode every delta. Raises :class:`LightBaseError` (base unusable),
    another :class:`IntegrityError` (the light one damaged) or :class:`StateMismatchError`.
    """
    m = opened.manifest
    if m.light is None:
        raise IntegrityError(f"{m.run}@{m.step} is of kind 'light' but has no light section")
    entries: dict[str, Any] = m.light["tensors"]

    def stand_in(kind: str, name: str) -> Any:
        e = entries.get(name)
        if e is not None and e["encoding"] == "delta":
            return torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]), device="meta")
        return opened.reader.meta(name)

    problems = validate(state, decode_value(m.state, stand_in), m.state_kinds, strict=strict)
    if problems:
        raise StateMismatchError(problems)
    opened.verify_all(progress)
    base = _open_base(store, m, workers)
    tensors: dict[str, torch.Tensor] = {}
    try:
        for name, e in entries.items():
            if e["encoding"] != "delta":
                continue
            held = base.reader.read(name)
            payload = opened.reader.read(name)
            try:
                tensors[name] = decode_light_delta(
                    held, payload.numpy().tobytes(), bits=int(e["bits"]), block=int(e["block"])
                )
            except ValueError as exc:
                raise IntegrityError(f"{m.run}@{m.step}: light tensor {name!r}: {exc}") from exc
    except BaseException:
        base.release()
        raise
    return PreparedLight(opened, base, tensors)


def place_light(
    prepared: PreparedLight,
    state: MutableMapping[str, Any],
    *,
    strict: bool = True,
    assign: bool = False,
) -> None:
    """Load a prepared light checkpoint into ``state`` (the only step that changes it)."""
    m = prepared.manifest
    reader = prepared.opened.reader

    def value(kind: str, name: str) -> Any:
        decoded = prepared.tensors.get(name)
        return decoded if decoded is not None else reader.read(name, private=True)

    tree = decode_value(m.state, value)
    prepared.release()
    apply(state, tree, m.state_kinds, strict=strict, validated=True, assign=assign)


def light_arrays(
    store: Store, manifest: Manifest, snapshot: Snapshot, options: LightOptions | None = None
) -> dict[str, Any]:
    """The arrays to write for ``manifest`` (of kind ``"light"``), filling its ``light``
    section; with no full checkpoint to be a delta against, the save becomes a full one
    (``manifest.kind = "full"``, and the run's event log says so)."""
    built = build_light(store, manifest.run, manifest.step, snapshot, options)
    if built is None:
        manifest.kind = "full"
        try:
            log_event(
                store,
                manifest.run,
                "light_as_full",
                step=manifest.step,
                reason="no full checkpoint to be a delta against yet",
            )
        except OSError:
            pass  # the log is a record, never a reason to fail a save
        return snapshot.arrays
    arrays, manifest.light = built
    return arrays


def light_host(
    store: Store, manifest: Manifest, snapshot: Snapshot, options: LightOptions | None = None
) -> dict[str, HostArray] | None:
    """:func:`light_arrays` as host arrays that own their bytes (so the write may run in
    the background while training changes the live tensors); None when the save became a
    full one (``manifest.kind == "full"``: stage it like any full save)."""
    arrays = light_arrays(store, manifest, snapshot, options)
    if manifest.light is None:
        return None
    fresh = {n for n, e in manifest.light["tensors"].items() if e["encoding"] == "delta"}
    out = {}
    for name, value in arrays.items():
        if name not in fresh:  # exact values still alias the live state: copy them
            value = value.detach().clone() if isinstance(value, torch.Tensor) else value.copy()
        out[name] = to_host(value)
    return out
