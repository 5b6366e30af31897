"""The checkpoint page's data: tensors, the change against the previous checkpoint, lineage,
signature, a quick verify, the trackers that reference it; and the in-page diff against
another checkpoint."""

from __future__ import annotations

import contextlib
from typing import Any

from blake3 import blake3

from ..catalog.annotations import manifest_id, merged_metrics, read_annotations
from ..errors import CheckpointNotFoundError, StepvaultError
from ..format import parse_manifest
from ..ops.verify import verify_store
from ..registry import lineage_report
from ..store import validate_run_name
from .reader import StoreReader, existing_run, parse_step, registered_steps, root_option, tiers_of


def checkpoint_detail(reader: StoreReader, run: str, step: int) -> dict[str, Any]:
    """Tensors, the change against the previous checkpoint, lineage, signature, verify."""
    view = reader.view()
    existing_run(view, run)
    steps = view.list_steps(run)
    if step not in steps:
        raise CheckpointNotFoundError(f"no checkpoint {run}@{step} in {view.backend.url}")
    doc: dict[str, Any] = {
        "run": run,
        "step": step,
        "url": view.backend.url,
        "previous_step": max((s for s in steps if s < step), default=None),
        "next_step": min((s for s in steps if s > step), default=None),
        "commands": _commands(view.backend.url, run, step),
    }
    events = reader.events(view, run)
    doc["referenced_by"] = _tracker_refs(events, step)
    try:
        data = view.read_manifest(run, step)
        m = parse_manifest(data, f"{run}@{step}")
    except StepvaultError as exc:
        doc["error"] = str(exc)
        root = root_option(view.backend.url)
        doc["repair"] = {
            "verify": f"stepvault {root} verify {run}@{step} --deep",
            "repair (dry run)": f"stepvault {root} repair {run} --dry-run",
            "repair": f"stepvault {root} repair {run}",
        }
        return doc
    prev_objects: set[str] = set()
    if doc["previous_step"] is not None:
        with contextlib.suppress(StepvaultError):
            prev = parse_manifest(view.read_manifest(run, doc["previous_step"]), "previous")
            prev_objects = set(prev.objects)
    tensors = []
    for name, t in m.tensors.items():
        digests = list(dict.fromkeys(d for d, _, _ in t.chunks))
        new = sum(length for d, _, length in t.chunks if d not in prev_objects)
        tensors.append(
            {
                "name": name,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "bytes": t.nbytes,
                "codecs": sorted({m.objects[d].codec for d in digests if d in m.objects}),
                "objects": len(digests),
                "new_bytes": new,
                "changed": new > 0,
            }
        )
    signature = view.read_signature(run, step)
    verify = verify_store(view, run=run, step=step, deep=False)
    lineage: dict[str, Any] | None
    try:
        lineage = lineage_report(view, f"{run}@{step}")["checkpoint"]
    except StepvaultError as exc:
        lineage = {"error": str(exc)}
    doc.update(
        {
            "manifest_blake3": blake3(data).hexdigest(),
            "epoch": m.epoch,
            "kind": m.kind,
            "created": m.created,
            "parent_step": m.parent_step,
            # the metrics at save time with the evaluations annotated since (as listings
            # and KeepBest see them), and which ones came from an annotation
            "metrics": merged_metrics(
                dict(m.metrics), read_annotations(view, run).get(step, []), manifest_id(data)
            ),
            "saved_metrics": dict(m.metrics),
            "state_kinds": dict(m.state_kinds),
            "environment": dict(m.environment),
            "logical_bytes": m.logical_bytes,
            "stored_bytes": m.stored_bytes,
            "new_bytes": int(m.stats.get("new_bytes", 0)),
            "sharded": bool(m.sharded),
            "sharded_entries": len(m.sharded.get("entries", {})) if m.sharded else 0,
            "tensors": tensors,
            "changed_tensors": sum(1 for t in tensors if t["changed"]),
            "pinned": step in set(view.pinned_steps(run)),
            "registered": registered_steps(view, run).get(step, []),
            "tiers": tiers_of(view, run, [step])[step],
            "signature": _signature_summary(signature, data),
            "verify": {
                "ok": verify.ok,
                "mode": "quick",
                "objects_checked": verify.objects_checked,
                "problems": [p for c in verify.checkpoints for p in c.problems],
            },
            "lineage": lineage,
        }
    )
    return doc


def compare_checkpoints(reader: StoreReader, run: str, step: int, other: str) -> dict[str, Any]:
    """``stepvault diff OTHER RUN@STEP`` in the page: per tensor, same / changed / added /
    removed, the max, mean and relative change, and the new bytes this checkpoint stores
    against ``other`` (``RUN@STEP``, or a step of the same run)."""
    from ..ops.tensor_diff import diff_manifests

    view = reader.view()
    other_run, sep, other_step = other.strip().rpartition("@")
    other_run = validate_run_name(other_run) if sep else run
    before = (other_run, parse_step(other_step))
    manifests = []
    for r, s in (before, (run, step)):
        existing_run(view, r)
        try:
            manifests.append(parse_manifest(view.read_manifest(r, s), f"{r}@{s}"))
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"no checkpoint {r}@{s} in {view.backend.url}") from None
    report = diff_manifests(view, manifests[0], manifests[1]).to_json()
    report["command"] = (
        f"stepvault {root_option(view.backend.url)} diff {before[0]}@{before[1]} {run}@{step}"
    )
    return {"run": run, "step": step, "other": f"{before[0]}@{before[1]}", **report}


def _tracker_refs(events: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    """The experiment trackers that reference ``step`` (``tracker_ref`` events: MLflow,
    W&B, Ray runs that logged this checkpoint), newest first, one per (tracker, ref)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for e in events:
        if e.get("event") != "tracker_ref" or e.get("step") != step:
            continue
        tracker, ref = str(e.get("tracker", "")), str(e.get("ref", ""))
        out[(tracker, ref)] = {
            "tracker": tracker,
            "ref": ref,
            "name": str(e.get("name", "")),
            "time": e.get("time"),
            # only web addresses become links: a runs:/ or file URI is shown as text
            "link": ref if ref.startswith(("http://", "https://")) else None,
        }
    return sorted(out.values(), key=lambda r: -(r["time"] or 0))


def _signature_summary(record: dict[str, Any] | None, data: bytes) -> dict[str, Any] | None:
    """Algorithm and key of the signature, and whether the manifest still is what was
    signed: the record names the signed bytes' BLAKE3, so an altered manifest shows without
    the key (``verify --signatures --key`` checks the signature itself)."""
    if record is None:
        return None
    out = {k: record.get(k) for k in ("alg", "key_id", "damaged") if record.get(k) is not None}
    signed = record.get("signed_blake3")
    if signed is not None and signed != blake3(data).hexdigest():
        out["altered"] = True  # the manifest is not the one that was signed
    return out


def _commands(url: str, run: str, step: int) -> dict[str, str]:
    root = root_option(url)
    return {
        "verify": f"stepvault {root} verify {run}@{step} --deep",
        "export": f"stepvault {root} export {run}@{step} -o exported/",
        "promote": f"stepvault {root} promote MODEL {run}@{step} --alias candidate",
        "pin": f"stepvault {root} pin {run}@{step} --note WHY",
        # Python: restore mutates live objects, so it has no command line of its own
        "restore": f'stepvault.restore("{url}", state, run="{run}", step={step})',
    }
