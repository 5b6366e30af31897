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
import difflib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from blake3 import blake3

from ..catalog.annotations import manifest_id, merged_metrics, read_annotations
from ..catalog.events import read_events
from ..catalog.records import checkpoint_records
from ..catalog.vault import Vault
from ..errors import CheckpointNotFoundError, InvalidNameError, StepvaultError
from ..format import parse_manifest
from ..ops.usage import store_usage
from ..ops.verify import verify_store
from ..registry import Registry, lineage_report
from ..store import Store, backend_for, validate_run_name, validate_step
from ..tiers.probe import TierProbe
from ..tiers.view import TieredView
from .readonly import ReadOnlyBackend

#: The dashboard's events page shows this many per page (newest first), with links back
#: to the first.
EVENTS_LIMIT = 1000
#: Rows of the run page's checkpoint table per page (newest first).
TABLE_ROWS = 200
#: Longest list of steps a retention preview spells out; longer ones are ranges.
PREVIEW_ENTRIES = 60
#: Events after which a step's manifest is not the one read before.
_REWRITES = ("thin", "repair", "quarantine", "save", "delete")
#: Events that change what a run page shows of existing checkpoints (marks, tiers).
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


@dataclass
class StoreReader:
    """A store opened for the dashboard: read-only unless actions are allowed.

    Its cold tiers are probed in the background (:class:`~stepvault.tiers.probe.TierProbe`):
    a page reads only the tiers known to answer, so a dead archive costs one bounded probe
    now and then, never a page's latency."""

    root: str
    writable: bool = False
    probe: TierProbe = field(init=False, repr=False)
    #: records read from manifests, per run (manifests are immutable: a live page reads
    #: only the new ones); dropped by :meth:`forget_records` so that damage done to a
    #: manifest after it was read shows up (the app does so every MEMO_SECONDS)
    _records: dict[str, dict[int, Any]] = field(init=False, repr=False, default_factory=dict)
    _events: dict[str, tuple[int, list[dict[str, Any]]]] = field(
        init=False, repr=False, default_factory=dict
    )
    #: events of the run already applied to its record cache
    _records_seen: dict[str, int] = field(init=False, repr=False, default_factory=dict)
    records_born: float = field(init=False, default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.probe = TierProbe(wrap=None if self.writable else ReadOnlyBackend)

    def records(self, view: Store, run: str) -> list[Any]:
        """``checkpoint_records`` of ``run`` in ``view``, reading only manifests not read
        since the last :meth:`forget_records` (annotations and pins: every call), and again
        those the event log says were rewritten since (thinned, repaired, saved anew)."""
        cache = self._records.setdefault(run, {})
        events = self.events(view, run)
        seen = self._records_seen.get(run, len(events))
        for e in events[seen:]:
            if e.get("event") in _REWRITES and type(e.get("step")) is int:
                cache.pop(e["step"], None)
        self._records_seen[run] = len(events)
        return checkpoint_records(view, run, cache)

    def forget_records(self) -> None:
        self._records = {}
        self._records_seen = {}
        self._events = {}
        self.records_born = time.monotonic()

    def events(self, view: Store, run: str) -> list[dict[str, Any]]:
        """The run's events (:func:`~stepvault.catalog.events.read_events`), read
        incrementally from a local log: only the bytes appended since the last call are
        parsed (a run of 10,000 saves: a few lines per update instead of 10,000)."""
        validate_run_name(run)
        key = f"events/{run}.jsonl"
        backend = view.backend
        if not backend.append_is_cheap or backend.list(f"events/{run}"):
            return [e for e in read_events(view, run) if isinstance(e, dict)]
        try:
            size = backend.size(key)
        except OSError:
            return []
        done, events = self._events.get(run, (0, []))
        if size < done:  # rewritten under us: start over
            done, events = 0, []
        if size > done:
            tail = backend.read_range(key, done, size - done)
            end = tail.rfind(b"\n") + 1  # a line still being appended is read next time
            fresh = []
            for line in tail[:end].splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    fresh.append(record)
            done, events = done + end, events + fresh
        self._events[run] = (done, events)
        return list(events)

    def store(self) -> Store:
        """The store as written (for actions); reads go through :meth:`view`."""
        return Store.open(self.root)

    def hot(self) -> Store:
        """The hot store alone, read-only unless writable (what ``stepvault gc`` acts on)."""
        backend = backend_for(self.root)
        return Store.open(backend if self.writable else ReadOnlyBackend(backend))

    def view(self) -> Store:
        """A fresh read view (the hot store and the cold tiers that answer), opened on every
        request so that the page shows what the store holds now; its backend refuses
        writes."""
        return self.probe.view(self.hot())

    def tier_states(self) -> dict[str, dict[str, Any]]:
        """Each cold tier: ``state`` (reachable, unreachable, probing), ``since``, ``error``."""
        return {n: s.to_json() for n, s in self.probe.refresh(self.hot()).items()}

    def vault(self) -> Vault:
        return Vault(self.view())


def parse_step(text: str) -> int:
    """A step from a URL: decimal digits only, below 10**18 (else InvalidNameError)."""
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        raise InvalidNameError(f"bad step {text[:40]!r}: expected a non-negative integer")
    return validate_step(int(text))


def run_settings(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's own retention settings, from its newest save event that carries them (a
    manager writes ``keep``, the repr of its keep policy, and ``best``, the
    ``[metric, mode]`` pairs that "best" means for it): ``{"keep": str | None, "best":
    {metric: mode}}``; empty when no manager recorded them (then no metric has a best)."""
    for e in reversed(events):
        if isinstance(e, dict) and e.get("event") == "save" and "best" in e:
            best = e.get("best") or []
            modes = {
                str(p[0]): str(p[1])
                for p in best
                if isinstance(p, list) and len(p) == 2 and p[1] in ("min", "max")
            }
            keep = e.get("keep")
            return {"keep": keep if isinstance(keep, str) else None, "best": modes}
    return {"keep": None, "best": {}}


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
    by_tier = {t: set(held) for t, held in view.steps_by_tier(run).items()}
    return {s: [t for t in view.order if s in by_tier.get(t, ())] for s in steps}


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
    _existing_run(view, run)
    summaries = reader.records(view, run)
    steps = [s.step for s in summaries]
    pinned = set(view.pinned_steps(run))
    registered = registered_steps(view, run)
    tiers = _tiers_of(view, run, steps)
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


def keep_policy_from(params: Mapping[str, str], known_metrics: list[str] | None = None) -> Any:
    """A keep policy from the query parameters of the retention preview, the same rules as
    ``stepvault gc RUN --keep-last N --keep-best N --metric M --mode min --keep-every N``
    (None when no rule is given). With ``known_metrics``, a metric the run never recorded
    is refused by name (with the nearest known one), not silently matched by nothing."""
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
        if known_metrics is not None and metric not in known_metrics:
            near = difflib.get_close_matches(metric, known_metrics, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            known = ", ".join(known_metrics) or "none"
            raise InvalidNameError(
                f"unknown metric {metric[:64]!r}: {hint}this run recorded: {known}"
            )
        rules.append(KeepBest(n, metric=metric, mode="max" if mode == "max" else "min"))
    if (n := number("keep_every")) is not None:
        rules.append(KeepEvery(steps=n))
    policy = None
    for rule in rules:
        policy = rule if policy is None else policy | rule
    return policy


def _gc_command(url: str, run: str, policy: Any) -> str | None:
    """The ``stepvault gc ... --dry-run`` line that plans exactly ``policy`` (None when a
    rule has no gc option)."""
    from ..policy import KeepAny, KeepBest, KeepEvery, KeepLast

    rules = list(policy.policies) if isinstance(policy, KeepAny) else [policy]
    parts = []
    for rule in rules:
        if type(rule) is KeepLast and rule.kind is None:
            parts.append(f"--keep-last {rule.n}")
        elif type(rule) is KeepBest:
            parts.append(f"--keep-best {rule.n} --metric {rule.metric} --mode {rule.mode}")
        elif type(rule) is KeepEvery and getattr(rule, "steps", None):
            parts.append(f"--keep-every {rule.steps}")
        else:
            return None
    root = f"--root {url}" if " " not in url else f"--root '{url}'"
    return f"stepvault {root} gc {run} {' '.join(parts)} --dry-run"


def _ranges(steps: list[int]) -> str:
    """``"10, 20-400 (39 steps), 500"``-like text of a sorted step list, consecutive
    checkpoints (whatever their stride) joined into one range."""
    if not steps:
        return "nothing"
    if len(steps) <= 12:
        return ", ".join(map(str, steps))
    return f"{steps[0]}–{steps[-1]} ({len(steps):,} checkpoints)"


def _summarised(plan: Any) -> list[dict[str, Any]]:
    """The plan's entries, newest first, runs of neighbours with the same verdict and
    reasons folded into one row (``first``..``step``, ``count``): a keep-everything run
    of 5,000 checkpoints is one row, not 5,000."""
    rows: list[dict[str, Any]] = []
    for e in reversed(plan.entries):
        key = (e.keep, tuple(e.reasons))
        last = rows[-1] if rows else None
        if last is not None and last["_key"] == key:
            last["first"] = e.step
            last["count"] += 1
            continue
        rows.append(
            {
                "_key": key,
                "step": e.step,
                "first": e.step,
                "count": 1,
                "keep": e.keep,
                "reasons": list(e.reasons),
            }
        )
    for row in rows:
        del row["_key"]
    return rows


def retention_preview(reader: StoreReader, run: str, params: Mapping[str, str]) -> dict[str, Any]:
    """What ``stepvault gc RUN ... --dry-run`` would keep and delete now, and which rule
    keeps each survivor: the same plan function (:func:`stepvault.ops.gc.plan_gc`) on
    the same store (the hot one: a checkpoint only in a cold tier is not gc's). The
    rules are the ones typed in, else the run's own configured keep policy; a run that
    has none keeps everything."""
    from ..ops.gc import plan_gc  # reads records through the catalog: only here

    hot = reader.hot()
    view = reader.view()
    _existing_run(view, run)
    events = reader.events(hot, run)
    settings = run_settings(events)
    typed = any(params.get(k) for k in ("keep_last", "keep_best", "keep_every"))
    doc: dict[str, Any] = {
        "run": run,
        "configured": settings["keep"],
        "source": "typed" if typed else "configured",
        "params": {
            k: params[k]
            for k in ("keep_last", "keep_best", "metric", "mode", "keep_every")
            if params.get(k)
        },
    }
    if typed:
        records = Vault(hot).checkpoints(run) if run in hot.list_runs() else []
        known = sorted({m for r in records for m in r.metrics} | set(_history_metrics(events)))
        policy = keep_policy_from(params, known)
    elif settings["keep"]:
        from ..planning.policies import parse_policy
        from ..planning.units import PlanError

        try:
            policy = parse_policy(settings["keep"], "--keep")
        except (PlanError, ValueError) as exc:
            doc.update(
                policy=settings["keep"],
                entries=[],
                delete=[],
                summary="",
                note=f"the run's keep policy cannot be previewed here ({exc}); "
                "type rules to preview gc",
            )
            return doc
    else:
        doc.update(
            policy=None,
            entries=[],
            delete=[],
            summary="nothing: no keep policy",
            note="this run has no keep policy: every checkpoint stays (type rules "
            "to preview what gc would delete)",
        )
        return doc
    if run not in hot.list_runs():
        doc.update(
            policy=repr(policy),
            entries=[],
            delete=[],
            summary="nothing",
            note="no checkpoint of this run is in the hot store: gc deletes none",
        )
        return doc
    plan = plan_gc(hot, run, policy, now=time.time())
    doc.update(
        policy=repr(policy),
        command=_gc_command(hot.backend.url, run, policy),
        entries=plan.to_json() if len(plan.entries) <= PREVIEW_ENTRIES else [],
        rows=_summarised(plan),
        delete=plan.delete,
        kept=len(plan.keep),
        summary=_ranges(plan.delete),
    )
    return doc


def _history_metrics(events: list[dict[str, Any]]) -> set[str]:
    return {
        str(k)
        for e in events
        if e.get("event") == "save" and isinstance(e.get("metrics"), dict)
        for k in e["metrics"]
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
    events = reader.events(view, run)
    doc["referenced_by"] = _tracker_refs(events, step)
    try:
        data = view.read_manifest(run, step)
        m = parse_manifest(data, f"{run}@{step}")
    except StepvaultError as exc:
        doc["error"] = str(exc)
        root = _root_option(view.backend.url)
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
        _existing_run(view, r)
        try:
            manifests.append(parse_manifest(view.read_manifest(r, s), f"{r}@{s}"))
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"no checkpoint {r}@{s} in {view.backend.url}") from None
    report = diff_manifests(view, manifests[0], manifests[1]).to_json()
    report["command"] = (
        f"stepvault {_root_option(view.backend.url)} diff {before[0]}@{before[1]} {run}@{step}"
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


def _root_option(url: str) -> str:
    return f"--root {url}" if " " not in url else f"--root '{url}'"


def _signature_summary(record: dict[str, Any] | None) -> dict[str, Any] | None:
    if record is None:
        return None
    return {k: record.get(k) for k in ("alg", "key_id", "damaged") if record.get(k) is not None}


def _commands(url: str, run: str, step: int) -> dict[str, str]:
    root = _root_option(url)
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
_EVENT_FIELDS = ("time", "event", "run", "step", "user", "host", "pid")


def _shown(key: str, value: Any) -> str:
    """An event field as a person reads it: sizes in units, floats to 4 significant
    digits, lists and objects as compact JSON (never a Python repr)."""
    import json

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
    runs = [_existing_run(view, run)] if run else view.list_runs()
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
