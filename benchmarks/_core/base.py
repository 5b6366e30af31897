"""Constants of the core benchmark (targets, hidden options) and helpers about the machine:
page-cache residency, dropping caches, machine facts."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import _common
import torch
from _common import (
    version,
)

PAGE = os.sysconf("SC_PAGE_SIZE")
#: issue 13: warm restore (verified) / safetensors load_file + touching every tensor
RESTORE_TARGET = 1.3
#: issue 13: cold restore / safetensors
COLD_RESTORE_TARGET = 1.0
#: issue 13: one tensor out of the checkpoint, tensor(mmap=True) / safe_open().get_tensor
MMAP_ONE_TARGET = 2.0
BF16_RATIO_TARGET = 0.70
FP32_RATIO_TARGET = 0.85
CODEC_SPEED_TARGET = 200.0  # MB/s, single thread, encode
BF16_ZIPNN_GAP = 0.02  # issue 8: bf16 ratio ≤ zipnn's + this, encode ≥ zstd-3's speed
ISSUE8_METRIC = "float codec bf16: ratio within 0.02 of zipnn, encode ≥ zstd-3 speed"
DEDUP_TARGET = 0.01  # second unchanged save writes at most 1 % of the first
MALLOC_MMAP_MAX = 32 << 20  # glibc's ceiling for its dynamic mmap threshold (64-bit)
ASYNC_STALL_TARGET = 0.1  # async stall (first and later saves) / synchronous save
COPY_STALL_TARGET = 1.3  # async stall / a bare copy of the state into pre-faulted memory
COLD_CHILD = "--cold-child"  # hidden: run as a cold-restore child (see cold_child)
#: the command the cold-restore children run (with COLD_CHILD first)
SCRIPT = Path(__file__).resolve().parents[1] / "bench_core.py"
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def resident_bytes(paths: list[Path]) -> int | None:
    """Bytes of these files in the page cache (mincore on a read-only map; faults nothing)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    except (OSError, AttributeError):
        return None
    import mmap

    total = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                return None
            try:
                vec = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
                if libc.mincore(addr, size, vec) != 0:
                    return None
                total += min(size, sum(b & 1 for b in vec.raw) * PAGE)
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return total


def drop_caches() -> str | None:
    """``sync`` then drop the page cache (writes "3", closing the file); None if it worked,
    else why not."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3")
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    return None


def machine_facts(workdir: Path) -> dict[str, str]:
    return _common.machine_facts(
        workdir,
        {
            "zstandard": version("zstandard"),
            "zipnn": version("zipnn"),
            "torch threads": str(torch.get_num_threads()),
        },
    )
