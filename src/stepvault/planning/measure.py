"""What a run has measured: save cost, write time, restore time, step time, sizes.

Read from the run's event log (``save`` events carry stall and write seconds and bytes,
``restore`` events their duration; see ``stepvault events``) and, for sizes when the log has
none, from the checkpoint listing (``stepvault ls``). Medians, so one slow save (the first,
which allocates its staging buffers) does not set the plan.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field
from typing import Any

from ..catalog.events import read_events
from ..store import Store
from .units import PlanError

__all__ = ["Measured", "measure_run"]


@dataclass
class Measured:
    """Medians of a run's saves and restores (None: not measured)."""

    run: str
    saves: int = 0
    #: what training waits for per save: the stall of async saves, stall + write of sync ones
    save_cost: float | None = None
    #: seconds from the start of a save until it is committed (stall + write)
    commit_delay: float | None = None
    asynchronous: bool = False
    restores: int = 0
    restore_seconds: float | None = None
    step_time: float | None = None
    #: median steps between consecutive saves
    save_every_steps: int | None = None
    last_step: int | None = None
    #: kind -> (stored bytes per checkpoint, new bytes per checkpoint)
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "saves": self.saves,
            "save_cost_seconds": self.save_cost,
            "commit_delay_seconds": self.commit_delay,
            "asynchronous": self.asynchronous,
            "restores": self.restores,
            "restore_seconds": self.restore_seconds,
            "step_time_seconds": self.step_time,
            "save_every_steps": self.save_every_steps,
            "last_step": self.last_step,
            "sizes": {k: {"stored_bytes": s, "new_bytes": n} for k, (s, n) in self.sizes.items()},
            "notes": list(self.notes),
        }


def _num(event: dict[str, Any], key: str) -> float | None:
    value = event.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _steady(values: list[float]) -> list[float]:
    # The first save of a process allocates and faults in its staging buffers (DESIGN.md):
    # with three or more saves, leave it out.
    return values[1:] if len(values) >= 3 else values


def _sizes_from_listing(store: Store, run: str) -> dict[str, tuple[int, int]]:
    from ..catalog.vault import Vault
    from ..tiers.view import read_view

    by_kind: dict[str, list[tuple[int, int]]] = {}
    for s in Vault(read_view(store)).checkpoints(run):
        if s.error is None:
            by_kind.setdefault(s.kind, []).append((s.stored_bytes, s.new_bytes))
    return _median_sizes(by_kind)


def _median_sizes(by_kind: dict[str, list[tuple[int, int]]]) -> dict[str, tuple[int, int]]:
    out = {}
    for kind, pairs in by_kind.items():
        stored = int(statistics.median(p[0] for p in pairs))
        # The first save of a run writes everything; later ones only what changed.
        new_values = [p[1] for p in pairs[1:]] or [p[1] for p in pairs]
        out[kind] = (stored, min(stored, int(statistics.median(new_values))))
    return out


def measure_run(store: Store, run: str) -> Measured:
    """The costs ``run`` measured, from its event log and checkpoint listing.

    Raises :class:`PlanError` when the run has neither events nor checkpoints (a typo in the
    run name, most likely); a run without save events gives ``save_cost=None`` and the plan
    asks for ``--save-cost``.
    """
    events = read_events(store, run)
    steps_listed = store.list_steps(run)
    if not events and not steps_listed:
        runs = ", ".join(store.list_runs()) or "none"
        raise PlanError(
            f"run {run!r} has no events and no checkpoints in {store.backend.url} (runs: {runs})"
        )
    m = Measured(run)
    saves = [e for e in events if e.get("event") == "save" and isinstance(e.get("step"), int)]
    m.saves = len(saves)
    costs: list[float] = []
    delays: list[float] = []
    by_kind: dict[str, list[tuple[int, int]]] = {}
    for e in saves:
        stall, write = _num(e, "stall_seconds"), _num(e, "write_seconds")
        if stall is None or write is None:
            continue
        costs.append(stall if e.get("asynchronous") else stall + write)
        delays.append(stall + write)
        stored, new = _num(e, "stored_bytes"), _num(e, "new_bytes")
        if stored is not None and new is not None:
            by_kind.setdefault(str(e.get("kind", "full")), []).append((int(stored), int(new)))
    if costs:
        m.save_cost = statistics.median(_steady(costs))
        m.commit_delay = statistics.median(_steady(delays))
        m.asynchronous = sum(bool(e.get("asynchronous")) for e in saves) * 2 > len(saves)
    m.sizes = _median_sizes(by_kind) if by_kind else _sizes_from_listing(store, run)
    restores = [
        e
        for e in events
        if e.get("event") == "restore" and isinstance(e.get("step"), int) and _num(e, "seconds")
    ]
    m.restores = len(restores)
    if restores:
        m.restore_seconds = statistics.median(_num(e, "seconds") or 0.0 for e in restores)
    steps = sorted({e["step"] for e in saves} | set(steps_listed))
    m.last_step = steps[-1] if steps else None
    _step_time(m, saves)
    return m


def _step_time(m: Measured, saves: list[dict[str, Any]]) -> None:
    """Steps between saves and seconds per step from consecutive save events of one process:
    in steady state the time between two commits is (steps between them) x (step time) plus
    one save cost."""
    gaps, per_step = [], []
    for a, b in itertools.pairwise(saves):
        ds = b["step"] - a["step"]
        ta, tb = _num(a, "time"), _num(b, "time")
        if ds <= 0 or ta is None or tb is None or a.get("pid") != b.get("pid"):
            continue  # a resume in between: the clock gap is a restart, not training
        gaps.append(ds)
        per_step.append(max(0.0, (tb - ta - (m.save_cost or 0.0)) / ds))
    if gaps:
        m.save_every_steps = int(statistics.median(gaps))
        m.step_time = statistics.median(per_step) or None
