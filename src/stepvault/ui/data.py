"""What each dashboard page shows, as plain JSON-able dicts, read through the store's readers.

Every function here takes a :class:`StoreReader` (a store opened read-only, see
:mod:`stepvault.ui.readonly`) and returns data only; the HTML pages and the JSON endpoints
both render these dicts, so what a script reads from ``/api/...`` is what a person sees.
Nothing is re-implemented: listings come from :class:`stepvault.catalog.vault.Vault`, sizes from
:func:`stepvault.ops.store_usage`, tiers from :mod:`stepvault.tiers.view`, the audit
trail from :mod:`stepvault.catalog.events`, models from :class:`stepvault.registry.Registry`
and the retention preview from :func:`stepvault.policy.plan_retention`.

(Longer than most modules: the one read layer of the dashboard, a function per page,
all over the same readers; the web app is in app.py.)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

from ..catalog.events import read_events
from ..catalog.vault import Vault
from ..errors import CheckpointNotFoundError, InvalidNameError, StepvaultError
from ..format import parse_manifest
from ..ops.usage import store_usage
from ..ops.verify import verify_store
from ..registry import Registry, lineage_report
from ..store import Store, backend_for, validate_run_name, validate_step
from ..tiers.view import TieredView, read_view
from .readonly import ReadOnlyBackend

#: Metric names whose best value is the largest (everything else: the smallest, like a loss).
_MAX_HINTS = ("acc", "f1", "score", "auc", "bleu", "rouge", "map", "precision", "recall", "reward")
#: Metrics that are settings, not scores: never marked "best".
_NOT_RANKED = ("lr", "learning_rate", "epoch", "step", "grad_norm")
#: The dashboard's events page shows at most this many (newest first).
EVENTS_LIMIT = 1000


@dataclass
class StoreReader:
    """A store opened for the dashboard: read-only unless actions are allowed."""

    root: str
    writable: bool = False

    def store(self) -> Store:
        """The store as written (for actions); reads go through :meth:`view`."""
        return Store.open(self.root)

    def view(self) -> Store:
        """A fresh read view (hot and cold tiers), opened on every request so that the
        page shows what the store holds now; its backend refuses writes."""
        backend = backend_for(self.root)
        store = Store.open(backend if self.writable else ReadOnlyBackend(backend))
        return read_view(store)

    def vault(self) -> Vault:
        return Vault(self.view())


def parse_step(text: str) -> int:
    """A step from a URL: decimal digits only, below 10**18 (else InvalidNameError)."""
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        raise InvalidNameError(f"bad step {text[:40]!r}: expected a non-negative integer")
    return validate_step(int(text))


def best_mode(metric: str) -> str:
    """``"max"`` for accuracy-like names, else ``"min"`` (a loss): how "best" is marked."""
    name = metric.lower()
    return "max" if any(h in name for h in _MAX_HINTS) else "min"


def _existing_run(view: Store, run: str) -> str:
    validate_run_name(run)
    if run not in view.list_runs():
        raise CheckpointNotFoundError(f"no run {run!r} in {view.backend.url}")
    return run


def _registry(view: Store) -> Registry:
    return Registry(view)


def registered_steps(view: Store, run: str) -> dict[int, list[str]]:
    """Step -> ``["llama v2 (stable)", ...]`` for every registered version of ``run``."""
    out: dict[int, list[str]] = {}
    reg = _registry(view)
    with contextlib.suppress(StepvaultError, OSError):
        for model in reg.models():
            aliases = reg.aliases(model)
            for v in reg.versions(model):
                if v.run != run:
                    continue
                names = [a for a, n in aliases.items() if n == v.version]
                label = f"{model} v{v.version}" + (f" ({', '.join(names)})" if names else "")
                out.setdefault(v.step, []).append(label)
    return out


def _tiers_of(view: Store, run: str, steps: list[int]) -> dict[int, list[str]]:
    if not isinstance(view, TieredView):
        return {s: ["hot"] for s in steps}
    by_tier = view.steps_by_tier(run)
    return {s: [t for t in view.order if s in set(by_tier.get(t, []))] for s in steps}


# -- store page ------------------------------------------------------------------------------
def store_overview(reader: StoreReader) -> dict[str, Any]:
    """Runs (count, newest step, sizes, damage), store-wide savings, tiers, registry models."""
    view = reader.view()
    vault = Vault(view)
    usage = store_usage(view, scan_unreferenced=False)
    unique = {r.run: r.unique_stored_bytes for r in usage.runs}
    runs = []
    for name in vault.runs():
        summaries = vault.checkpoints(name)
        good = [s for s in summaries if not s.error]
        newest = good[-1] if good else None
        runs.append(
            {
                "run": name,
                "checkpoints": len(summaries),
                "newest_step": newest.step if newest else None,
                "newest_time": newest.created if newest else None,
                "logical_bytes": sum(s.logical_bytes for s in good),
                "stored_bytes": unique.get(name, 0),
                "damaged": [{"step": s.step, "error": s.error} for s in summaries if s.error],
                "metrics": sorted({k for s in good for k in s.metrics}),
            }
        )
    tiers: dict[str, Any] = {}
    if isinstance(view, TieredView):
        for tier, store in view._stores():
            tiers[tier] = store_usage(store, scan_unreferenced=False).to_json()
        tiers = {t: {k: v for k, v in u.items() if k != "runs"} for t, u in tiers.items()}
        for tier, why in view.unreachable.items():
            tiers[tier] = {"error": why}
    return {
        "url": view.backend.url,
        "runs": runs,
        "usage": {k: v for k, v in usage.to_json().items() if k != "runs"},
        "tiers": tiers,
        "models": registry_overview(reader, view=view)["models"],
    }


# -- run page --------------------------------------------------------------------------------
def _save_stats(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for e in events:
        if e.get("event") != "save":
            continue
        write = e.get("write_seconds")
        logical = e.get("logical_bytes")
        rate = logical / write if isinstance(write, int | float) and write > 0 and logical else None
        out.append(
            {
                "step": e.get("step"),
                "time": e.get("time"),
                "stall_seconds": e.get("stall_seconds"),
                "write_seconds": write,
                "throughput_bytes_per_s": rate,
                "new_bytes": e.get("new_bytes"),
                "asynchronous": e.get("asynchronous"),
            }
        )
    return out


def run_detail(reader: StoreReader, run: str) -> dict[str, Any]:
    """Checkpoints of ``run`` with their marks, metric series and per-save statistics."""
    view = reader.view()
    _existing_run(view, run)
    summaries = Vault(view).checkpoints(run)
    steps = [s.step for s in summaries]
    pinned = set(view.pinned_steps(run))
    registered = registered_steps(view, run)
    tiers = _tiers_of(view, run, steps)
    good = [s for s in summaries if not s.error]
    metrics = sorted({k for s in good for k in s.metrics})
    best: dict[int, list[str]] = {}
    for metric in metrics:
        if metric.lower() in _NOT_RANKED:
            continue
        scored = [s for s in good if metric in s.metrics]
        if scored:
            ranked = sorted(scored, key=lambda s, m=metric: s.metrics[m])  # type: ignore[misc]
            pick = ranked[-1] if best_mode(metric) == "max" else ranked[0]
            best.setdefault(pick.step, []).append(metric)
    checkpoints = [
        {
            "step": s.step,
            "epoch": s.epoch,
            "created": s.created,
            "kind": s.kind,
            "metrics": s.metrics,
            "logical_bytes": s.logical_bytes,
            "stored_bytes": s.stored_bytes,
            "new_bytes": s.new_bytes,
            "tensors": s.tensors,
            "error": s.error,
            "pinned": s.step in pinned,
            "registered": registered.get(s.step, []),
            "best": best.get(s.step, []),
            "tiers": tiers.get(s.step, []),
        }
        for s in summaries
    ]
    events = read_events(view, run)
    return {
        "run": run,
        "url": view.backend.url,
        "run_info": view.read_run_info(run),
        "checkpoints": checkpoints,
        "metrics": {m: [[s.step, s.metrics[m]] for s in good if m in s.metrics] for m in metrics},
        "best_modes": {m: best_mode(m) for m in metrics},
        "saves": _save_stats(events),
        "deletions": [
            {"step": e.get("step"), "time": e.get("time"), "reasons": e.get("reasons", [])}
            for e in events
            if e.get("event") == "delete"
        ],
    }


def keep_policy_from(params: Mapping[str, str]) -> Any:
    """A keep policy from the query parameters of the retention preview, the same rules as
    ``stepvault gc RUN --keep-last N --keep-best N --metric M --mode min --keep-every N``."""
    from ..policy import KeepBest, KeepEvery, KeepLast

    def number(key: str) -> int | None:
        text = params.get(key, "").strip()
        if not text:
            return None
        if not text.isdigit() or len(text) > 9 or int(text) < 1:
            raise InvalidNameError(f"{key} must be a positive integer, got {text[:20]!r}")
        return int(text)

    rules: list[Any] = []
    if (n := number("keep_last")) is not None:
        rules.append(KeepLast(n))
    if (n := number("keep_best")) is not None:
        metric = params.get("metric", "").strip()
        mode = params.get("mode", "min")
        if not metric or mode not in ("min", "max"):
            raise InvalidNameError("keep_best needs metric=NAME and mode=min|max")
        rules.append(KeepBest(n, metric=metric, mode="max" if mode == "max" else "min"))
    if (n := number("keep_every")) is not None:
        rules.append(KeepEvery(steps=n))
    policy = None
    for rule in rules:
        policy = rule if policy is None else policy | rule
    return policy


def retention_preview(reader: StoreReader, run: str, params: Mapping[str, str]) -> dict[str, Any]:
    """What a keep policy (from ``params``; default: keep the last 3) would keep and delete
    now, and which rule keeps each survivor — ``stepvault gc RUN ... --dry-run``."""
    from ..catalog.retention import name_registry_holds
    from ..manager.checkpoint_manager import checkpoint_records  # imports torch: only here
    from ..policy import plan_retention

    view = reader.view()
    _existing_run(view, run)
    if not any(params.get(k) for k in ("keep_last", "keep_best", "keep_every")):
        params = {**params, "keep_last": "3"}
    policy = keep_policy_from(params)
    plan = plan_retention(checkpoint_records(view, run), policy, now=time.time())
    name_registry_holds(view, run, plan)  # as gc says it: a registry hold is not a pin
    return {
        "run": run,
        "policy": repr(policy),
        "params": {
            k: params[k]
            for k in ("keep_last", "keep_best", "metric", "mode", "keep_every")
            if params.get(k)
        },
        "entries": plan.to_json(),
        "delete": plan.delete,
    }


# -- checkpoint page -------------------------------------------------------------------------
def checkpoint_detail(reader: StoreReader, run: str, step: int) -> dict[str, Any]:
    """Tensors, the change against the previous checkpoint, lineage, signature, verify."""
    view = reader.view()
    _existing_run(view, run)
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
    try:
        data = view.read_manifest(run, step)
        m = parse_manifest(data, f"{run}@{step}")
    except StepvaultError as exc:
        doc["error"] = str(exc)
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
            "metrics": dict(m.metrics),
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
            "tiers": _tiers_of(view, run, [step])[step],
            "signature": _signature_summary(signature),
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


def _signature_summary(record: dict[str, Any] | None) -> dict[str, Any] | None:
    if record is None:
        return None
    return {k: record.get(k) for k in ("alg", "key_id", "damaged") if record.get(k) is not None}


def _commands(url: str, run: str, step: int) -> dict[str, str]:
    root = f"--root {url}" if " " not in url else f"--root '{url}'"
    return {
        "verify": f"stepvault {root} verify {run}@{step} --deep",
        "export": f"stepvault {root} export {run}@{step} -o exported/",
        "promote": f"stepvault {root} promote MODEL {run}@{step} --alias candidate",
        "pin": f"stepvault {root} pin {run}@{step} --note WHY",
        # Python: restore mutates live objects, so it has no command line of its own
        "restore": f'stepvault.restore("{url}", state, run="{run}", step={step})',
    }


# -- registry page ---------------------------------------------------------------------------
def registry_overview(reader: StoreReader, *, view: Store | None = None) -> dict[str, Any]:
    """Every model: versions, current aliases, alias history and the lineage of each version."""
    view = view if view is not None else reader.view()
    reg = _registry(view)
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
def events_page(
    reader: StoreReader, run: str | None = None, kind: str | None = None, limit: int = EVENTS_LIMIT
) -> dict[str, Any]:
    """The audit trail of one run or of every run, newest first, optionally of one kind."""
    view = reader.view()
    runs = [_existing_run(view, run)] if run else view.list_runs()
    events: list[dict[str, Any]] = []
    for name in runs:
        events += [e for e in read_events(view, name) if isinstance(e, dict)]
    kinds = sorted({str(e.get("event")) for e in events})
    if kind:
        events = [e for e in events if e.get("event") == kind]
    events.sort(key=lambda e: e.get("time") or 0, reverse=True)
    return {
        "run": run,
        "kind": kind,
        "runs": view.list_runs(),
        "kinds": kinds,
        "total": len(events),
        "events": events[:limit],
    }


# -- live refresh ----------------------------------------------------------------------------
def change_token(reader: StoreReader) -> str:
    """A short digest that changes whenever a checkpoint, event or registry record is added
    or removed: listings only (no manifest is read), so pages can poll it every second."""
    view = reader.view()
    backend = view.backend
    h = blake3()
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
