"""Part 4b: cold restore (sync + drop_caches, then a fresh child process), with the disk's
sequential read speed as the limit. The children are ``bench_core.py --cold-child``."""

from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from _common import (
    Gpt2Shape,
    flat_specs,
    gc_baseline,
    gc_extra,
    median,
    minflt,
    remove,
)

import stepvault

from .base import COLD_CHILD, DROP_CACHES, PAGE, SCRIPT, drop_caches, resident_bytes
from .stages import StageTimer, wrap_read_path

SEQ_BLOCK = 16 << 20
READERS = max(2, min(4, os.cpu_count() or 2))  # parallel sequential readers, one per core
COLD_LABELS = {
    "safetensors": "safetensors (load_file + copy_)",
    "stepvault": "stepvault.restore",
    "seqread": "sequential read of the safetensors file, 1 reader (16 MiB pread() calls, like "
    "dd bs=16M)",
    "seqread-par": f"sequential read of the safetensors file, {READERS} readers in parallel "
    "(one contiguous part each, 16 MiB reads)",
}
SEQ_NAMES = ("seqread", "seqread-par")


@dataclass
class ColdResults:
    skipped: str | None = None  # why the cold runs did not happen
    times: dict[str, list[float]] = field(default_factory=dict)
    resident: dict[str, list[float]] = field(default_factory=dict)  # share cached before
    faults: dict[str, list[int]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)  # user+sys s, all threads
    stages: dict[str, list[float]] = field(default_factory=dict)  # stepvault children
    file_bytes: dict[str, int] = field(default_factory=dict)
    orders: list[list[str]] = field(default_factory=list)

    def ratio(self) -> float:
        return median(self.times["stepvault"]) / median(self.times["safetensors"])

    def paired_ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.times["stepvault"], self.times["safetensors"])]

    def read_limit(self) -> tuple[str, float]:
        """The faster of the two cold sequential reads (name, median seconds)."""
        return min(((k, median(self.times[k])) for k in SEQ_NAMES), key=lambda kv: kv[1])


def checksum(tensors: dict[str, torch.Tensor]) -> float:
    """Cheap fingerprint of restored data: sum of the first 64 values of every tensor."""
    return float(sum(tensors[k].reshape(-1)[:64].double().sum().item() for k in sorted(tensors)))


def store_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def bench_cold_restore(
    flat: dict[str, torch.Tensor],
    shape: Gpt2Shape,
    st_path: Path,
    sv_root: Path,
    workdir: Path,
    repeats: int,
    log: Callable[[str], None],
) -> ColdResults:
    """Each restore in a fresh process right after ``sync`` + drop_caches (from here)."""
    from safetensors.torch import save_file

    res = ColdResults()
    if not DROP_CACHES.exists():
        res.skipped = f"{DROP_CACHES} does not exist"
        return res
    # A tiny checkpoint of each kind that a child restores untimed first, so libraries,
    # thread pools and code paths are loaded before the timed load.
    tiny = workdir / "cold-tiny"
    tiny.mkdir(exist_ok=True)
    tiny_state = {"x": torch.arange(4096, dtype=torch.float32)}
    save_file(tiny_state, str(tiny / "tiny.safetensors"))
    stepvault.save(tiny / "store", tiny_state, run="bench", step=1)
    expected = checksum(flat)
    names = list(COLD_LABELS)
    files = {k: store_files(sv_root) if k == "stepvault" else [st_path] for k in names}
    res.file_bytes = {k: sum(p.stat().st_size for p in v) for k, v in files.items()}
    for k in names:
        res.times[k], res.resident[k], res.faults[k], res.cpu[k] = [], [], [], []
    dims = f"{shape.n_layer},{shape.vocab},{shape.n_ctx},{shape.d}"
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        res.orders.append(order)
        for name in order:
            gc.collect()
            why = drop_caches()
            if why is not None:
                res.skipped = f"drop_caches not permitted ({why})"
                remove(tiny)
                return res
            target = st_path if name != "stepvault" else sv_root
            cmd = [sys.executable, str(SCRIPT), COLD_CHILD, name]
            proc = subprocess.run(
                [*cmd, str(target), dims, str(tiny)], capture_output=True, text=True, timeout=600
            )
            if proc.returncode != 0:
                raise SystemExit(f"cold {name} child failed:\n{proc.stdout}\n{proc.stderr}")
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            if name in ("safetensors", "stepvault") and out["check"] != expected:
                raise SystemExit(f"cold {name} restored wrong data ({out['check']} != {expected})")
            res.times[name].append(out["seconds"])
            res.faults[name].append(out["faults"])
            res.cpu[name].append(out["cpu"])
            resident = out["resident"]
            share = float("nan") if resident is None else resident / res.file_bytes[name]
            res.resident[name].append(share)
            for k, v in out.get("stages", {}).items():
                res.stages.setdefault(k, []).append(v)
            log(
                f"  cold restore {r + 1}/{repeats} {name:12s} {out['seconds']:6.2f} s"
                f"  (CPU {out['cpu']:5.2f} s; cached before: {share:.1%}; "
                f"child set-up {out['startup']:.1f} s)"
            )
    remove(tiny)
    return res


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def read_parallel(path: Path, blocks: list[np.ndarray]) -> int:
    """Read the file once: one thread per block, each over its own contiguous part, with
    ``pread`` calls of the block's size (one block: a plain sequential read, like dd)."""
    size = path.stat().st_size
    part = -(-size // len(blocks) // PAGE) * PAGE
    fd = os.open(path, os.O_RDONLY)
    done = [0] * len(blocks)

    def reader(i: int) -> None:
        view = memoryview(blocks[i])
        off, end = i * part, min(size, (i + 1) * part)
        while off < end:
            n = os.preadv(fd, [view[: min(view.nbytes, end - off)]], off)
            if n <= 0:
                break
            off += n
            done[i] += n

    try:
        if len(blocks) == 1:
            reader(0)
        else:
            threads = [threading.Thread(target=reader, args=(i,)) for i in range(len(blocks))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        os.close(fd)
    if sum(done) != size:
        raise SystemExit(f"read {sum(done)} of {size} bytes of {path}")
    return size


def cold_child(argv: list[str]) -> int:
    """One cold load in this fresh process; prints one JSON line (see bench_cold_restore)."""
    t_start = time.perf_counter()
    name, target, dims, tiny = argv
    from safetensors.torch import load_file

    n_layer, vocab, n_ctx, d = (int(x) for x in dims.split(","))
    shape = Gpt2Shape(n_layer=n_layer, vocab=vocab, n_ctx=n_ctx, d=d)
    path = Path(target)
    tiny_dest = {"x": torch.zeros(4096)}
    tiny_loaded = load_file(str(Path(tiny) / "tiny.safetensors"))
    tiny_dest["x"].copy_(tiny_loaded["x"])
    del tiny_loaded
    stepvault.restore(Path(tiny) / "store", tiny_dest, run="bench", step=1)
    # Pre-allocated, pre-faulted destination (as in the warm case).
    dest = {k: torch.empty(s, dtype=torch.float32).fill_(0.0) for k, s in flat_specs(shape).items()}
    blocks = [np.ones(SEQ_BLOCK, dtype=np.uint8) for _ in range(READERS)]
    files = store_files(path) if path.is_dir() else [path]
    resident = resident_bytes(files)
    stages: dict[str, float] = {}
    timer = StageTimer()
    if name == "stepvault":
        wrap_read_path(timer)  # a few hundred wrapped calls: well under a millisecond
    # Untimed, like the priming write of the save rows: touch and free as much memory as
    # the page cache is about to need. drop_caches just freed it and this VM gives memory
    # that has been free for a few seconds (this child's start-up) back to its host; without
    # this a single-threaded sequential read of the file measured ~2x slower (2.2 s vs
    # 1.2 s) and slower than safetensors' load_file + copy_ (see the Method section).
    scratch = np.ones(sum(p.stat().st_size for p in files) + (64 << 20), dtype=np.uint8)
    del scratch
    startup = time.perf_counter() - t_start
    base = gc_baseline()
    f0, c0, t0 = minflt(), cpu_seconds(), time.perf_counter()
    if name == "safetensors":
        loaded = load_file(str(path))
        with torch.no_grad():
            for k, t in dest.items():
                t.copy_(loaded[k])
        del loaded
    elif name == "stepvault":
        stepvault.restore(path, dest, run="bench", step=1)
    elif name in SEQ_NAMES:
        read_parallel(path, blocks[: 1 if name == "seqread" else READERS])
    else:
        raise SystemExit(f"unknown cold child {name!r}")
    dt = time.perf_counter() - t0
    nf, cpu = minflt() - f0, cpu_seconds() - c0
    dt += gc_extra(base)
    timer.restore_all()
    if name == "stepvault":
        split = timer.split(dt, nf, "stepvault: everything else in restore()")
        stages = {k: v for k, (v, _) in split.items()}
    out = {
        "seconds": dt,
        "faults": nf,
        "cpu": cpu,
        "resident": resident,
        "startup": startup,
        "check": checksum(dest) if name in ("safetensors", "stepvault") else None,
        "stages": stages,
    }
    print(json.dumps(out))
    return 0
