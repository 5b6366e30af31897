"""The run page's data: checkpoints with their marks, the whole metric history, per-save
statistics, the run's settings and summary; the live delta since a page's cursor; one page
of the checkpoint table."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidNameError, StepvaultError
from ..registry import lineage_report
from ..store import Store
from .reader import StoreReader, existing_run, registered_steps, run_settings, tiers_of

TABLE_ROWS = 200
#: Longest list of steps a retention preview spells out; longer ones are ranges.
_MARK_EVENTS = (
    "pin",
    "unpin",
    "annotate",
    "register",
    "tier_copy",
    "tier_evict",
    "thin",
    "quarantine",
    "repair",
    "hold",
    "release",
    "tracker_ref",
)


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


def _metric_history(
    events: list[dict[str, Any]], records: list[Any]
) -> tuple[dict[str, list[list[Any]]], list[int]]:
    """Each metric's whole curve: the values of the checkpoints that exist (annotations
    merged), and of every step a save event recorded, deleted ones included; and the
    steps whose checkpoint is gone (retention, gc), drawn as such."""
    values: dict[int, dict[str, float]] = {}
    for e in events:
        if e.get("event") != "save" or type(e.get("step")) is not int:
            continue
        metrics = e.get("metrics")
        if isinstance(metrics, dict):
            values[e["step"]] = {
                str(k): float(v)
                for k, v in metrics.items()
                if isinstance(v, int | float) and not isinstance(v, bool)
            }
    existing = {r.step for r in records}
    for r in records:
        if not r.error:
            values[r.step] = {**values.get(r.step, {}), **r.metrics}
    names = sorted({m for v in values.values() for m in v})
    series = {
        m: [[step, values[step][m]] for step in sorted(values) if m in values[step]] for m in names
    }
    deleted = sorted(step for step in values if step not in existing)
    return series, deleted


def _run_summary(view: Store, run: str, events: list[dict[str, Any]], newest: int | None):
    """Config, code, host and duration of a run: its info, its events and the lineage of
    its newest checkpoint (one manifest read)."""
    info = view.read_run_info(run) or {}
    saves = [e for e in events if e.get("event") == "save" and isinstance(e.get("time"), float)]
    first = saves[0]["time"] if saves else info.get("created")
    last = saves[-1]["time"] if saves else None
    lineage: dict[str, Any] = {}
    if newest is not None:
        with contextlib.suppress(StepvaultError, OSError, KeyError, TypeError):
            lineage = lineage_report(view, f"{run}@{newest}")["checkpoint"].get("lineage") or {}
    code = lineage.get("code") if isinstance(lineage.get("code"), dict) else {}
    return {
        "created": info.get("created"),
        "first_save": first,
        "last_save": last,
        "duration_seconds": (last - first) if first and last else None,
        "hosts": sorted({str(e.get("host")) for e in saves if e.get("host")}),
        "environment": info.get("environment") or {},
        "config": lineage.get("config") if isinstance(lineage.get("config"), dict) else {},
        "code": code or {},
    }


@dataclass
class RunState:
    """A run page's data (``doc``) and what a live update needs to send only what changed
    (each event's kind and step, in log order)."""

    doc: dict[str, Any]
    event_index: list[tuple[str, Any]]
    #: ``doc`` as JSON, once it was asked for whole
    encoded: bytes | None = None
    gzipped: bytes | None = None


def run_state(reader: StoreReader, run: str) -> RunState:
    """Checkpoints of ``run`` with their marks, the whole metric history, per-save
    statistics, the run's settings and summary."""
    view = reader.view()
    existing_run(view, run)
    summaries = reader.records(view, run)
    steps = [s.step for s in summaries]
    pinned = set(view.pinned_steps(run))
    registered = registered_steps(view, run)
    tiers = tiers_of(view, run, steps)
    good = [s for s in summaries if not s.error]
    events = reader.events(view, run)
    settings = run_settings(events)
    series, deleted = _metric_history(events, summaries)
    # "best" is what the run declared (best_metric/best_mode, KeepBest): never guessed
    # from a metric's name; a metric without a declared direction has no best.
    modes = {m: mode for m, mode in settings["best"].items() if m in series}
    best: dict[int, list[str]] = {}
    for metric, mode in modes.items():
        scored = [s for s in good if metric in s.metrics]
        if scored:
            ranked = sorted(scored, key=lambda s, m=metric: s.metrics[m])  # type: ignore[misc]
            pick = ranked[-1] if mode == "max" else ranked[0]
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
    newest = good[-1].step if good else None
    doc = {
        "run": run,
        "url": view.backend.url,
        "run_info": view.read_run_info(run),
        "summary": _run_summary(view, run, events, newest),
        "settings": settings,
        "checkpoints": checkpoints,
        "metrics": series,
        "deleted_steps": deleted,
        "best_modes": modes,
        "saves": _save_stats(events),
        "deletions": [
            {"step": e.get("step"), "time": e.get("time"), "reasons": e.get("reasons", [])}
            for e in events
            if e.get("event") == "delete"
        ],
        "cursor": f"{steps[-1] if steps else -1}:{len(events)}",
    }
    return RunState(doc, [(str(e.get("event")), e.get("step")) for e in events])


def run_detail(reader: StoreReader, run: str) -> dict[str, Any]:
    """The run page's data (see :func:`run_state`)."""
    return run_state(reader, run).doc


def parse_cursor(text: str) -> tuple[int, int]:
    """``"STEP:EVENTS"`` (a run page's cursor) -> (newest step seen, events seen)."""
    head, sep, tail = text.partition(":")
    try:
        step, seen = int(head), int(tail)
    except ValueError:
        step, seen = -2, -1
    if not sep or step < -1 or seen < 0 or len(text) > 40:
        raise InvalidNameError(f"bad cursor {text[:40]!r}: expected STEP:EVENTS from the page")
    return step, seen


def run_delta(state: RunState, cursor: str) -> dict[str, Any]:
    """What changed on a run page since ``cursor`` (the ``cursor`` of the data the page
    has): new and changed checkpoints, removed steps, new metric points and save
    statistics, and the (small) marks maps whole. ``{"reload": true}`` when the log was
    rewritten under the page; otherwise a few hundred bytes per save."""
    doc = state.doc
    seen_step, seen_events = parse_cursor(cursor)
    if doc["cursor"] == cursor:
        return {"delta": True, "unchanged": True, "cursor": cursor}
    new_events = state.event_index[seen_events:]
    if seen_events > len(state.event_index):
        return {"reload": True, "cursor": doc["cursor"]}
    touched = {s for k, s in new_events if type(s) is int and k in (*_MARK_EVENTS, "save")}
    removed = sorted({s for k, s in new_events if k == "delete" and type(s) is int})
    rows = [c for c in doc["checkpoints"] if c["step"] > seen_step or c["step"] in touched]
    fresh = {c["step"] for c in rows}
    existing = {c["step"] for c in doc["checkpoints"]}
    removed = [s for s in removed if s not in existing]
    changed_metric_steps = fresh | set(removed) | touched
    metrics = {
        m: [p for p in pts if p[0] > seen_step or p[0] in changed_metric_steps]
        for m, pts in doc["metrics"].items()
    }
    saves_before = sum(1 for k, _ in state.event_index[:seen_events] if k == "save")
    deletions_before = sum(1 for k, _ in state.event_index[:seen_events] if k == "delete")
    return {
        "delta": True,
        "cursor": doc["cursor"],
        "count": len(doc["checkpoints"]),
        "checkpoints": rows,
        "removed": removed,
        "metrics": {m: pts for m, pts in metrics.items() if pts},
        "deleted_steps": [s for s in doc["deleted_steps"] if s in set(removed) or s > seen_step],
        "best_modes": doc["best_modes"],
        "marks": {
            "pinned": [c["step"] for c in doc["checkpoints"] if c["pinned"]],
            "registered": {
                c["step"]: c["registered"] for c in doc["checkpoints"] if c["registered"]
            },
            "best": {c["step"]: c["best"] for c in doc["checkpoints"] if c["best"]},
        },
        "saves": doc["saves"][saves_before:],
        "deletions": doc["deletions"][deletions_before:],
    }


def table_page(
    checkpoints: list[dict[str, Any]], page: int = 0, step: int | None = None
) -> dict[str, Any]:
    """One page of the run table, newest first: ``page`` (0 = newest), or the page that
    holds ``step`` (or the nearest existing step) with that row marked."""
    rows = checkpoints[::-1]
    pages = max(1, -(-len(rows) // TABLE_ROWS))
    found = None
    if step is not None and rows:
        found = min(rows, key=lambda c: (abs(c["step"] - step), -c["step"]))["step"]
        index = next(i for i, c in enumerate(rows) if c["step"] == found)
        page = index // TABLE_ROWS
    page = min(max(page, 0), pages - 1)
    return {
        "rows": rows[page * TABLE_ROWS : (page + 1) * TABLE_ROWS],
        "page": page,
        "pages": pages,
        "found": found,
        "asked": step,
    }
