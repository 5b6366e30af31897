#!/usr/bin/env python
"""Peers benchmark: save and restore of one GPT-2-small state, stepvault against what users
would pick instead, all on the same machine in one run.

One command rewrites the section between ``<!-- peers:begin -->`` and ``<!-- peers:end -->``
of BENCHMARKS.md (the rest is kept)::

    python benchmarks/bench_peers.py [--size-mb N] [--repeats R] [--out BENCHMARKS.md]

1. Save (durable: fsync of files and directories inside the time) of the same flat
   ``{name: tensor}`` state by a plain sequential write (the disk limit), ``torch.save``,
   ``safetensors.save_file``, DCP ``save`` and ``async_save`` with ``FileSystemWriter``,
   ``stepvault.save`` and an asynchronous ``CheckpointManager``: durable throughput, the
   training thread's stall and the peak extra resident memory. Order rotates per repeat;
   an untimed priming write and ``os.sync()`` before each timed save; medians.
2. Restore into existing tensors (warm page cache) by the same peers, and one tensor read
   lazily from a freshly opened checkpoint.

(One benchmark, one file: its sections share the same state and the same report.)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when loaded by path
import _common
from _common import (
    GB,
    REPO,
    PeakRss,
    Row,
    build_state,
    dir_bytes,
    facts_line,
    fmt_bytes,
    fsync_dir,
    fsync_file,
    gc_baseline,
    gc_extra,
    machine_facts,
    make_prime,
    median,
    remove,
    secs,
    section_head,
    sequential_writer,
    shape_for,
    table,
    verdict,
)

import stepvault

SECTION = "peers"
DISK_TARGET = 0.8  # stepvault durable save / raw sequential write
SAFETENSORS_TARGET = 1.0
TORCH_SAVE_TARGET = 3.0
DCP_TARGET = 1.5
STALL_TARGET = 0.1  # async stall / synchronous save
RESTORE_TARGET = 1.0  # stepvault restore time / safetensors load time
LAZY_NAME = "model.h.0.mlp.c_fc.weight"

SAVE_LABELS = {
    "disk": "sequential write, streamed writeback + fsync (disk limit)",
    "torch.save": "torch.save + fsync",
    "safetensors": "safetensors.save_file + fsync",
    "dcp": "DCP save, FileSystemWriter",
    "dcp-async": "DCP async_save, FileSystemWriter",
    "stepvault": "stepvault.save",
    "stepvault-async": "stepvault CheckpointManager(async_save=True)",
}
RESTORE_LABELS = {
    "torch.load": "torch.load(mmap=True, weights_only=True) + copy_",
    "safetensors": "safetensors load_file + copy_",
    "dcp": "DCP load, FileSystemReader (in place)",
    "stepvault": "stepvault.restore (in place, verifies every byte)",
}
LAZY_LABELS = {
    "torch.load": "torch.load(mmap=True, weights_only=True)[name].clone()",
    "safetensors": "safe_open(...).get_tensor(name)",
    "dcp": "DCP load of a 1-entry state dict",
    "stepvault": "stepvault.open(root).checkpoint(run, step).tensor(name)",
}


@dataclass
class SaveRun:
    seconds: float  # until durable
    stall: float  # the calling thread's time (== seconds for synchronous writers)
    peak_extra: int  # bytes of resident memory above the level at the start
    stored: int


@dataclass
class Results:
    logical: int
    n_tensors: int
    saves: dict[str, list[SaveRun]] = field(default_factory=dict)
    save_orders: list[list[str]] = field(default_factory=list)
    restores: dict[str, list[float]] = field(default_factory=dict)
    restore_orders: list[list[str]] = field(default_factory=list)
    lazy: dict[str, list[float]] = field(default_factory=dict)
    lazy_bytes: int = 0
    verify: list[float] = field(default_factory=list)  # stepvault: map + verify every object
    hash_only: list[float] = field(default_factory=list)  # BLAKE3 of the bytes in memory
    copy_ref: list[float] = field(default_factory=list)  # plain copy_ of the state
    staging_held: int = 0  # stepvault manager: staging buffers kept between saves
    # Bare memory copy of the state (numpy, into a reused pre-faulted buffer), timed right
    # before each async save's priming: the memory speed the stall is up against.
    stall_floor: list[float] = field(default_factory=list)

    def save_s(self, peer: str) -> float:
        return median([r.seconds for r in self.saves[peer]])

    def gbps(self, peer: str) -> float:
        return self.logical / GB / self.save_s(peer)

    def stall(self, peer: str) -> float:
        return median([r.stall for r in self.saves[peer]])

    def peak(self, peer: str) -> float:
        return median([float(r.peak_extra) for r in self.saves[peer]])

    def restore_s(self, peer: str) -> float:
        return median(self.restores[peer])

    def to_json(self) -> dict[str, Any]:
        return {
            "logical_bytes": self.logical,
            "save": {
                p: {
                    "seconds": self.save_s(p),
                    "gbps": self.gbps(p),
                    "stall": self.stall(p),
                    "peak_extra": self.peak(p),
                }
                for p in self.saves
            },
            "restore": {p: self.restore_s(p) for p in self.restores},
            "lazy": {p: median(v) for p, v in self.lazy.items()},
            "lazy_bytes": self.lazy_bytes,
        }


# -- save -----------------------------------------------------------------------------------
def save_peers(
    flat: dict[str, torch.Tensor], work: Path
) -> dict[str, Callable[[Path], tuple[float, int]]]:
    """Each peer writes ``flat`` durably to a path: returns (stall seconds or -1, stored)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemWriter

    write_bytes = sequential_writer(flat)

    def disk(path: Path) -> tuple[float, int]:
        return -1.0, write_bytes(path)

    def torch_save(path: Path) -> tuple[float, int]:
        with open(path, "wb") as f:
            torch.save(flat, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(path.parent)
        return -1.0, path.stat().st_size

    def safetensors(path: Path) -> tuple[float, int]:
        save_file(flat, str(path))
        fsync_file(path)
        return -1.0, path.stat().st_size

    def dcp_sync(path: Path) -> tuple[float, int]:
        # FileSystemWriter fsyncs its files (sync_files=True, its default); the directory
        # entries are fsynced here too, as every other writer's are.
        dcp.save(flat, storage_writer=FileSystemWriter(str(path)))
        fsync_dir(path)
        fsync_dir(path.parent)
        return -1.0, dir_bytes(path)

    def dcp_async(path: Path) -> tuple[float, int]:
        t0 = time.perf_counter()
        fut = dcp.async_save(flat, storage_writer=FileSystemWriter(str(path)))
        stall = time.perf_counter() - t0
        fut.result()
        fsync_dir(path)
        fsync_dir(path.parent)
        return stall, dir_bytes(path)

    def sv_sync(path: Path) -> tuple[float, int]:
        info = stepvault.save(path, flat, run="bench", step=1)
        return -1.0, info.stored_bytes

    return {
        "disk": disk,
        "torch.save": torch_save,
        "safetensors": safetensors,
        "dcp": dcp_sync,
        "dcp-async": dcp_async,
        "stepvault": sv_sync,
        "stepvault-async": lambda path: (-1.0, 0),  # replaced in bench_save (needs a manager)
    }


def bare_copy(flat: dict[str, torch.Tensor], dst: np.ndarray) -> float:
    """Seconds of one plain copy of every tensor's bytes into ``dst`` (one thread, numpy)."""
    srcs = [t.detach().reshape(-1).view(torch.uint8).numpy() for t in flat.values()]
    at = 0
    t0 = time.perf_counter()
    for src in srcs:
        np.copyto(dst[at : at + src.nbytes], src)
        at += src.nbytes
    return time.perf_counter() - t0


def bench_save(
    flat: dict[str, torch.Tensor],
    work: Path,
    repeats: int,
    log: Callable[[str], None],
    only: list[str] | None = None,
) -> Results:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    logical = sum(t.nbytes for t in flat.values())
    res = Results(logical, len(flat))
    peers = save_peers(flat, work)
    prime = make_prime(flat, work)
    names = [n for n in peers if only is None or n in only]
    floor_dst: np.ndarray | None = None
    # Libraries' first-call costs (thread pools, imports) are not what is compared.
    tiny = {"x": torch.zeros(16)}
    warm = work / "warm"
    dcp.async_save(tiny, storage_writer=FileSystemWriter(str(warm / "a"))).result()
    dcp.save(tiny, storage_writer=FileSystemWriter(str(warm / "b")))
    stepvault.save(warm / "c", tiny, run="w", step=1)
    remove(warm)
    prime()
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        res.save_orders.append(order)
        for name in order:
            path = work / f"save-{name}"
            remove(path)
            mgr = None
            if name == "stepvault-async":
                # Steady state, as in training: the manager's staging buffers already exist
                # (one untimed save first), and the state changed since (so every byte of
                # the timed save is new; nothing deduplicates).
                mgr = stepvault.CheckpointManager(path, "bench", async_save=True, lineage=False)
                mgr.save(0, flat, force=True).result()
                with torch.no_grad():
                    for t in flat.values():
                        t.add_(1.0)
                if floor_dst is None:
                    floor_dst = np.ones(logical, dtype=np.uint8)  # pre-faulted
                res.stall_floor.append(bare_copy(flat, floor_dst))
            gc.collect()
            prime()
            os.sync()
            with PeakRss() as mem:
                t0 = time.perf_counter()
                if mgr is not None:
                    handle = mgr.save(1, flat, force=True)
                    stall = time.perf_counter() - t0
                    info = handle.result()
                    stored = info.new_bytes
                else:
                    stall, stored = peers[name](path)
                dt = time.perf_counter() - t0
            if mgr is not None:
                res.staging_held = int(mgr.stats().get("staging_bytes", 0))
                mgr.close()
            run = SaveRun(dt, dt if stall < 0 else stall, mem.extra, stored)
            res.saves.setdefault(name, []).append(run)
            log(
                f"  save {r + 1}/{repeats} {name:16s} {dt:6.2f} s {logical / GB / dt:5.2f} GB/s"
                f"  stall {run.stall:6.3f} s  peak +{mem.extra / GB:.2f} GB"
            )
            remove(path)
    return res


# -- restore --------------------------------------------------------------------------------
def bench_restore(
    flat: dict[str, torch.Tensor],
    res: Results,
    work: Path,
    repeats: int,
    log: Callable[[str], None],
) -> None:
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from stepvault.engine import CheckpointReader
    from stepvault.format import parse_manifest
    from stepvault.format.hashing import content_hash
    from stepvault.store import Store

    pt, st, dcp_dir, sv = (work / n for n in ("r.pt", "r.safetensors", "r-dcp", "r-sv"))
    for p in (pt, st, dcp_dir, sv):
        remove(p)
    torch.save(flat, pt)
    save_file(flat, str(st))
    dcp.save(flat, storage_writer=FileSystemWriter(str(dcp_dir)))
    stepvault.save(sv, flat, run="bench", step=1)
    dest = {k: torch.empty_like(v).fill_(0.0) for k, v in flat.items()}

    def copy_into(loaded: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for k, t in dest.items():
                t.copy_(loaded[k])

    peers: dict[str, Callable[[], None]] = {
        "torch.load": lambda: copy_into(torch.load(pt, weights_only=True, mmap=True)),
        "safetensors": lambda: copy_into(load_file(str(st))),
        "dcp": lambda: dcp.load(dest, storage_reader=FileSystemReader(str(dcp_dir))),
        "stepvault": lambda: stepvault.restore(sv, dest, run="bench", step=1),
    }
    names = list(peers)
    for name in names:  # untimed first run of each, checked bit for bit
        for t in dest.values():
            t.zero_()
        peers[name]()
        bad = [k for k, v in flat.items() if not torch.equal(dest[k], v)]
        if bad:
            raise SystemExit(f"{name} restored wrong data for {bad[:3]}")
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        res.restore_orders.append(order)
        for name in order:
            base = gc_baseline()
            t0 = time.perf_counter()
            peers[name]()
            # What a load left to the cyclic gc is its cost too (the heap walk is not).
            dt = time.perf_counter() - t0 + gc_extra(base)
            res.restores.setdefault(name, []).append(dt)
            log(f"  restore {r + 1}/{repeats} {name:12s} {dt:6.3f} s")
        t0 = time.perf_counter()
        copy_into(flat)
        res.copy_ref.append(time.perf_counter() - t0)
    # Where stepvault's time goes: mapping + verifying every object (what restore does
    # before it touches the live state), and BLAKE3 alone over the same bytes in memory.
    store = Store.open(sv)
    manifest = parse_manifest(store.read_manifest("bench", 1))
    digests = list(manifest.objects)
    in_memory = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in flat.values()]
    for _ in range(repeats):
        reader = CheckpointReader(store, manifest)
        t0 = time.perf_counter()
        reader.prefetch(digests)
        res.verify.append(time.perf_counter() - t0)
        reader.release()
        t0 = time.perf_counter()
        for b in in_memory:
            content_hash(b)
        res.hash_only.append(time.perf_counter() - t0)
    del in_memory
    # One tensor, read lazily from a freshly opened checkpoint.
    target = flat[LAZY_NAME]
    res.lazy_bytes = target.nbytes
    vault = stepvault.open(sv)
    sv_name = next(n for n in vault.checkpoint("bench", 1).tensor_names() if n.endswith(LAZY_NAME))

    def lazy_dcp() -> torch.Tensor:
        one = {LAZY_NAME: torch.empty_like(target)}
        dcp.load(one, storage_reader=FileSystemReader(str(dcp_dir)))
        return one[LAZY_NAME]

    def lazy_st() -> torch.Tensor:
        with safe_open(str(st), "pt") as f:
            return f.get_tensor(LAZY_NAME)

    lazy: dict[str, Callable[[], torch.Tensor]] = {
        "torch.load": lambda: torch.load(pt, weights_only=True, mmap=True)[LAZY_NAME].clone(),
        "safetensors": lazy_st,
        "dcp": lazy_dcp,
        "stepvault": lambda: stepvault.open(sv).checkpoint("bench", 1).tensor(sv_name),
    }
    for name, fn in lazy.items():
        if not torch.equal(fn(), target):
            raise SystemExit(f"{name} read {LAZY_NAME} wrong")
        res.lazy[name] = _common.timed(fn, max(3, repeats), warmup=0)
        log(f"  lazy read {name:12s} {median(res.lazy[name]) * 1e3:7.2f} ms")
    for p in (pt, st, dcp_dir, sv):
        remove(p)


# -- report ---------------------------------------------------------------------------------
def evaluate(res: Results) -> list[Row]:
    rows: list[Row] = []
    disk = res.gbps("disk")
    for peer in res.saves:
        measured = f"{res.gbps(peer):.2f} GB/s ({res.gbps(peer) / disk:.0%} of disk limit)"
        if peer.endswith("async"):
            measured += f"; stall {res.stall(peer):.3f} s"
        rows.append(Row(f"durable save: {SAVE_LABELS[peer]}", "—", measured, "info"))
    sv = res.gbps("stepvault")

    def ratio_row(peer: str, target: float) -> None:
        ratio = sv / res.gbps(peer)
        why = ""
        if ratio < target:
            need = target * res.gbps(peer)
            why = (
                f"{target:g}x {SAVE_LABELS[peer]} would be {need:.2f} GB/s = "
                f"{need / disk:.2f}x the disk limit measured in the same run ({disk:.2f} GB/s)"
            )
            if need <= disk:
                why = (
                    f"stepvault {sv:.2f} GB/s is {sv / disk:.0%} of the disk limit "
                    f"({disk:.2f} GB/s); {target:g}x would need {need:.2f} GB/s"
                )
        label = "disk limit" if peer == "disk" else SAVE_LABELS[peer]
        rows.append(
            Row(
                f"durable save: stepvault / {label}",
                f"≥ {target:g}",
                f"{ratio:.2f} ({sv:.2f} vs {res.gbps(peer):.2f} GB/s)",
                verdict(ratio >= target),
                why,
            )
        )

    ratio_row("disk", DISK_TARGET)
    ratio_row("safetensors", SAFETENSORS_TARGET)
    ratio_row("torch.save", TORCH_SAVE_TARGET)
    ratio_row("dcp", DCP_TARGET)
    stall = res.stall("stepvault-async") / res.save_s("stepvault")
    rows.append(
        Row(
            "async save stall / synchronous save (stepvault)",
            f"≤ {STALL_TARGET:g}",
            f"{stall:.3f} ({res.stall('stepvault-async'):.3f} s vs "
            f"{res.save_s('stepvault'):.2f} s); DCP async_save: "
            f"{res.stall('dcp-async') / res.save_s('dcp'):.3f}",
            verdict(stall <= STALL_TARGET),
            f"the stall is the copy of {fmt_bytes(res.logical)} into reused staging buffers "
            f"({res.logical / GB / res.stall('stepvault-async'):.1f} GB/s); a bare numpy copy "
            f"of the same bytes into a pre-faulted buffer before each of these saves took "
            f"{median(res.stall_floor):.3f} s ({res.logical / GB / median(res.stall_floor):.1f}"
            f" GB/s), {median(res.stall_floor) / res.save_s('stepvault'):.3f}x the "
            "synchronous save: the memory copy alone",
        )
    )
    for peer in res.saves:
        held = ""
        if peer == "stepvault-async":
            held = (
                f"; plus staging buffers held between saves (allocated once, reused): "
                f"{res.staging_held / GB:.2f} GB"
            )
        rows.append(
            Row(
                f"peak extra memory during save: {SAVE_LABELS[peer]}",
                "—",
                f"{res.peak(peer) / GB:.2f} GB ({res.peak(peer) / res.logical:.2f}x the state)"
                + held,
                "info",
            )
        )
    for peer in res.restores:
        rows.append(
            Row(
                f"full restore: {RESTORE_LABELS[peer]}", "—", f"{res.restore_s(peer):.3f} s", "info"
            )
        )
    ratio = res.restore_s("stepvault") / res.restore_s("safetensors")
    v, h = median(res.verify), median(res.hash_only)
    rows.append(
        Row(
            "full restore, warm page cache: stepvault / safetensors",
            f"≤ {RESTORE_TARGET:g}",
            f"{ratio:.2f} ({res.restore_s('stepvault'):.3f} s vs "
            f"{res.restore_s('safetensors'):.3f} s)",
            verdict(ratio <= RESTORE_TARGET),
            f"stepvault maps and BLAKE3-verifies every object before it touches the live "
            f"state (principle 1): that step alone took {v:.3f} s "
            f"({v / res.restore_s('stepvault'):.0%} of the restore; BLAKE3 of the same bytes "
            f"already in memory {h:.3f} s); the rest, {res.restore_s('stepvault') - v:.3f} s, "
            f"is the copy into the live tensors (a plain copy_ of the state took "
            f"{median(res.copy_ref):.3f} s). safetensors checks nothing.",
        )
    )
    for peer in res.lazy:
        rows.append(
            Row(
                f"one tensor ({fmt_bytes(res.lazy_bytes)}) read lazily: {LAZY_LABELS[peer]}",
                "—",
                f"{median(res.lazy[peer]) * 1e3:.1f} ms",
                "info",
            )
        )
    return rows


def render(
    command: str,
    facts: dict[str, str],
    shape: Any,
    res: Results,
    rows: list[Row],
    runtime: float,
    repeats: int,
    plot: str | None = None,
) -> str:
    out = [
        *section_head("Save and restore against the peers", command, runtime, facts),
        "### Results",
        "",
        table(
            ["metric", "target", "measured", "result"],
            [[r.metric, r.target, r.measured, r.verdict] for r in rows],
        ),
        "",
    ]
    misses = [r for r in rows if r.verdict == "MISS"]
    if misses:
        out += ["Misses, with what the run measured:", ""]
        out += [f"- **{r.metric}**: {r.why}" for r in misses]
        out.append("")
    if plot:
        out += [f"![save and restore against the peers]({plot})", ""]
    out += [
        "### Details",
        "",
        table(
            ["save", "median s", "GB/s", "stall s", "peak extra GB", "stored", "all repeats (s)"],
            [
                [
                    SAVE_LABELS[p],
                    f"{res.save_s(p):.2f}",
                    f"{res.gbps(p):.2f}",
                    f"{res.stall(p):.3f}",
                    f"{res.peak(p) / GB:.2f}",
                    fmt_bytes(median([float(r.stored) for r in v])),
                    secs([r.seconds for r in v]),
                ]
                for p, v in res.saves.items()
            ],
        ),
        "",
        table(
            ["restore (warm)", "median s", "GB/s", "all repeats (s)"],
            [
                [
                    RESTORE_LABELS[p],
                    f"{median(v):.3f}",
                    f"{res.logical / GB / median(v):.2f}",
                    secs(v, 3),
                ]
                for p, v in res.restores.items()
            ]
            + [
                [
                    "stepvault: map + verify every object (CheckpointReader.prefetch)",
                    f"{median(res.verify):.3f}",
                    "",
                    secs(res.verify, 3),
                ],
                [
                    "BLAKE3 (content_hash) of the same bytes in memory",
                    f"{median(res.hash_only):.3f}",
                    "",
                    secs(res.hash_only, 3),
                ],
                [
                    "reference: plain copy_ of the state into the same tensors",
                    f"{median(res.copy_ref):.3f}",
                    "",
                    secs(res.copy_ref, 3),
                ],
            ],
        ),
        "",
        "### Method",
        "",
        f"- State: {shape.describe()}; fp32 parameters plus AdamW `exp_avg`/`exp_avg_sq` and "
        f"a `step` scalar per parameter, as one flat `{{name: tensor}}` dict of "
        f"{res.n_tensors} tensors ({res.logical / GB:.3f} GB) that every peer saves as is "
        "(safetensors needs it flat).",
        f"- Save: median of {repeats}; order rotates per repeat ("
        + "; ".join(" → ".join(o) for o in res.save_orders)
        + "). Before every timed save an untimed priming write of the same size (the VM is "
        "2-5x slower writing into memory idle for seconds) and `os.sync()`. Every time runs "
        "until the bytes are durable: fsync of the files and their directories (DCP's "
        "FileSystemWriter fsyncs its files itself, `sync_files=True`; its directory is "
        "fsynced here). Async peers: the stall is the time until `async_save()`/`save()` "
        "returned, the time is until the future/handle completed. DCP runs without a "
        "process group, with its default stager (a fresh CPU copy per call: caching staged "
        "buffers needs pinned memory, i.e. CUDA). The stepvault manager saves once "
        "untimed first (its staging buffers are allocated once and reused, as in training), "
        "then every tensor gets `add_(1)` so the timed save writes only new bytes. Peak "
        "extra memory: VmRSS sampled every 2 ms during the save, minus VmRSS at its start.",
        f"- Restore: into pre-faulted tensors of the same shapes (the live training state), "
        f"files just written (warm page cache); median of {repeats}, order rotating; one "
        "untimed run of each first, checked bit for bit; freeing what a load left to the "
        "cyclic gc is inside its time. Cold-cache restores are in the core section.",
        f"- Lazy read: `{LAZY_NAME}` ({fmt_bytes(res.lazy_bytes)}) from a checkpoint opened "
        "anew for every read (the opening is inside the time); median of "
        f"{max(3, repeats)}.",
        "",
    ]
    return "\n".join(out)


def stall_only(
    flat: dict[str, torch.Tensor], work: Path, repeats: int, log: Callable[[str], None]
) -> int:
    """The async stall target alone (``--stall-only``): the same saves as the full run."""
    res = bench_save(flat, work, repeats, log, only=["stepvault", "stepvault-async", "dcp-async"])
    sync = [r.seconds for r in res.saves["stepvault"]]
    stall = [r.stall for r in res.saves["stepvault-async"]]
    dcp = [r.stall for r in res.saves["dcp-async"]]
    print()
    for label, xs in (
        ("stepvault synchronous save", sync),
        ("stepvault async stall", stall),
        ("DCP async_save stall", dcp),
    ):
        print(f"{label}: median {median(xs):.4f} s  [{' '.join(f'{x:.4f}' for x in xs)}]")
    ratio = median(stall) / median(sync)
    floor = res.stall_floor
    print(
        f"bare numpy copy of the same bytes (pre-faulted destination, before each async save): "
        f"median {median(floor):.4f} s  [{' '.join(f'{x:.4f}' for x in floor)}]"
    )
    paired = [a / b for a, b in zip(stall, floor)]
    print(f"stall / bare copy before it: median {median(paired):.2f}")
    print(
        f"async stall / synchronous save: {ratio:.3f} (target <= {STALL_TARGET:g}: "
        f"{verdict(ratio <= STALL_TARGET)}); copy speed {res.logical / GB / median(stall):.1f} GB/s"
    )
    return 0


# -- main -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mb", type=float, default=None, help="state size (default ~1.5 GB)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of each save/restore")
    ap.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    ap.add_argument("--plot", default=None, help="plot path to link from the section")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch parent")
    ap.add_argument(
        "--stall-only",
        action="store_true",
        help="only the async stall target: stepvault sync and async saves and DCP async_save "
        "(no restore; prints the numbers, leaves BENCHMARKS.md alone)",
    )
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    warnings.filterwarnings("ignore", module="torch.distributed")
    t_start = time.perf_counter()
    parent = args.workdir or REPO / "bench-out"
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-peers-", dir=parent))

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    command = _common.command_line("bench_peers.py", argv)
    try:
        facts = machine_facts(work, {"torch threads": str(torch.get_num_threads())})
        log(facts_line(facts))
        shape = shape_for(args.size_mb)
        _, flat = build_state(shape)
        log(f"state: {shape.describe()}, {sum(t.nbytes for t in flat.values()) / GB:.3f} GB")
        if args.stall_only:
            return stall_only(flat, work, args.repeats, log)
        res = bench_save(flat, work, args.repeats, log)
        bench_restore(flat, res, work, args.repeats, log)
        rows = evaluate(res)
        facts["load average at end"] = _common.load_average()
        runtime = time.perf_counter() - t_start
        section = render(command, facts, shape, res, rows, runtime, args.repeats, args.plot)
        _common.write_section(args.out, SECTION, section)
        if args.json:
            data = res.to_json()
            data["rows"] = [r.__dict__ for r in rows]
            data["facts"] = facts
            args.json.write_text(json.dumps(data, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(facts_line(facts))
    print(
        table(
            ["metric", "target", "measured", "result"],
            [[r.metric, r.target, r.measured, r.verdict] for r in rows],
        )
    )
    for r in rows:
        if r.verdict == "MISS":
            print(f"MISS {r.metric}: {r.why}")
    print(f"\ntotal runtime {runtime:.1f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
