"""Slow every object write of the stepvault store down (crash tests aim kills at saves)."""

from __future__ import annotations

import time


def slow_object_writes(seconds: float) -> None:
    """Sleep ``seconds`` before each object write, staged (saves) or direct (repairs)."""
    from stepvault.store import Store

    def slowed(original):
        def slow(self, digest, parts):
            time.sleep(seconds)
            return original(self, digest, parts)

        return slow

    Store.stage_object = slowed(Store.stage_object)
    Store.put_object = slowed(Store.put_object)
