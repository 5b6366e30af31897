"""The dashboard's templates and their filters: times with their zone, sizes, durations,
nested records as rows, and the static files' version in their URLs."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

from blake3 import blake3
from markupsafe import Markup
from starlette.templating import Jinja2Templates

from .._units import human_bytes

HERE = Path(__file__).resolve().parent


def _when(ts: Any) -> Markup:
    """A POSIX time as local ``YYYY-MM-DD HH:MM:SS ZONE`` (the page's script rewrites it in
    the browser's own zone, as the header clock shows it)."""
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not ts:
        return Markup("")
    text = _dt.datetime.fromtimestamp(ts).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    return Markup('<time data-ts="{}">{}</time>').format(float(ts), text)


def _signed_bytes(n: Any) -> str:
    return "" if n is None else ("-" + human_bytes(-n) if n < 0 else human_bytes(n))


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, int | float) or seconds < 0:
        return ""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Nested dicts as ``(dotted key, value)`` rows: lineage and environment as tables."""
    if isinstance(value, dict):
        rows: list[tuple[str, str]] = []
        for k in sorted(value, key=str):
            rows += _flatten(value[k], f"{prefix}.{k}" if prefix else str(k))
        return rows
    if isinstance(value, list) and all(not isinstance(v, dict | list) for v in value):
        return [(prefix, ", ".join(map(str, value)))]
    if isinstance(value, list):
        return [r for i, v in enumerate(value) for r in _flatten(v, f"{prefix}[{i}]")]
    return [(prefix, "" if value is None else str(value))]


def _static_version() -> str:
    """A digest of the static files: their URLs carry it, so they are cached for good and
    an upgrade still loads the new ones."""
    h = blake3()
    for path in sorted((HERE / "static").rglob("*")):
        if path.is_file():
            h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:12]


def templates() -> Jinja2Templates:
    """The page templates with the dashboard's filters and globals."""
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    env = templates.env
    env.filters["bytes"] = human_bytes
    env.filters["sbytes"] = _signed_bytes
    env.filters["when"] = _when
    env.filters["duration"] = _duration
    env.filters["rows"] = _flatten
    env.filters["num"] = lambda v: "" if v is None else (f"{v:.6g}" if isinstance(v, float) else v)
    env.globals["json"] = lambda v: json.dumps(v, sort_keys=True, default=str)
    env.globals["static_version"] = _static_version()
    return templates
