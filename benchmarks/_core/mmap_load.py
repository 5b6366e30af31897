"""Part 4b: ``load(mmap=True)``-style reads of one tensor out of a whole checkpoint against
``safetensors.safe_open(...).get_tensor`` (an inference or export job reading a few
weights): open the store/file, read one tensor (verified, for stepvault), touch it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from _common import median

import stepvault

#: The tensor read: the largest one that is a single object (<= one 32 MiB chunk).
ONE_CHUNK = 32 << 20


@dataclass
class MmapOneResults:
    name: str = ""
    nbytes: int = 0
    total_bytes: int = 0
    times: dict[str, list[float]] = field(
        default_factory=lambda: {"stepvault": [], "safetensors": []}
    )

    def ratio(self) -> float:
        return median(self.times["stepvault"]) / median(self.times["safetensors"])


def bench_mmap_one(
    flat: dict[str, torch.Tensor],
    st_path: Path,
    sv_root: Path,
    repeats: int,
    log: Callable[[str], None],
) -> MmapOneResults:
    """Median time to open + read + touch one tensor, both files warm in the page cache."""
    from safetensors import safe_open

    fits = [k for k, v in flat.items() if v.nbytes <= ONE_CHUNK]
    name = max(fits or list(flat), key=lambda k: flat[k].nbytes)
    res = MmapOneResults(name, flat[name].nbytes, sum(v.nbytes for v in flat.values()))
    expected = flat[name]

    def via_stepvault() -> torch.Tensor:
        return stepvault.open(sv_root).checkpoint("bench", 1).tensor(name, mmap=True)

    def via_safetensors() -> torch.Tensor:
        with safe_open(str(st_path), framework="pt") as f:
            return f.get_tensor(name)

    peers = {"stepvault": via_stepvault, "safetensors": via_safetensors}
    for r in range(repeats + 1):  # the first round is a warm-up, checked, not timed
        for label, fn in peers.items() if r % 2 else reversed(peers.items()):
            t0 = time.perf_counter()
            t = fn()
            float(t.view(-1)[:: max(1, 4096 // t.element_size())].sum())  # touch every page
            dt = time.perf_counter() - t0
            if r == 0:
                if not torch.equal(t, expected):
                    raise SystemExit(f"{label} read {name} wrong")
                continue
            res.times[label].append(dt)
            log(f"  one tensor {r}/{repeats} {label:12s} {dt * 1e3:7.2f} ms")
    return res
