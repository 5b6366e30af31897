"""The dashboard's few actions (only with ``stepvault ui --allow-actions``).

Each one does exactly what its CLI command does, through the same functions, and is
written to the run's event log the same way: ``pin``/``unpin`` (``stepvault pin``),
``annotate``, ``promote``/``rollback`` (the registry logs its own moves) and a
``gc --dry-run`` preview (deletes nothing). The page asks for confirmation first; the server
additionally requires the ``X-Stepvault-Action`` header, which a cross-site form or image
cannot send, so another web page cannot trigger an action in the user's browser.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..catalog.annotations import write_annotation
from ..catalog.events import log_event, read_events
from ..errors import InvalidNameError
from ..registry import Registry
from ..store import Store, validate_run_name
from .reader import parse_step, run_settings
from .retention_page import keep_policy_from

ACTION_HEADER = "x-stepvault-action"


def _ref(body: dict[str, Any]) -> tuple[str, int]:
    run = validate_run_name(str(body.get("run", "")))
    return run, parse_step(str(body.get("step", "")))


def _text(body: dict[str, Any], key: str, limit: int = 500) -> str:
    value = body.get(key, "")
    if not isinstance(value, str) or len(value) > limit:
        raise InvalidNameError(f"{key} must be a string of at most {limit} characters")
    return value


def pin(store: Store, body: dict[str, Any]) -> dict[str, Any]:
    run, step = _ref(body)
    store.read_manifest(run, step)  # only committed checkpoints can be pinned
    note = _text(body, "note")
    store.pin(run, step, note)
    log_event(store, run, "pin", step=step, note=note, by="ui")
    return {"pinned": f"{run}@{step}"}


def unpin(store: Store, body: dict[str, Any]) -> dict[str, Any]:
    run, step = _ref(body)
    if step not in store.pinned_steps(run):  # as the CLI: nothing to unpin is an error
        from ..catalog.retention import not_pinned_reason

        raise InvalidNameError(not_pinned_reason(store, run, step))
    store.unpin(run, step)
    log_event(store, run, "unpin", step=step, by="ui")
    return {"unpinned": f"{run}@{step}"}


def annotate(store: Store, body: dict[str, Any]) -> dict[str, Any]:
    run, step = _ref(body)
    metrics = body.get("metrics")
    if not isinstance(metrics, dict) or not metrics:
        raise InvalidNameError('annotate needs metrics, e.g. {"val_loss": 2.31}')
    note = _text(body, "note")
    record = write_annotation(store, run, step, metrics, note=note)
    log_event(store, run, "annotate", step=step, metrics=record["metrics"], note=note, by="ui")
    return {"annotated": f"{run}@{step}", "metrics": record["metrics"]}


def promote(store: Store, body: dict[str, Any]) -> dict[str, Any]:
    model, alias = _text(body, "model", 128), _text(body, "alias", 64)
    target = _text(body, "target", 200)  # RUN@STEP or vN
    move = Registry(store).promote(model, target, alias=alias, note=_text(body, "note"))
    return {"promoted": move.to_json()}


def rollback(store: Store, body: dict[str, Any]) -> dict[str, Any]:
    model, alias = _text(body, "model", 128), _text(body, "alias", 64)
    move = Registry(store).rollback(model, alias, note=_text(body, "note"))
    return {"rolled_back": move.to_json()}


def gc_preview(store: Store, body: dict[str, Any]) -> dict[str, Any]:
    from ..ops import collect_garbage

    run = validate_run_name(str(body.get("run", "")))
    params = {k: str(v) for k, v in body.items() if k != "run"}
    keep = keep_policy_from(params)
    if keep is None:  # no rules typed: the run's own keep policy, as the preview shows
        configured = run_settings(read_events(store, run))["keep"]
        if configured:
            from ..planning.policies import parse_policy

            keep = parse_policy(configured, "--keep")
    result = collect_garbage(store, run=run, keep=keep, dry_run=True)
    return result.to_json()


ACTIONS: dict[str, Callable[[Store, dict[str, Any]], dict[str, Any]]] = {
    "pin": pin,
    "unpin": unpin,
    "annotate": annotate,
    "promote": promote,
    "rollback": rollback,
    "gc-preview": gc_preview,
}
