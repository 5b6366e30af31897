"""Helpers shared by the benchmark scripts: machine facts, markdown tables and sections,
timing with warm-up and medians, durable-write helpers, memory probes and the GPT-2 state.

The scripts run as ``python benchmarks/<name>.py`` (this folder is then on ``sys.path``)
or are loaded by path from the tests; each puts this folder on ``sys.path`` first.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import importlib.metadata
import os
import platform
import resource
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
GB = 1e9
MB = 1e6
INTRO = (
    "# stepvault benchmarks\n\n"
    "Numbers measured on the machine named with each section. Sections between markers are\n"
    "generated; regenerate them with the command given inside, do not edit them by hand.\n"
)


# -- numbers and markdown -------------------------------------------------------------------
def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def fmt_s(x: float) -> str:
    return f"{x:.2f} s"


def secs(xs: list[float], digits: int = 2) -> str:
    return ", ".join(f"{x:.{digits}f}" for x in xs)


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", GB), ("MB", MB), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass
class Row:
    """One line of a results table: a metric, its target, what was measured, the verdict."""

    metric: str
    target: str
    measured: str
    verdict: str  # PASS | MISS | info
    why: str = ""


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in body]
    return "\n".join(lines)


def write_section(path: Path, name: str, section: str) -> None:
    """Replace the text between ``<!-- name:begin -->`` and ``<!-- name:end -->`` in ``path``
    (markers appended at the end when absent; the file is created with a title if missing).
    The file is read right before writing: other sections may have changed meanwhile."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else INTRO
    if begin not in text or end not in text or text.index(begin) > text.index(end):
        text = text.rstrip("\n") + f"\n\n{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{section.rstrip()}\n{end}{tail}")


# -- machine facts --------------------------------------------------------------------------
def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "n/a"


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1/5/15 min)"
    except OSError:
        return "n/a"


def git_state() -> str:
    """Commit of the checkout and whether src/ has uncommitted changes (they were measured)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "src"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "n/a"
    n = len(dirty.splitlines())
    return f"git {head}" + (f" + {n} uncommitted file(s) under src/" if n else " (clean src/)")


def machine_facts(workdir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Cores, CPU, memory, disk, OS and versions, then ``extra`` facts, the source state
    and the load average (the machine is shared: a high load explains noisy numbers)."""
    import stepvault

    mem = "n/a"
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    cpu = platform.processor() or "n/a"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    du = shutil.disk_usage(workdir)
    facts = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cores": str(os.cpu_count()),
        "cpu": cpu,
        "memory": mem,
        "disk free": f"{du.free / 2**30:.1f} GiB of {du.total / 2**30:.1f} GiB ({workdir.parent})",
        "os": platform.platform(terse=True),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "stepvault": stepvault.__version__,
        "blake3": version("blake3"),
        "safetensors": version("safetensors"),
    }
    facts.update(extra or {})
    facts["stepvault source"] = git_state()
    facts["load average at start"] = load_average()
    return facts


def facts_line(facts: dict[str, str]) -> str:
    """One line of the facts that matter for reading a number (printed with results)."""
    keys = ("cores", "cpu", "memory", "disk free", "torch", "stepvault source")
    return "; ".join(f"{k}: {facts[k]}" for k in keys if k in facts)


# -- files ----------------------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """fsync a file and its directory (what a durable write means here)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path`` (for writers that do not)."""
    for dirpath, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))
    fsync_dir(path.parent)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(dirpath, f)).st_size
    return total


STREAM_BYTES = 64 << 20  # the disk limit starts writeback after every 64 MiB written


def sequential_writer(flat: dict[str, torch.Tensor]) -> Callable[..., int]:
    """``write(path, durable=True)``: the state's own tensor bytes into one file with large
    sequential writes (the disk limit sees exactly the bytes the peers write); durable
    writes stream: writeback starts every 64 MiB, and one fsync ends them."""
    views = [memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()) for t in flat.values()]
    logical = sum(v.nbytes for v in views)

    from stepvault.store.local import _start_writeback  # sync_file_range, None off Linux

    def write_bytes(path: Path, durable: bool = True) -> int:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            pending = 0
            for view in views:
                while view.nbytes:
                    n = os.write(fd, view)
                    view, pending = view[n:], pending + n
                    if durable and _start_writeback is not None and pending >= STREAM_BYTES:
                        # Keep the device busy while writing: without this, writeback only
                        # starts at fsync (or the dirty-page limit), and the "limit" would
                        # be write-then-flush, which an overlapping writer can beat.
                        _start_writeback(fd)
                        pending = 0
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if durable:
            fsync_dir(path.parent)
        return logical

    return write_bytes


def make_prime(flat: dict[str, torch.Tensor], workdir: Path) -> Callable[[], None]:
    write_bytes = sequential_writer(flat)

    def prime() -> None:
        # Untimed: fill the page cache with as many bytes as the timed write will need and
        # drop them again, so every writer starts with recently used, host-backed memory.
        # On this VM a 1.5 GB write into memory not touched for a few seconds (first write
        # of a process, or after ~5 s idle) measured 2-5x slower than right after another
        # write; without this the writer that follows an idle gap or a slow writer is
        # penalised.
        scratch = workdir / "prime.tmp"
        write_bytes(scratch, durable=False)
        scratch.unlink()

    return prime


# -- memory and time ------------------------------------------------------------------------
def rss_bytes() -> int:
    """Resident set size of this process now (VmRSS)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRss:
    """Peak resident memory above the level at entry, while a block runs.

    Samples VmRSS every ``interval`` s in a thread (the kernel's VmHWM cannot be reset
    without privileges everywhere); ``extra`` is the peak minus the RSS at entry. File
    pages a writer maps count too: they are memory the process holds.
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.base = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.base)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRss:
        self.base = self.peak = rss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def gc_baseline() -> float:
    """Collect, then time a second full collection that finds nothing (the heap walk)."""
    gc.collect()
    t0 = time.perf_counter()
    gc.collect()
    return time.perf_counter() - t0


def gc_extra(baseline: float) -> float:
    """Seconds a full collection now takes beyond ``baseline`` (freeing cyclic garbage)."""
    t0 = time.perf_counter()
    gc.collect()
    return max(0.0, time.perf_counter() - t0 - baseline)


def timed(
    fn: Callable[[], Any],
    repeats: int,
    *,
    warmup: int = 1,
    before: Callable[[], Any] | None = None,
) -> list[float]:
    """Wall times of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones; ``before``
    runs untimed ahead of every call (priming, resetting state)."""
    times = []
    for i in range(warmup + repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    return times


# -- the GPT-2 state ------------------------------------------------------------------------
@dataclass(frozen=True)
class Gpt2Shape:
    n_layer: int = 12
    vocab: int = 50257
    n_ctx: int = 1024
    d: int = 768

    def params(self) -> dict[str, tuple[int, ...]]:
        d = self.d
        shapes: dict[str, tuple[int, ...]] = {
            "wte.weight": (self.vocab, d),
            "wpe.weight": (self.n_ctx, d),
        }
        for i in range(self.n_layer):
            p = f"h.{i}."
            shapes.update(
                {
                    p + "ln_1.weight": (d,),
                    p + "ln_1.bias": (d,),
                    p + "attn.c_attn.weight": (d, 3 * d),
                    p + "attn.c_attn.bias": (3 * d,),
                    p + "attn.c_proj.weight": (d, d),
                    p + "attn.c_proj.bias": (d,),
                    p + "ln_2.weight": (d,),
                    p + "ln_2.bias": (d,),
                    p + "mlp.c_fc.weight": (d, 4 * d),
                    p + "mlp.c_fc.bias": (4 * d,),
                    p + "mlp.c_proj.weight": (4 * d, d),
                    p + "mlp.c_proj.bias": (d,),
                }
            )
        shapes["ln_f.weight"] = (d,)
        shapes["ln_f.bias"] = (d,)
        return shapes

    def numel(self) -> int:
        return sum(int(np.prod(s)) for s in self.params().values())

    def state_bytes(self) -> int:
        """fp32 params + exp_avg + exp_avg_sq (the per-parameter step scalars are ignored)."""
        return 3 * 4 * self.numel()

    def describe(self) -> str:
        return (
            f"GPT-2 shape n_layer={self.n_layer} vocab={self.vocab} n_ctx={self.n_ctx} "
            f"d={self.d}: {self.numel() / 1e6:.1f} M params"
        )


def shape_for(size_mb: float | None) -> Gpt2Shape:
    """Full GPT-2 small, or the largest scaled-down shape whose state fits ``size_mb``."""
    full = Gpt2Shape()
    if size_mb is None or size_mb * MB >= full.state_bytes():
        return full
    target = size_mb * MB
    for n_layer in range(12, 0, -1):  # fewer blocks first
        s = Gpt2Shape(n_layer=n_layer)
        if s.state_bytes() <= target:
            return s
    for vocab in range(50257, 1023, -1024):  # then a smaller vocabulary
        s = Gpt2Shape(n_layer=1, vocab=vocab)
        if s.state_bytes() <= target:
            return s
    for d in range(768, 63, -64):  # then a narrower model
        s = Gpt2Shape(n_layer=1, vocab=1024, n_ctx=256, d=d)
        if s.state_bytes() <= target:
            return s
    return Gpt2Shape(n_layer=1, vocab=1024, n_ctx=256, d=64)


def build_state(shape: Gpt2Shape, seed: int = 0) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(state, flat)``: the stepvault state {"model", "optimizer"} and the same tensors flat
    (``model.<name>``, ``optimizer.state.<i>.<key>``; shared storage, no copy)."""
    gen = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for i, (name, s) in enumerate(shape.params().items()):
        model[name] = torch.randn(s, generator=gen) * 0.02
        # One AdamW step's worth: exp_avg = 0.1 g, exp_avg_sq = 0.001 g² (non-negative).
        g = torch.randn(s, generator=gen) * 0.01
        opt_state[i] = {
            "step": torch.tensor(1.0),
            "exp_avg": g * 0.1,
            "exp_avg_sq": g.square_() * 0.001,
        }
    groups = [
        {
            "lr": 6e-4,
            "betas": (0.9, 0.95),
            "eps": 1e-8,
            "weight_decay": 0.1,
            "amsgrad": False,
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "params": list(range(len(model))),
        }
    ]
    state = {"model": model, "optimizer": {"state": opt_state, "param_groups": groups}}
    flat = {f"model.{k}": v for k, v in model.items()}
    for i, st in opt_state.items():
        for k, v in st.items():
            flat[f"optimizer.state.{i}.{k}"] = v
    return state, flat


def flat_specs(shape: Gpt2Shape) -> dict[str, tuple[int, ...]]:
    """Names and shapes of ``build_state``'s flat tensors (all fp32), without building them."""
    specs = {f"model.{k}": s for k, s in shape.params().items()}
    for i, s in enumerate(shape.params().values()):
        specs[f"optimizer.state.{i}.step"] = ()
        specs[f"optimizer.state.{i}.exp_avg"] = s
        specs[f"optimizer.state.{i}.exp_avg_sq"] = s
    return specs


def build_module(params: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A real ``nn.Module`` tree whose ``state_dict()`` names are ``params``' names, holding
    each tensor as an ``nn.Parameter`` that shares its storage (no copy)."""
    root = torch.nn.Module()
    for name, t in params.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            child = mod._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                mod.add_module(part, child)
            mod = child
        mod.register_parameter(leaf, torch.nn.Parameter(t))
    return root


#: Options whose values are local paths: left out of the command quoted in BENCHMARKS.md.
PATH_OPTIONS = ("--out", "--json", "--workdir", "--plot")


def command_line(script: str, argv: list[str]) -> str:
    """``python benchmarks/<script> <options>`` without the local-path options."""
    parts, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in PATH_OPTIONS:
            skip = True
            continue
        if a.split("=", 1)[0] in PATH_OPTIONS:
            continue
        parts.append(a)
    return " ".join(["python", f"benchmarks/{script}", *parts])
