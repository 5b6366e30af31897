"""How a CheckpointManager gets its tiers: record them in the hot store, build the read view
(restore from any tier, hot first) and, with a tier policy, the background mover."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..engine.gc import DEFAULT_GRACE_SECONDS
from ..policy import TierPolicy
from ..store import Backend, Store
from .config import Tiers, add_tier, read_tier_specs, spec_for
from .mem import MEM
from .mover import TierMover
from .view import TieredView


def setup_tiers(
    hot: Store,
    run: str,
    tiers: Mapping[str, Any] | None,
    policy: TierPolicy | None,
    *,
    coordinator: bool = True,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    mem: Store | None = None,
) -> tuple[Store, TierMover | None]:
    """``(read view, mover or None)`` for a manager writing ``run`` to ``hot``.

    ``tiers`` maps cold tier names to a URL/path, a :class:`TierSpec`, or an open Store or
    Backend (used as given in this process; its URL is what gets recorded).
    """
    if policy is not None and not isinstance(policy, TierPolicy):
        raise TypeError(f"tier_policy must be a TierPolicy (HotLast(3) | ...), got {policy!r}")
    stores: dict[str, Store] = {}
    if tiers:
        known = {s.name: s for s in read_tier_specs(hot)}
        for name, target in tiers.items():
            spec = spec_for(name, target)
            if isinstance(target, Store):
                stores[name] = target
            elif isinstance(target, Backend):
                stores[name] = Store.open(target, create=True, defaults=dict(hot.settings))
            if coordinator and known.get(name) != spec:
                add_tier(hot, spec)
    specs = read_tier_specs(hot)
    for name, target in (tiers or {}).items():
        if not any(s.name == name for s in specs):  # another rank records it
            specs.append(spec_for(name, target))
    opened = Tiers(hot, specs, stores)
    view: Store = TieredView(opened) if opened.cold_names else hot
    if mem is not None:  # the mem tier's store (.mem): read first, before hot
        opened._stores[MEM] = mem
        view = TieredView(opened, [MEM, *opened.names])
    mover = None
    if policy is not None and coordinator:
        mover = TierMover(opened, run, policy, grace_seconds=grace_seconds)
    return view, mover
