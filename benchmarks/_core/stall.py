"""Part 5: CheckpointManager saves: the training-thread stall of asynchronous saves (first
and later ones) against a synchronous save, staging memory, background write time."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _common import (
    GB,
    build_module,
    median,
    minflt,
    remove,
    rss_bytes,
)

import stepvault

from .base import MALLOC_MMAP_MAX
from .stages import StageTimer


@dataclass
class AsyncResults:
    logical_bytes: int
    sync_times: list[float] = field(default_factory=list)  # wall of mgr.save(), sync
    first: list[float] = field(default_factory=list)  # handle.stall_seconds, 1st save
    later: list[float] = field(default_factory=list)  # handle.stall_seconds, 2nd+ saves
    first_wall: list[float] = field(default_factory=list)  # wall of the save() call
    later_wall: list[float] = field(default_factory=list)
    first_faults: list[int] = field(default_factory=list)
    later_faults: list[int] = field(default_factory=list)
    first_write: list[float] = field(default_factory=list)  # SaveInfo.seconds (background)
    later_write: list[float] = field(default_factory=list)
    later_new: list[int] = field(default_factory=list)
    staging: list[int] = field(default_factory=list)  # stats()["staging_bytes"]
    rss_open: list[int] = field(default_factory=list)  # max RSS growth while a manager is open
    rss_closed: list[int] = field(default_factory=list)  # RSS growth after close()
    first_split: dict[str, list[float]] = field(default_factory=dict)
    later_split: dict[str, list[float]] = field(default_factory=dict)
    orders: list[list[str]] = field(default_factory=list)
    saves_per_manager: int = 0
    reference: list[float] = field(default_factory=list)  # plain copy_ before each later save
    first_reference: list[float] = field(default_factory=list)  # the same, before 1st save
    prepare: list[float] = field(default_factory=list)  # restore() → staging_ready (bg)
    fallback: list[float] = field(default_factory=list)  # 1st save due before buffers ready
    buffers: int = 0  # tensors staged (one host buffer each)
    small_buffers: int = 0  # of them at most glibc's 32 MiB dynamic mmap threshold ceiling
    small_bytes: int = 0

    def ratio(self) -> float:
        return median(self.later) / median(self.sync_times)

    def first_ratio(self) -> float:
        return median(self.first) / median(self.sync_times)


STALL_REST = "everything else in save() before the hand-off"


def bench_async(
    state: dict[str, Any],
    flat: dict[str, torch.Tensor],
    workdir: Path,
    repeats: int,
    saves: int,
    prime: Callable[[], None],
    log: Callable[[str], None],
) -> AsyncResults:
    """Training-thread stall of ``CheckpointManager(async_save=True)`` saves vs a synchronous
    ``CheckpointManager(async_save=False)`` save of the same state (a fresh store each)."""
    from stepvault.engine.staging_area import StagingArea
    from stepvault.manager import checkpoint_manager as cm

    # The same tensors (shared storage): the model as a real nn.Module of nn.Parameters,
    # the optimizer state as a plain optimizer-state-like dict.
    live = {"model": build_module(state["model"]), "optimizer": state["optimizer"]}
    res = AsyncResults(sum(t.nbytes for t in flat.values()), saves_per_manager=saves)
    res.buffers = len(flat)
    small = [t.nbytes for t in flat.values() if t.nbytes <= MALLOC_MMAP_MAX]
    res.small_buffers, res.small_bytes = len(small), sum(small)
    # The steady-state stall is a memory copy; a plain copy_ of the state into a pre-faulted
    # buffer of the same size, right before each later save, shows the memory speed then.
    ref = {k: torch.empty_like(v).fill_(0.0) for k, v in flat.items()}

    def reference_copy() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for k, t in ref.items():
                t.copy_(flat[k])
        return time.perf_counter() - t0

    def change() -> None:
        # Every tensor changes between saves, so every background write is a real one.
        with torch.no_grad():
            for t in flat.values():
                t.add_(1.0)

    def ready() -> None:
        change()
        gc.collect()
        prime()
        os.sync()

    def check_bytes(info: Any) -> None:
        if info.logical_bytes != res.logical_bytes:
            raise SystemExit(
                f"CheckpointManager saved {info.logical_bytes} B, expected {res.logical_bytes}"
            )

    def run_sync(r: int) -> None:
        root = workdir / f"mgr-sync-{r}"
        mgr = stepvault.CheckpointManager(root, "bench", async_save=False)
        try:
            ready()
            t0 = time.perf_counter()
            handle = mgr.save(1, live)
            dt = time.perf_counter() - t0
            check_bytes(handle.result())
        finally:
            mgr.close()
            remove(root)
        res.sync_times.append(dt)
        log(f"  manager {r + 1}/{repeats} sync save            {dt:6.2f} s")

    def run_fallback(r: int) -> None:
        # A save due at once, before the background preparation can have finished: that
        # one save is written synchronously (its stall is the whole save).
        root = workdir / f"mgr-fallback-{r}"
        mgr = stepvault.CheckpointManager(root, "bench", async_save=True)
        try:
            ready()
            t0 = time.perf_counter()
            handle = mgr.save(1, live)
            dt = time.perf_counter() - t0
            check_bytes(handle.result())
        finally:
            mgr.close()
            remove(root)
        res.fallback.append(dt)
        sync = "written synchronously" if not handle.asynchronous else "staged (buffers ready)"
        log(f"  manager {r + 1}/{repeats} first save due at once  {dt:6.2f} s ({sync})")

    def run_async(r: int) -> None:
        root = workdir / f"mgr-async-{r}"
        gc.collect()
        rss0 = rss_bytes()
        mgr = stepvault.CheckpointManager(root, "bench", async_save=True)
        grow = 0
        try:
            # As a training script starts: restore() (a fresh start) sees the state and
            # prepares the staging in the background while training runs its first steps.
            t0 = time.perf_counter()
            assert mgr.restore(live) is None
            while not mgr.stats()["staging_ready"]:
                time.sleep(0.002)
            res.prepare.append(time.perf_counter() - t0)
            for i in range(saves):
                ready()
                (res.reference if i > 0 else res.first_reference).append(reference_copy())
                timer = StageTimer()
                timer.wrap(cm, "take_snapshot", "take_snapshot (state_dict + encode the tree)")
                timer.wrap(cm, "new_manifest", "new_manifest")
                timer.wrap(StagingArea, "stage", "copy into staging buffers")
                f0, t0 = minflt(), time.perf_counter()
                try:
                    handle = mgr.save(i + 1, live)
                finally:
                    wall, nf = time.perf_counter() - t0, minflt() - f0
                    timer.restore_all()
                assert handle is not None and handle.asynchronous, "buffers were not ready"
                stall = handle.stall_seconds
                info = handle.result()
                check_bytes(info)
                grow = max(grow, rss_bytes() - rss0)
                split = {k: v for k, (v, _) in timer.split(stall, nf, STALL_REST).items()}
                if i == 0:
                    res.first.append(stall)
                    res.first_wall.append(wall)
                    res.first_faults.append(nf)
                    res.first_write.append(info.seconds)
                    for k, v in split.items():
                        res.first_split.setdefault(k, []).append(v)
                else:
                    res.later.append(stall)
                    res.later_wall.append(wall)
                    res.later_faults.append(nf)
                    res.later_write.append(info.seconds)
                    res.later_new.append(info.new_bytes)
                    for k, v in split.items():
                        res.later_split.setdefault(k, []).append(v)
                log(
                    f"  manager {r + 1}/{repeats} async save {i + 1}/{saves} stall {stall:6.3f} s"
                    f"  background write {info.seconds:5.2f} s  new {info.new_bytes / GB:.2f} GB"
                )
            res.staging.append(int(mgr.stats()["staging_bytes"]))
        finally:
            mgr.close()
            remove(root)
        gc.collect()
        res.rss_open.append(grow)
        res.rss_closed.append(rss_bytes() - rss0)

    runs = {"sync": run_sync, "async": run_async, "fallback": run_fallback}
    for r in range(repeats):
        order = ["sync", "async", "fallback"] if r % 2 == 0 else ["fallback", "async", "sync"]
        res.orders.append(order)
        for kind in order:
            runs[kind](r)
    ref.clear()
    return res
