"""Part 4: warm restore into existing tensors against safetensors (and the cold restore of
:mod:`.cold` after it)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from _common import (
    Gpt2Shape,
    fsync_file,
    gc_baseline,
    gc_extra,
    median,
    minflt,
    remove,
)

import stepvault

from .cold import ColdResults, bench_cold_restore
from .mmap_load import MmapOneResults, bench_mmap_one
from .stages import restore_stages


@dataclass
class RestoreResults:
    times: dict[str, list[float]] = field(default_factory=dict)
    faults: dict[str, list[int]] = field(default_factory=dict)
    reference: list[float] = field(default_factory=list)  # in-memory copy_ of the state
    stages: dict[str, list[float]] = field(default_factory=dict)
    stage_faults: dict[str, list[int]] = field(default_factory=dict)
    orders: list[list[str]] = field(default_factory=list)
    cold: ColdResults | None = None
    mmap_one: MmapOneResults | None = None

    def ratio(self) -> float:
        return median(self.times["stepvault"]) / median(self.times["safetensors"])

    def paired_ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.times["stepvault"], self.times["safetensors"])]


def bench_restore(
    flat: dict[str, torch.Tensor],
    shape: Gpt2Shape,
    workdir: Path,
    repeats: int,
    cold_repeats: int,
    log: Callable[[str], None],
) -> RestoreResults:
    from safetensors.torch import load_file, save_file

    st_path = workdir / "restore.safetensors"
    sv_root = workdir / "restore-store"
    remove(st_path)
    remove(sv_root)
    save_file(flat, str(st_path))
    fsync_file(st_path)
    stepvault.save(sv_root, flat, run="bench", step=1)
    # Destination tensors of the same shapes, touched once so page faults are not timed.
    dest = {k: torch.empty_like(v).fill_(0.0) for k, v in flat.items()}

    def via_safetensors() -> None:
        loaded = load_file(str(st_path))
        with torch.no_grad():
            for k, t in dest.items():
                t.copy_(loaded[k])

    def via_stepvault() -> None:
        stepvault.restore(sv_root, dest, run="bench", step=1)

    peers = {"safetensors": via_safetensors, "stepvault": via_stepvault}
    res = RestoreResults({k: [] for k in peers}, {k: [] for k in peers})
    names = list(peers)
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        res.orders.append(order)
        for name in order:
            if r == 0:
                for t in dest.values():
                    t.zero_()
            base = gc_baseline()
            f0 = minflt()
            t0 = time.perf_counter()
            peers[name]()  # what it allocated or mapped is freed (refcount) before it returns
            # Anything left to the cyclic gc is part of the cost too; the cost of a gc pass
            # over this process's heap alone (~0.1 s, the same for both) is not.
            dt = time.perf_counter() - t0 + gc_extra(base)
            res.times[name].append(dt)
            res.faults[name].append(minflt() - f0)
            log(f"  restore {r + 1}/{repeats} {name:12s} {dt:6.2f} s")
            if r == 0:
                bad = [k for k, v in flat.items() if not torch.equal(dest[k], v)]
                if bad:
                    raise SystemExit(f"{name} restored wrong data for {bad[:3]}")
        # The machine's memory-copy speed swings; a plain copy_ of the in-memory state into
        # the same destination, right after each pair, shows how fast memory was just then.
        t0 = time.perf_counter()
        with torch.no_grad():
            for k, t in dest.items():
                t.copy_(flat[k])
        res.reference.append(time.perf_counter() - t0)
    for _ in range(min(3, repeats)):
        for k, (dt, nf) in restore_stages(sv_root, dest, st_path).items():
            res.stages.setdefault(k, []).append(dt)
            res.stage_faults.setdefault(k, []).append(nf)
    res.mmap_one = bench_mmap_one(flat, st_path, sv_root, max(3, repeats), log)
    dest.clear()  # the cold children need the memory more than this process does
    gc.collect()
    if cold_repeats:
        res.cold = bench_cold_restore(flat, shape, st_path, sv_root, workdir, cold_repeats, log)
    else:
        res.cold = ColdResults(skipped="not run (--cold-repeats 0)")
    remove(st_path)
    remove(sv_root)
    return res
