"""Evaluation records attached to a checkpoint after the fact (``stepvault annotate``).

A manifest is immutable (checksummed, possibly signed), so metrics measured later — a
validation loss computed by a separate evaluation job — live next to it, one small file per
annotation, created exclusively (never overwritten)::

    runs/<run>/annotations/<step>.<n>.json
    {"run", "step", "manifest_blake3", "metrics": {...}, "note", "time", "user", "host"
     [, "signature"]}

``manifest_blake3`` binds the annotation to the exact manifest it was made for: if the step
is later deleted and saved again, old annotations no longer apply. Later annotations win
over earlier ones and over the metrics recorded at save time.
"""

from __future__ import annotations

import getpass
import json
import math
import os
import re
import socket
import time
from collections.abc import Mapping
from typing import Any

from blake3 import blake3

from ..errors import StepvaultError
from ..store.names import validate_run_name, validate_step
from ..store.repository import Store
from ..store.signing import Signer
from .numbered import put_numbered

_FILE = re.compile(r"^(0|[1-9][0-9]{0,17})\.([1-9][0-9]{0,8})\.json$")


def manifest_id(data: bytes) -> str:
    """The identity of one committed checkpoint: BLAKE3 of its manifest file."""
    return blake3(data).hexdigest()


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return str(os.getuid()) if hasattr(os, "getuid") else "?"


def check_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Finite numbers keyed by non-empty names, or a clear error."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise StepvaultError(f"metric names must be non-empty strings, got {name!r}")
        if isinstance(value, bool):  # JSON true/false: not a measurement
            raise StepvaultError(f"metric {name!r} must be a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            shown = repr(value) if len(repr(value)) < 40 else repr(value)[:37] + "..."
            raise StepvaultError(f"metric {name!r} must be a finite number, got {shown}") from None
        if not math.isfinite(number):
            raise StepvaultError(f"metric {name!r} must be finite, got {value!r}")
        out[name] = number
    return out


def write_annotation(
    store: Store,
    run: str,
    step: int,
    metrics: dict[str, Any],
    *,
    note: str = "",
    signer: Signer | None = None,
) -> dict[str, Any]:
    """Attach ``metrics`` to the committed checkpoint ``run@step``; return the record."""
    prefix = f"runs/{validate_run_name(run)}/annotations"
    validate_step(step)
    record: dict[str, Any] = {
        "run": run,
        "step": step,
        "manifest_blake3": manifest_id(store.read_manifest(run, step)),
        "metrics": check_metrics(metrics),
        "note": note,
        "time": time.time(),
        "user": _user(),
        "host": socket.gethostname(),
    }
    signer = signer if signer is not None else store.signer
    if signer is not None:
        record = signer.sign_record(record)
    data = json.dumps(record, sort_keys=True).encode()

    def next_number() -> int:
        return max((n for s, n in _listing(store, run) if s == step), default=0) + 1

    if put_numbered(store, prefix, step, data, next_number) is None:
        raise StepvaultError(f"could not annotate {run}@{step}: too many concurrent annotations")
    return record


def _listing(store: Store, run: str) -> list[tuple[int, int]]:
    names = store.backend.list(f"runs/{validate_run_name(run)}/annotations")
    return sorted((int(m.group(1)), int(m.group(2))) for n in names if (m := _FILE.match(n)))


def read_annotations(store: Store, run: str) -> dict[int, list[dict[str, Any]]]:
    """Every readable annotation of ``run`` by step, oldest first (damaged files skipped)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for step, n in _listing(store, run):
        try:
            record = json.loads(store.backend.read_bytes(f"runs/{run}/annotations/{step}.{n}.json"))
        except (FileNotFoundError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("metrics"), dict):
            record["_key"] = f"runs/{run}/annotations/{step}.{n}.json"
            out.setdefault(step, []).append(record)
    return out


def merged_metrics(
    saved: dict[str, float], annotations: list[dict[str, Any]], manifest_blake3: str
) -> dict[str, float]:
    """Metrics at save time, overridden by the annotations made for this exact manifest."""
    out = dict(saved)
    for record in annotations:
        if record.get("manifest_blake3") != manifest_blake3:
            continue
        for name, value in record["metrics"].items():
            if isinstance(value, int | float) and math.isfinite(value):
                out[name] = float(value)
    return out


def annotate(
    root: str | os.PathLike[str] | Store,
    run: str,
    step: int,
    metrics: Mapping[str, Any],
    *,
    note: str = "",
    signer: Signer | None = None,
) -> dict[str, Any]:
    """Attach evaluation ``metrics`` to checkpoint ``run@step`` after the fact.

    The record is bound to that exact manifest; keep policies (``KeepBest``) and
    ``restore(step="best")`` use the newest annotated value of each metric. Returns the
    stored record (time, user, host, metrics).
    """
    from .events import log_event

    store = root if isinstance(root, Store) else Store.open(root)
    record = write_annotation(store, run, step, dict(metrics), note=note, signer=signer)
    log_event(store, run, "annotate", step=step, metrics=record["metrics"], note=note)
    return record
