"""Parts 2 and 3: durable save throughput against safetensors, torch.save and the disk
limit, and a second unchanged save (dedup)."""

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
    fsync_dir,
    fsync_file,
    make_prime,
    median,
    remove,
    sequential_writer,
)

import stepvault


@dataclass
class SaveResults:
    logical_bytes: int
    times: dict[str, list[float]] = field(default_factory=dict)
    stored: dict[str, list[int]] = field(default_factory=dict)
    second_times: list[float] = field(default_factory=list)
    first_new: list[int] = field(default_factory=list)
    second_new: list[int] = field(default_factory=list)
    orders: list[list[str]] = field(default_factory=list)

    def gbps(self, name: str) -> float:
        return self.logical_bytes / GB / median(self.times[name])


SAVE_LABELS = {
    "disk": "sequential write, streamed writeback + fsync (disk limit)",
    "safetensors": "safetensors.save_file + fsync",
    "torch.save": "torch.save + fsync",
    "stepvault-raw": "stepvault.save codec=raw (default)",
    "stepvault-auto": "stepvault.save codec=auto",
}


def bench_save(
    state: dict[str, Any],
    flat: dict[str, torch.Tensor],
    workdir: Path,
    repeats: int,
    log: Callable[[str], None],
) -> SaveResults:
    from safetensors.torch import save_file

    logical = sum(t.nbytes for t in flat.values())
    res = SaveResults(logical)
    write_bytes = sequential_writer(flat)
    prime = make_prime(flat, workdir)

    def disk(path: Path) -> int:
        return write_bytes(path)

    def safetensors(path: Path) -> int:
        save_file(flat, str(path))
        fsync_file(path)
        return path.stat().st_size

    def torch_save(path: Path) -> int:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(path.parent)
        return path.stat().st_size

    def sv(codec: str | None) -> Callable[[Path], int]:
        def run(path: Path) -> int:
            info = stepvault.save(path, state, run="bench", step=1, codec=codec)
            if codec is None:
                res.first_new.append(info.new_bytes)
            return info.stored_bytes

        return run

    writers: dict[str, Callable[[Path], int]] = {
        "disk": disk,
        "safetensors": safetensors,
        "torch.save": torch_save,
        "stepvault-raw": sv(None),
        "stepvault-auto": sv("auto"),
    }
    names = list(writers)
    for name in names:
        res.times[name] = []
        res.stored[name] = []
    prime()  # the first large write of a process pays most; absorb it untimed
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        res.orders.append(order)
        for name in order:
            path = workdir / f"save-{name}-{r}"
            remove(path)
            gc.collect()
            prime()
            os.sync()
            t0 = time.perf_counter()
            stored = writers[name](path)
            dt = time.perf_counter() - t0
            res.times[name].append(dt)
            res.stored[name].append(stored)
            log(f"  save {r + 1}/{repeats} {name:15s} {dt:6.2f} s  {logical / GB / dt:5.2f} GB/s")
            if name == "stepvault-raw":
                prime()
                os.sync()
                t0 = time.perf_counter()
                info = stepvault.save(path, state, run="bench", step=2)
                dt2 = time.perf_counter() - t0
                res.second_times.append(dt2)
                res.second_new.append(info.new_bytes)
                log(f"  save {r + 1}/{repeats} second save {dt2:10.2f} s  new {info.new_bytes} B")
            remove(path)
    return res
