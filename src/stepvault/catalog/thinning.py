"""Thinning: a kept full checkpoint becomes weights-only (``ThinAfter``, FORMAT.md).

The new manifest keeps the ``module`` entries of the state (as a ``what="weights"`` save
does), the tensors and objects they name, the attachments and the metrics, and says what
it dropped in ``stats["thinned"]``. It replaces the old manifest with one atomic write
(temporary file + rename on local disks, one PUT on object stores): a reader, or a crash,
sees the old manifest or the new one, each complete and checksummed. The objects only
the old one named become garbage for the next sweep.

A manifest's BLAKE3 is what annotations and later attachments are bound to; the thinned
checkpoint keeps them: annotated metrics are folded into its metrics, and each later
attachment record is re-written for the new manifest *before* it is committed (a crash in
between leaves records bound to a manifest that never appeared: they apply to nothing).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

from ..format import parse_manifest
from ..format.encoding import decode_value
from ..format.manifest import Manifest, serialize_manifest
from ..format.record import CheckpointRecord
from ..policy import KeepPolicy, RetentionPlan
from ..policy.base import ThinEntry
from ..policy.thin import thin_candidates
from ..store import Store
from ..store.reader_holds import HoldRecord
from .annotations import manifest_id

SIGNED_REASON = "signed: thinning would break its signature (unsign or re-sign it to thin)"
SIGNED_RECORD_REASON = "has signed attachment records: re-binding would break their signature"
SHARDED_REASON = "written by several ranks: not thinned"
NO_MODULE_REASON = "no torch.nn.Module in its state: nothing to keep as weights"
LAYOUT_REASON = "state is not a mapping of named entries: not thinned"


def _names(tree: Any) -> set[str]:
    """The tensor and array names an encoded subtree refers to."""
    found: set[str] = set()
    decode_value(tree, lambda kind, name: found.add(name))
    return found


def thinned_manifest(
    manifest: Manifest, *, rule: str, metrics: dict[str, float], now: float
) -> tuple[Manifest | None, ThinEntry]:
    """The weights-only manifest of ``manifest`` (None, with the reason, when it cannot be
    thinned)."""
    step = manifest.step
    if manifest.sharded:
        return None, ThinEntry(step, False, SHARDED_REASON)
    state = manifest.state
    if type(state) is not dict or any(k.startswith("$") for k in state):
        return None, ThinEntry(step, False, LAYOUT_REASON)
    kept = [k for k in state if manifest.state_kinds.get(k) == "module"]
    dropped = [k for k in state if k not in kept]
    if not kept:
        return None, ThinEntry(step, False, NO_MODULE_REASON)
    names = _names({k: state[k] for k in kept})
    tensors = {n: t for n, t in manifest.tensors.items() if n in names}
    live = {c[0] for t in tensors.values() for c in t.chunks}
    live |= {e.digest for e in manifest.attachments.values()}
    objects = {d: o for d, o in manifest.objects.items() if d in live}
    dropped_bytes = sum(o.size for d, o in manifest.objects.items() if d not in live)
    stats = dict(manifest.stats)
    stats["thinned"] = {
        "from_kind": manifest.kind,
        "rule": rule,
        "time": now,
        "dropped": dropped,
        "dropped_tensors": len(manifest.tensors) - len(tensors),
        "dropped_bytes": dropped_bytes,
        "logical_bytes_before": manifest.logical_bytes,
    }
    thin = replace(
        manifest,
        kind="weights",
        metrics=dict(metrics),
        state={k: state[k] for k in kept},
        state_kinds={k: manifest.state_kinds[k] for k in kept},
        tensors=tensors,
        objects=objects,
        stats=stats,
    )
    stats["logical_bytes"] = thin.logical_bytes
    stats["stored_bytes"] = thin.stored_bytes
    return thin, ThinEntry(step, True, rule, dropped, dropped_bytes)


def _later_attachment_records(store: Store, run: str, step: int, mid: str) -> list[dict[str, Any]]:
    from .attachments import _record_keys

    records = []
    for key in _record_keys(store, run, step):
        try:
            record = json.loads(store.backend.read_bytes(key))
        except (FileNotFoundError, ValueError):
            continue
        if type(record) is dict and record.get("manifest_blake3") == mid:
            records.append(record)
    return records


def _rebind(store: Store, run: str, step: int, records: list[dict[str, Any]], new: str) -> None:
    from .attachments import _record_keys

    for record in records:
        data = json.dumps({**record, "manifest_blake3": new}, sort_keys=True).encode()
        for _ in range(100):  # created exclusively, numbered 1..n like attach_after's
            key = f"runs/{run}/attachments/{step}.{len(_record_keys(store, run, step)) + 1}.json"
            try:
                store.backend.put_atomic(key, [data], overwrite=False)
                break
            except FileExistsError:
                continue


def thin_checkpoint(
    store: Store,
    run: str,
    record: CheckpointRecord,
    *,
    rule: str,
    now: float | None = None,
    commit: bool = True,
) -> ThinEntry:
    """Thin ``run@record.step`` to its weights (``commit=False``: only say what it would
    do). The caller holds the run's lease (the manager, ``stepvault gc``)."""
    step = record.step
    now = time.time() if now is None else now
    if store.read_signature(run, step) is not None:
        return ThinEntry(step, False, SIGNED_REASON)
    data = store.read_manifest(run, step)
    old_id = manifest_id(data)
    later = _later_attachment_records(store, run, step, old_id)
    if any("signature" in r for r in later):
        return ThinEntry(step, False, SIGNED_RECORD_REASON)
    # record.metrics carries the annotations made for the old manifest: they stay.
    thin, entry = thinned_manifest(
        parse_manifest(data, f"{run}@{step}"), rule=rule, metrics=record.metrics, now=now
    )
    if thin is None or not commit:
        return entry
    new_data = store.stamped(run, serialize_manifest(thin))  # the file as committed
    if later:
        _rebind(store, run, step, later, manifest_id(new_data))
    if store.read_manifest(run, step) != data:
        return ThinEntry(step, False, "changed while being thinned: left for the next pass")
    store.commit_manifest(run, step, new_data, overwrite=True)
    return entry


def plan_thinning(
    store: Store,
    run: str,
    records: list[CheckpointRecord],
    policy: KeepPolicy | None,
    plan: RetentionPlan,
    *,
    now: float,
    holds: dict[int, list[HoldRecord]],
) -> dict[int, tuple[CheckpointRecord, str]]:
    """Fill ``plan.thin`` (what a dry run shows); return the checkpoints to thin, with the
    rule that is due for each."""
    by_step = {r.step: r for r in records}
    todo: dict[int, tuple[CheckpointRecord, str]] = {}
    for step, (rule, why_not) in thin_candidates(records, policy, plan, now=now).items():
        if not why_not and step in holds:
            why_not = f"{holds[step][0].describe()}: not thinned"
        if why_not:
            plan.thin.append(ThinEntry(step, False, why_not))
            continue
        entry = thin_checkpoint(store, run, by_step[step], rule=rule, now=now, commit=False)
        plan.thin.append(entry)
        if entry.thin:
            todo[step] = (by_step[step], rule)
    return todo


def apply_thinning(
    store: Store,
    run: str,
    todo: dict[int, tuple[CheckpointRecord, str]],
    *,
    now: float,
    log: Any,
    extra: dict[str, Any],
) -> list[int]:
    """Thin the checkpoints ``todo`` names (from :func:`plan_thinning`), each re-checked
    for a reader hold right before; log a ``thin`` event each; return the steps thinned."""
    from ..store.reader_holds import live_holds

    done = []
    for step, (record, rule) in sorted(todo.items()):
        if step in live_holds(store, run, clean=False):
            continue  # a reader took a hold since the plan was made
        entry = thin_checkpoint(store, run, record, rule=rule, now=now)
        if entry.thin:
            done.append(step)
            log(
                "thin",
                step=step,
                rule=rule,
                dropped=entry.dropped,
                dropped_bytes=entry.dropped_bytes,
                **extra,
            )
    return done


def weights_only_problem(manifest: Manifest, wanted: list[str]) -> str:
    """Why a weights-only checkpoint cannot restore the training state keys ``wanted``,
    and the way out (the first line of a restore's mismatch error)."""
    ref = f"{manifest.run}@{manifest.step}"
    thinned = manifest.stats.get("thinned")
    if isinstance(thinned, dict):
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(float(thinned.get("time", 0))))
        dropped = ", ".join(str(k) for k in thinned.get("dropped", [])) or "training state"
        how = f"thinned by {thinned.get('rule', 'ThinAfter')} on {when}, which dropped: {dropped}"
    else:
        how = "saved with what='weights'"
    modules = ", ".join(f"{k!r}: ..." for k in manifest.state_kinds) or "'model': model"
    return (
        f"{ref} is a weights-only checkpoint ({how}) and cannot restore "
        f"{', '.join(wanted)}. For evaluation or export restore its modules alone "
        f"(a state of {{{modules}}}); to resume training restore a full checkpoint "
        "(step='latest' takes the newest full one)"
    )


def explain_weights_only(
    manifest: Manifest, state_keys: list[str], problems: list[str]
) -> list[str]:
    """``problems`` of a restore, led by the weights-only explanation when the checkpoint
    is weights-only and the live state wants more than its modules."""
    missing = [k for k in state_keys if k not in manifest.state_kinds]
    if manifest.kind != "weights" or not missing:
        return problems
    return [weights_only_problem(manifest, missing), *problems]
