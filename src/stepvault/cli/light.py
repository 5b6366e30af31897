"""How ``stepvault show`` and ``ls`` present light checkpoints: the base they need and the
error they carry (measured at save time against the exact values)."""

from __future__ import annotations

from typing import Any

from .common import console


def light_mark(record: Any) -> str:
    """The ``ls`` mark of a light checkpoint (``"light@<base> "``), empty for other kinds."""
    if getattr(record, "kind", None) != "light":
        return ""
    return f"light@{record.base_step} "


def print_light(light: dict[str, Any] | None) -> None:
    """``show``'s lines for a light checkpoint: base, encodings and per-tensor errors."""
    if not light:
        return
    entries = light.get("tensors", {})
    worst = max((e["error"]["max_rel"] for e in entries.values() if "error" in e), default=0.0)
    console.print(
        f"light: delta against {light['base_step']} (lossy; restore it with an explicit "
        f"step or resume_from_light=True)  tensors: {len(entries)}  worst max_rel: {worst:.3g}",
        highlight=False,
    )
    for name, e in entries.items():
        err = e.get("error", {})
        how = f"int{e['bits']}/{e['block']}" if e["encoding"] == "delta" else "from base"
        console.print(
            f"  {name}  {how}  max_abs={err.get('max_abs', 0):.3g} "
            f"mean_abs={err.get('mean_abs', 0):.3g} max_rel={err.get('max_rel', 0):.3g} "
            f"mean_rel={err.get('mean_rel', 0):.3g}",
            highlight=False,
        )
    for name, why in light.get("exact", {}).items():
        console.print(f"  {name}  exact ({why})", highlight=False)
