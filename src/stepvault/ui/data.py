"""What the store-wide dashboard pages show, as plain JSON-able dicts: the store overview,
the registry, the audit trail and the change token the pages poll.

Every page's data function takes a :class:`~stepvault.ui.reader.StoreReader` (a store
opened read-only, see :mod:`stepvault.ui.readonly`) and returns data only; the HTML pages
and the JSON endpoints both render these dicts, so what a script reads from ``/api/...``
is what a person sees. Nothing is re-implemented: listings come from
:class:`stepvault.catalog.vault.Vault`, sizes from :func:`stepvault.ops.store_usage`, tiers
from :mod:`stepvault.tiers.view`, the audit trail from :mod:`stepvault.catalog.events` and
models from :class:`stepvault.registry.Registry`. The other pages: run_page.py,
checkpoint_page.py, retention_page.py.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from blake3 import blake3

from ..catalog.vault import Vault
from ..errors import CheckpointNotFoundError, StepvaultError
from ..ops.usage import store_usage
from ..registry import Registry, lineage_report
from ..store import Store
from ..tiers.view import TieredView
from .reader import StoreReader, existing_run

#: The dashboard's events page shows this many per page (newest first), with links back
#: to the first.
EVENTS_LIMIT = 1000


# -- store page ------------------------------------------------------------------------------
def store_overview(reader: StoreReader, usage_too: bool = True) -> dict[str, Any]:
    """Runs (count, newest step, sizes, damage), store-wide savings, tiers, registry models.

    ``usage_too=False`` leaves out what needs every manifest parsed (the store's and each
    tier's usage: seconds at 10,000 checkpoints): the page is sent at once and its script
    fetches the rest."""
    view = reader.view()
    vault = Vault(view)
    usage = store_usage(view, scan_unreferenced=False) if usage_too else None
    unique = {r.run: r.unique_stored_bytes for r in usage.runs} if usage else {}
    runs = []
    damaged = 0
    for name in vault.runs():
        summaries = reader.records(view, name)  # shared with the run pages
        damaged += sum(1 for s in summaries if s.error)
        good = [s for s in summaries if not s.error]
        newest = good[-1] if good else None
        runs.append(
            {
                "run": name,
                "checkpoints": len(summaries),
                "newest_step": newest.step if newest else None,
                "newest_time": newest.created if newest else None,
                "logical_bytes": sum(s.logical_bytes for s in good),
                "stored_bytes": unique.get(name) if usage else None,
                "damaged": [{"step": s.step, "error": s.error} for s in summaries if s.error],
                "metrics": sorted({k for s in good for k in s.metrics}),
            }
        )
    tiers: dict[str, Any] = {}
    if isinstance(view, TieredView):
        for tier, store in view._stores():
            if not usage_too:
                tiers[tier] = {"pending": True}
                continue
            tiers[tier] = store_usage(store, scan_unreferenced=False).to_json()
        tiers = {t: {k: v for k, v in u.items() if k != "runs"} for t, u in tiers.items()}
    # A cold tier that does not answer is named with since when (never waited for here).
    for tier, state in reader.tier_states().items():
        if state["state"] != "reachable" or tier not in tiers:
            tiers[tier] = {**state, "error": state["error"] or state["state"]}
    usage_doc: dict[str, Any] | None = None
    if usage is not None:
        usage_doc = {k: v for k, v in usage.to_json().items() if k != "runs"}
        # The usage counts readable checkpoints; the damaged ones are counted beside them.
        usage_doc["damaged"] = damaged
    return {
        "url": view.backend.url,
        "runs": runs,
        "usage": usage_doc,
        "tiers": tiers,
        "models": registry_overview(reader, view=view)["models"],
    }


# -- registry page ---------------------------------------------------------------------------
def registry_overview(reader: StoreReader, *, view: Store | None = None) -> dict[str, Any]:
    """Every model: versions, current aliases, alias history and the lineage of each version."""
    view = view if view is not None else reader.view()
    reg = Registry(view)
    models = []
    for model in reg.models():
        aliases = reg.aliases(model)
        versions = []
        for v in reg.versions(model):
            entry = v.to_json()
            entry["aliases"] = [a for a, n in aliases.items() if n == v.version]
            try:
                node = lineage_report(view, f"{model}@v{v.version}")["checkpoint"]
                entry["lineage"] = node.get("lineage")
                if node.get("lineage_error"):
                    entry["lineage_error"] = node["lineage_error"]
            except (StepvaultError, CheckpointNotFoundError) as exc:
                entry["lineage_error"] = str(exc)
            versions.append(entry)
        models.append(
            {
                "model": model,
                "aliases": aliases,
                "versions": versions,
                "history": [h.to_json() for h in reg.history(model)],
            }
        )
    return {"models": models}


# -- events page -----------------------------------------------------------------------------
_EVENT_FIELDS = ("time", "event", "run", "step", "user", "host", "pid")


def _shown(key: str, value: Any) -> str:
    """An event field as a person reads it: sizes in units, floats to 4 significant
    digits, lists and objects as compact JSON (never a Python repr)."""

    from .._units import human_bytes

    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int | float) and key.endswith("_bytes"):
        return human_bytes(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(", ", ": "), default=str, sort_keys=True)
    return str(value)


def events_page(
    reader: StoreReader,
    run: str | None = None,
    kind: str | None = None,
    limit: int = EVENTS_LIMIT,
    offset: int = 0,
) -> dict[str, Any]:
    """The audit trail of one run or of every run, newest first, optionally of one kind:
    ``limit`` events from ``offset`` (0 = the newest), so every event back to the first
    is a page away."""
    view = reader.view()
    runs = [existing_run(view, run)] if run else view.list_runs()
    events: list[dict[str, Any]] = []
    for name in runs:
        events += reader.events(view, name)
    kinds = sorted({str(e.get("event")) for e in events})
    if kind:
        events = [e for e in events if e.get("event") == kind]
    events.sort(key=lambda e: e.get("time") or 0, reverse=True)
    offset = max(0, min(offset, max(0, len(events) - 1)))
    shown = []
    for e in events[offset : offset + limit]:
        details = [
            [k, _shown(k, v)]
            for k, v in e.items()
            if k not in _EVENT_FIELDS and v not in (None, "", [], {})
        ]
        shown.append({**e, "details": details})
    return {
        "run": run,
        "kind": kind,
        "runs": view.list_runs(),
        "kinds": kinds,
        "total": len(events),
        "offset": offset,
        "limit": limit,
        "events": shown,
    }


# -- live refresh ----------------------------------------------------------------------------
def change_token(reader: StoreReader) -> str:
    """A short digest that changes whenever a checkpoint, event or registry record is added
    or removed: listings only (no manifest is read), so pages can poll it every second."""
    view = reader.view()
    backend = view.backend
    h = blake3()
    # a cold tier going down or coming back changes what the pages show
    for name, state in sorted(reader.tier_states().items()):
        h.update(f"{name}:{state['state']}:{state['since']};".encode())
    for run in view.list_runs():
        steps = view.list_steps(run)
        h.update(f"{run}:{len(steps)}:{steps[-1] if steps else -1};".encode())
        with contextlib.suppress(OSError):
            h.update(str(backend.size(f"events/{run}.jsonl")).encode())
        h.update(str(len(backend.list(f"events/{run}"))).encode())
        h.update(str(len(backend.list(f"runs/{run}/annotations"))).encode())
        h.update(str(len(backend.list(f"refs/pins/{run}"))).encode())
    for model in backend.list("refs/registry"):
        for part in ("versions", "moves"):
            h.update(
                f"{model}/{part}:{len(backend.list(f'refs/registry/{model}/{part}'))};".encode()
            )
    return h.hexdigest()[:16]
