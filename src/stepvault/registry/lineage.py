"""``stepvault lineage``: model → version → checkpoint → run → config, code, data, parent."""

from __future__ import annotations

from typing import Any

from ..catalog.annotations import manifest_id
from ..catalog.lineage import read_lineage
from ..catalog.refs import resolve_ref
from ..errors import RegistryError, StepvaultError
from ..format import parse_manifest
from ..store import Store
from ..tiers.view import read_view
from .models import Registry

#: Parents are followed this deep (a fine-tune of a fine-tune of ...).
MAX_DEPTH = 32


def _checkpoint(store: Store, run: str, step: int) -> dict[str, Any]:
    data = store.read_manifest(run, step)
    m = parse_manifest(data, f"{run}@{step}")
    node: dict[str, Any] = {
        "run": run,
        "step": step,
        "manifest_blake3": manifest_id(data),
        "created": m.created,
        "kind": m.kind,
        "metrics": dict(m.metrics),
        "run_info": store.read_run_info(run),
        "lineage": None,
    }
    if m.lineage is not None:
        try:
            node["lineage"] = read_lineage(store, run, m.lineage)
        except StepvaultError as exc:
            node["lineage_error"] = str(exc)
    return node


def lineage_report(store: Store, spec: str) -> dict[str, Any]:
    """The lineage of ``MODEL[@ALIAS|@vN]`` or of a checkpoint ``RUN@STEP``.

    Returns ``{"model": ..., "version": ..., "checkpoint": {..., "lineage": record,
    "parent": {...}}}``; parents are followed (checking each one's manifest hash against
    the hash recorded at fine-tuning time).
    """
    registry = Registry(store)
    store = read_view(store)  # checkpoints, lineage records and parents on every tier
    name = spec.partition("@")[0]
    report: dict[str, Any] = {"spec": spec, "model": None, "version": None}
    step: int | str | None
    if name in registry.models():
        version = registry.resolve(spec)
        report["model"] = version.model
        report["version"] = version.to_json()
        report["aliases"] = [
            a for a, v in registry.aliases(version.model).items() if v == version.version
        ]
        run, step = version.run, version.step
    else:
        suffix = spec.partition("@")[2]
        if suffix and not (suffix == "latest" or suffix.isdigit()):
            # an alias or vN: a model reference, and no model has that name
            import difflib

            models = registry.models()
            near = difflib.get_close_matches(name, models, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise RegistryError(
                f"no model {name!r} in the registry: {hint}models: {', '.join(models) or 'none'}"
                " (a checkpoint is RUN@STEP)"
            )
        run, step = resolve_ref(store, spec)
    root = node = _checkpoint(store, run, step)
    for _ in range(MAX_DEPTH):
        parent = (node.get("lineage") or {}).get("parent")
        if not parent:
            break
        try:
            child = _checkpoint(store, parent["run"], int(parent["step"]))
        except StepvaultError as exc:
            node["parent"] = {**parent, "error": str(exc)}
            break
        if child["manifest_blake3"] != parent.get("manifest_blake3"):
            child["warning"] = "this checkpoint was replaced after the fine-tune started"
        node["parent"] = child
        node = child
    report["checkpoint"] = root
    return report
