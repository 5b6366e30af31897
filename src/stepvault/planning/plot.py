"""The plan as a figure: goodput against the interval, and bytes per tier over the run.

Needs matplotlib (``pip install 'stepvault[plot]'``); drawn with the Agg backend, so it
works without a display.
"""

from __future__ import annotations

import os
from typing import Any

from .units import PlanError

__all__ = ["plot_plan"]


def plot_plan(plan: Any, path: str | os.PathLike[str]) -> None:
    """Write ``plan`` (a :class:`~stepvault.planning.Plan`) to ``path`` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed, and no GUI toolkit imported
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlanError("--plot needs matplotlib: pip install 'stepvault[plot]'") from None
    doc = plan.to_json()
    storage = doc["storage"]
    fig, axes = plt.subplots(1, 2 if storage else 1, figsize=(12 if storage else 6.5, 4.5))
    ax = axes[0] if storage else axes
    hours = [p["interval_seconds"] / 3600 for p in doc["curve"]]
    ax.plot(hours, [p["ettr"] for p in doc["curve"]], color="tab:blue", label="ETTR (Daly's T_w)")
    marks = [("optimum (Daly)", doc["goodput"]["optimum"], "tab:green", "o")]
    if doc["goodput"]["current"] is not None:
        marks.append(("current policy", doc["goodput"]["current"], "tab:red", "s"))
    for label, g, color, marker in marks:
        if g["interval_seconds"] is None:
            continue
        x = g["interval_seconds"] / 3600
        ax.plot([x], [g["ettr"]], marker, color=color, label=f"{label}: {g['ettr']:.4f}")
        sim = g.get("simulated")
        if sim is not None:
            ax.errorbar(
                [x], [sim["ettr"]], yerr=[2 * sim["ettr_se"]], fmt="x", color="black", capsize=3
            )
    ax.axvline(doc["interval"]["young_seconds"] / 3600, color="grey", ls=":", label="Young")
    ax.set_xscale("log")
    ax.set_xlabel("compute between saves (hours)")
    ax.set_ylabel("expected useful fraction of time (ETTR)")
    ax.set_title("goodput vs checkpoint interval (x: simulated, ±2 SE)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    if storage:
        ax2 = axes[1]
        times = [p["hours"] for p in storage["timeline"]]
        for tier in storage["tiers"]:
            ax2.step(
                times,
                [p["bytes"].get(tier, 0) / 1e9 for p in storage["timeline"]],
                where="post",
                label=tier,
            )
        ax2.set_xlabel("hours since the start (failure-free)")
        ax2.set_ylabel("GB held")
        ax2.set_title(f"bytes per tier ({doc['inputs'].get('keep_policy', {}).get('value')})")
        ax2.legend(fontsize=8)
        ax2.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=110)
    plt.close(fig)
