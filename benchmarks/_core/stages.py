"""Where a restore or a save spends its time: a tiny tracing profiler over the read path
and the stage split of one warm stepvault restore against safetensors."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import (
    gc_baseline,
    gc_extra,
    minflt,
)

import stepvault


class StageTimer:
    """Exclusive wall time and page faults of wrapped functions, on the main thread only.

    A tiny tracing profiler: time spent in a wrapped function that was itself spent in
    another wrapped function is counted once, for the inner one.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.faults: dict[str, int] = {}
        self._stack: list[list[float]] = []
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        fn = getattr(owner, attr, None)
        if fn is None:
            return  # the internals moved: that stage is simply not reported
        self._undo.append((owner, attr, fn))

        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():
                return fn(*args, **kwargs)
            self._stack.append([0.0, 0.0])
            f0, t0 = minflt(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt, df = time.perf_counter() - t0, minflt() - f0
                child_t, child_f = self._stack.pop()
                self.seconds[label] = self.seconds.get(label, 0.0) + dt - child_t
                self.faults[label] = self.faults.get(label, 0) + int(df - child_f)
                if self._stack:
                    self._stack[-1][0] += dt
                    self._stack[-1][1] += df

        setattr(owner, attr, timed)

    def split(self, total: float, total_faults: int, rest: str) -> dict[str, tuple[float, int]]:
        """``{label: (seconds, faults)}`` of the wrapped stages plus ``rest`` = the remainder
        of ``total``."""
        out = {label: (sec, self.faults[label]) for label, sec in self.seconds.items()}
        out[rest] = (
            max(0.0, total - sum(self.seconds.values())),
            max(0, total_faults - sum(self.faults.values())),
        )
        return out

    def restore_all(self) -> None:
        for owner, attr, fn in reversed(self._undo):
            setattr(owner, attr, fn)
        self._undo.clear()


NO_VERIFY = "diagnostic: stepvault.restore with the BLAKE3 check switched off"
HASH_ONLY = "diagnostic: BLAKE3 (content_hash) of the same bytes in memory"


def wrap_read_path(timer: StageTimer) -> None:
    """Time the stages of ``stepvault.restore`` by wrapping its read path's functions."""
    try:
        import stepvault.api as api
        from stepvault.engine.reader import CheckpointReader
    except ImportError:
        return
    timer.wrap(api, "_open_checkpoint", "stepvault: open store + read/parse manifest")
    timer.wrap(api, "load_verified", "stepvault: open store + read/parse manifest")
    timer.wrap(api, "validate", "stepvault: validate against the live state")
    timer.wrap(CheckpointReader, "prefetch", "stepvault: map + verify (BLAKE3) all objects")
    timer.wrap(CheckpointReader, "read_into", "stepvault: copy chunks into live tensors")
    timer.wrap(CheckpointReader, "_build", "stepvault: build tensors from objects")
    timer.wrap(api, "apply", "stepvault: apply to live objects")
    timer.wrap(CheckpointReader, "release", "stepvault: release objects")


def restore_stages(
    sv_root: Path, dest: dict[str, torch.Tensor], st_path: Path
) -> dict[str, tuple[float, int]]:
    """Seconds and page faults of the stages of one public ``stepvault.restore`` call (by
    wrapping the read path's functions) and of one safetensors load + copy_."""
    from safetensors.torch import load_file

    out: dict[str, tuple[float, int]] = {}
    timer = StageTimer()
    wrap_read_path(timer)
    base = gc_baseline()
    try:
        f0, t0 = minflt(), time.perf_counter()
        stepvault.restore(sv_root, dest, run="bench", step=1)
        total, total_f = time.perf_counter() - t0, minflt() - f0
    finally:
        timer.restore_all()
    out.update(timer.split(total, total_f, "stepvault: everything else in restore()"))
    out["stepvault: cyclic garbage left behind (gc beyond baseline)"] = (gc_extra(base), 0)
    # Diagnostics, not stages: the same restore with the BLAKE3 check switched off (the
    # reader's decode_object called with verify=False; objects are still mapped and their
    # headers parsed), and BLAKE3 alone over the same bytes in memory.
    try:
        import stepvault.engine.reader as reader_mod

        decode = reader_mod.decode_object

        def unverified(buf: Any, digest: str, *, verify: bool = True, **kw: Any) -> Any:
            return decode(buf, digest, verify=False, **kw)  # kw: a delta's base reader

        reader_mod.decode_object = unverified
        try:
            base = gc_baseline()
            f0, t0 = minflt(), time.perf_counter()
            stepvault.restore(sv_root, dest, run="bench", step=1)
            dt, nf = time.perf_counter() - t0 + gc_extra(base), minflt() - f0
        finally:
            reader_mod.decode_object = decode
        out[NO_VERIFY] = (dt, nf)
        from stepvault.format.hashing import content_hash

        f0, t0 = minflt(), time.perf_counter()
        for t in dest.values():
            content_hash(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        out[HASH_ONLY] = (time.perf_counter() - t0, minflt() - f0)
    except (ImportError, AttributeError):
        pass

    def stage(label: str, fn: Callable[[], Any]) -> Any:
        f0 = minflt()
        t0 = time.perf_counter()
        value = fn()
        out[label] = (time.perf_counter() - t0, minflt() - f0)
        return value

    base = gc_baseline()
    st: dict[str, Any] = {}
    st["loaded"] = stage("safetensors: load_file (lazy mmap)", lambda: load_file(str(st_path)))

    def copy_all() -> None:
        with torch.no_grad():
            for k, t in dest.items():
                t.copy_(st["loaded"][k])

    stage("safetensors: copy_ into destination", copy_all)
    stage("safetensors: drop loaded tensors (unmap)", st.clear)
    out["safetensors: cyclic garbage left behind (gc beyond baseline)"] = (gc_extra(base), 0)
    return out
