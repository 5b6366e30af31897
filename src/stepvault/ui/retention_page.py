"""The retention preview: what ``stepvault gc RUN ... --dry-run`` would keep and delete
now, with the typed rules or the run's own keep policy, and which rule keeps each survivor."""

from __future__ import annotations

import difflib
import time
from collections.abc import Mapping
from typing import Any

from ..catalog.vault import Vault
from ..errors import InvalidNameError
from .reader import StoreReader, existing_run, run_settings

PREVIEW_ENTRIES = 60
#: Events after which a step's manifest is not the one read before.


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
    existing_run(view, run)
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
