"""Which cold tiers answer, found out in the background: a reader that serves many requests
(the dashboard) must never wait out a dead tier's connection retries on each of them.

:class:`TierProbe` opens each cold tier on a daemon thread and waits for it at most
``timeout`` seconds; a tier that has not answered by then is *unreachable since* that
moment and is probed again (one probe thread per tier at most) every ``retry_after``
seconds. :meth:`TierProbe.view` is the tier view over the tiers known to answer: a tier
still being probed or unreachable is left out (and named in ``view.unreachable``), so a
request never touches it. A tier that answers is opened once and its store reused.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..store import Backend, Store, backend_for
from .config import Tiers, read_tier_specs
from .view import TieredView

#: Seconds a probe waits for a tier before calling it unreachable.
PROBE_TIMEOUT = 5.0
#: Seconds between two probes of an unreachable tier (and re-checks of a reachable one).
RETRY_AFTER = 60.0


@dataclass
class TierState:
    """What the probe knows of one cold tier."""

    name: str
    url: str
    state: str = "probing"  # "probing" | "reachable" | "unreachable"
    since: float = 0.0  # when it entered that state (time.time())
    error: str = ""
    checked: float = 0.0  # when the last probe finished or gave up (time.time())

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "state": self.state,
            "since": self.since,
            "error": self.error,
        }


class TierProbe:
    """Reachability of the cold tiers of the store at ``root``, probed in the background.

    ``wrap`` is applied to each cold tier's backend before it is opened (the dashboard
    passes its read-only wrapper). Nothing here blocks a caller for longer than reading
    ``tiers.json`` from the hot store.
    """

    def __init__(
        self,
        *,
        timeout: float = PROBE_TIMEOUT,
        retry_after: float = RETRY_AFTER,
        wrap: Callable[[Backend], Backend] | None = None,
    ) -> None:
        self.timeout = timeout
        self.retry_after = retry_after
        self.wrap = wrap
        self._lock = threading.Lock()
        self._states: dict[str, TierState] = {}
        self._stores: dict[str, Store] = {}
        self._running: dict[str, threading.Thread] = {}

    # -- probing ---------------------------------------------------------------------------
    def _open(self, url: str, options: dict[str, Any]) -> Store:
        backend = backend_for(url, **options)
        store = Store.open(self.wrap(backend) if self.wrap is not None else backend)
        store.list_runs()  # one listing: an endpoint that accepts but never answers fails here
        return store

    def _probe(self, name: str, url: str, options: dict[str, Any]) -> None:
        """One probe of tier ``name`` (its own daemon thread, bounded by a watchdog)."""
        outcome: dict[str, Any] = {}

        def attempt() -> None:
            try:
                outcome["store"] = self._open(url, options)
            except Exception as exc:  # any failure to open is "unreachable", with why
                outcome["error"] = f"{type(exc).__name__}: {exc}"
            self._settle(name, url, outcome)

        worker = threading.Thread(target=attempt, name=f"tier-probe-{name}", daemon=True)
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():  # the retries of a dead endpoint: stop waiting, mark it
            self._settle(name, url, {"error": f"no answer within {self.timeout:g} s"}, final=False)
            worker.join()  # the thread ends when the backend's retries do; then re-probe
        with self._lock:
            self._running.pop(name, None)

    def _settle(self, name: str, url: str, outcome: dict[str, Any], final: bool = True) -> None:
        now = time.time()
        with self._lock:
            state = self._states.setdefault(name, TierState(name, url))
            new = "reachable" if "store" in outcome else "unreachable"
            if not final and state.state == "unreachable":
                return  # already marked; keep its first "since"
            if new != state.state:
                state.state, state.since = new, now
            if new == "reachable":
                self._stores[name] = outcome["store"]
                state.error = ""
            else:
                self._stores.pop(name, None)
                # keep the most telling reason: the backend's own error beats the watchdog's
                if final or not state.error:
                    state.error = str(outcome.get("error", ""))
            state.checked = now

    def refresh(self, hot: Store) -> dict[str, TierState]:
        """Start a probe of every cold tier of ``hot`` that needs one (never probed, or
        last checked ``retry_after`` ago, and none running); return the states now."""
        specs = read_tier_specs(hot)
        now = time.time()
        with self._lock:
            names = {s.name for s in specs}
            for gone in [n for n in self._states if n not in names]:
                self._states.pop(gone, None)
                self._stores.pop(gone, None)
            for spec in specs:
                state = self._states.get(spec.name)
                if state is None or state.url != spec.url:
                    state = self._states[spec.name] = TierState(spec.name, spec.url, since=now)
                    self._stores.pop(spec.name, None)
                due = state.checked == 0.0 or now - state.checked >= self.retry_after
                if not due or spec.name in self._running:
                    continue
                thread = threading.Thread(
                    target=self._probe,
                    args=(spec.name, spec.url, dict(spec.options)),
                    name=f"tier-watch-{spec.name}",
                    daemon=True,
                )
                self._running[spec.name] = thread
                thread.start()
            return {n: TierState(**vars(s)) for n, s in self._states.items()}

    def prepare(self, hot: Store) -> None:
        """Import each cold tier's filesystem implementation now, on the caller's thread
        (a server's start): ``s3fs`` and ``botocore`` cost a second or two of CPU, which on
        a probe thread would hold the interpreter while the first pages are served."""
        for spec in read_tier_specs(hot):
            scheme = spec.url.split("://", 1)[0] if "://" in spec.url else ""
            if scheme and scheme != "file":
                with contextlib.suppress(Exception):  # the probe reports what fails
                    import fsspec

                    fsspec.get_filesystem_class(scheme)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the probes running now (tests; a server never waits)."""
        with self._lock:
            running = list(self._running.values())
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in running:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            thread.join(left)

    # -- the view --------------------------------------------------------------------------
    def view(self, hot: Store) -> Store:
        """``hot`` itself (no cold tiers), or the tier view over the tiers known to answer;
        the others are in ``view.unreachable`` ("probing" or why, since when)."""
        states = self.refresh(hot)
        if not states:
            return hot
        tiers = Tiers.of(hot)
        view = TieredView(tiers)
        with self._lock:
            for name, state in states.items():
                store = self._stores.get(name)
                if state.state == "reachable" and store is not None:
                    tiers._stores[name] = store
                    view._usable[name] = store
                elif state.state == "probing":
                    view.unreachable[name] = "probing (not answered yet)"
                else:
                    view.unreachable[name] = state.error or "unreachable"
        return view


__all__ = ["PROBE_TIMEOUT", "RETRY_AFTER", "TierProbe", "TierState"]
