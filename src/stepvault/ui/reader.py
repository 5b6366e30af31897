"""The dashboard's view of a store: :class:`StoreReader` (the store opened read-only unless
actions are allowed, its cold tiers probed in the background, manifests and events read
incrementally) and the small lookups every page shares (steps from URLs, a run's own
settings, registered versions, tiers)."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from ..catalog.events import read_events
from ..catalog.records import checkpoint_records
from ..catalog.vault import Vault
from ..errors import CheckpointNotFoundError, InvalidNameError, StepvaultError
from ..registry import Registry
from ..store import Store, backend_for, validate_run_name, validate_step
from ..tiers.probe import TierProbe
from ..tiers.view import TieredView
from .readonly import ReadOnlyBackend

_REWRITES = ("thin", "repair", "quarantine", "save", "delete")
#: Events that change what a run page shows of existing checkpoints (marks, tiers).


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


def existing_run(view: Store, run: str) -> str:
    validate_run_name(run)
    if run not in view.list_runs():
        raise CheckpointNotFoundError(f"no run {run!r} in {view.backend.url}")
    return run


def registered_steps(view: Store, run: str) -> dict[int, list[str]]:
    """Step -> ``["llama v2 (stable)", ...]`` for every registered version of ``run``."""
    out: dict[int, list[str]] = {}
    reg = Registry(view)
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


def tiers_of(view: Store, run: str, steps: list[int]) -> dict[int, list[str]]:
    if not isinstance(view, TieredView):
        return {s: ["hot"] for s in steps}
    by_tier = {t: set(held) for t, held in view.steps_by_tier(run).items()}
    return {s: [t for t in view.order if s in by_tier.get(t, ())] for s in steps}


def root_option(url: str) -> str:
    return f"--root {url}" if " " not in url else f"--root '{url}'"
