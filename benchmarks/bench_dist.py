#!/usr/bin/env python
"""Distributed benchmark: sharded save and load on 1, 2 and 4 gloo ranks, stepvault vs DCP.

One command measures everything in one run and rewrites the section between
``<!-- dist:begin -->`` and ``<!-- dist:end -->`` of BENCHMARKS.md (the rest is kept; the
markers are appended at the end of the file if absent)::

    python benchmarks/bench_dist.py [--size-mb N] [--repeats R] [--out BENCHMARKS.md]

For each world size (1, 2, 4: spawned processes on CPU, each with a gloo process group; world
size 1 is a 1-rank group, so every world size runs the same code path) it measures:

1. The same global state on every world size: GPT-2-small-like fp32 tensors (12 blocks, the
   width scaled so parameters + AdamW-like ``exp_avg``/``exp_avg_sq`` total ~``--size-mb``,
   default 600) as DTensors sharded on dim 0 (``Shard(0)``), three ``Replicate()`` tensors and
   a few non-tensor values.
2. Durable save throughput (global logical GB/s; wall time from a barrier before to a barrier
   after, fsync included for both): ``stepvault.distributed.save_sharded`` into a fresh store vs
   ``torch.distributed.checkpoint.save`` with ``FileSystemWriter`` (``sync_files=True``, its
   default). Order alternates every repeat; an untimed priming write on every rank and
   ``os.sync()`` on rank 0 before each timed save; median of R (loads: of ``--load-repeats``).
3. A second unchanged ``save_sharded`` into the same store (dedup): time and new bytes.
4. Load throughput into pre-allocated DTensors of the same sharding (warm page cache):
   ``load_sharded`` vs ``dcp.load`` with ``FileSystemReader``; bitwise equality checked once.
5. For every ratio below its target, a py-spy profile (rank 0, all threads) of one extra run
   of both sides, summarised into the stages where the time went.

(One benchmark, one file: the rank workers, the timing and the report belong together.)
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import linecache
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when loaded by path
import _common
from _common import (
    GB,
    MB,
    REPO,
    Row,
    dir_bytes,
    fmt_bytes,
    load_average,
    median,
    secs,
    section_head,
    table,
    version,
)

SAVE_TARGET = 1.0  # stepvault / DCP save throughput
LOAD_TARGET = 1.0  # stepvault / DCP load throughput
DEDUP_TARGET = 0.01  # second unchanged save writes at most 1 % of the first
REPLICATED = ("wpe.weight", "ln_f.weight", "ln_f.bias")
VALUES = {"step": 1000, "epoch": 3, "lr": 6e-4, "run_name": "gpt2-like"}
PROFILE_RATE = 250  # py-spy samples per second


# -- state --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
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
                    p + "attn.c_attn.weight": (3 * d, d),
                    p + "attn.c_attn.bias": (3 * d,),
                    p + "attn.c_proj.weight": (d, d),
                    p + "attn.c_proj.bias": (d,),
                    p + "ln_2.weight": (d,),
                    p + "ln_2.bias": (d,),
                    p + "mlp.c_fc.weight": (4 * d, d),
                    p + "mlp.c_fc.bias": (4 * d,),
                    p + "mlp.c_proj.weight": (d, 4 * d),
                    p + "mlp.c_proj.bias": (d,),
                }
            )
        shapes["ln_f.weight"] = (d,)
        shapes["ln_f.bias"] = (d,)
        return shapes

    def numel(self) -> int:
        return sum(int(np.prod(s)) for s in self.params().values())

    def state_bytes(self) -> int:
        """fp32 parameters + exp_avg + exp_avg_sq."""
        return 3 * 4 * self.numel()

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the state: ``model.*``, ``optim.exp_avg.*``, ``optim.exp_avg_sq.*``."""
        out: dict[str, tuple[int, ...]] = {}
        for group in ("model", "optim.exp_avg", "optim.exp_avg_sq"):
            for name, s in self.params().items():
                out[f"{group}.{name}"] = s
        return out

    def describe(self) -> str:
        return (
            f"GPT-2-small-like: n_layer={self.n_layer} vocab={self.vocab} n_ctx={self.n_ctx} "
            f"d={self.d}, {self.numel() / 1e6:.1f} M params"
        )


def shape_for(size_mb: float) -> Shape:
    """GPT-2 small's structure with the largest width (multiple of 16) that fits ``size_mb``;
    below the narrowest width, a smaller vocabulary, context and fewer blocks."""
    target = size_mb * MB
    for d in range(768, 15, -16):
        s = Shape(d=d)
        if s.state_bytes() <= target:
            return s
    for vocab, n_layer in ((8192, 12), (2048, 12), (1024, 4), (512, 2), (256, 1)):
        s = Shape(n_layer=n_layer, vocab=vocab, n_ctx=min(1024, vocab), d=16)
        if s.state_bytes() <= target:
            return s
    return Shape(n_layer=1, vocab=64, n_ctx=64, d=16)


def full_tensor(index: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Tensor ``index`` of the global state: the same bytes on every rank and world size."""
    gen = torch.Generator().manual_seed(1000 + index)
    return torch.randn(shape, generator=gen).mul_(0.02)


def build_state(shape: Shape, mesh: Any, *, zeros: bool = False) -> dict[str, Any]:
    """This rank's DTensors (``Shard(0)``, or ``Replicate()`` for REPLICATED) and values.

    Each rank generates the full tensor and keeps its ``torch.chunk`` piece (what DTensor's
    ``Shard(0)`` holds), so no communication is needed and the global state is identical on
    every world size. ``zeros``: pre-faulted zero targets of the same sharding for loads.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    world, rank = mesh.size(), mesh.get_local_rank()
    state: dict[str, Any] = {}
    for i, (name, s) in enumerate(shape.tensors().items()):
        replicate = name.split(".", 1)[1].removeprefix("exp_avg_sq.").removeprefix("exp_avg.")
        placement = Replicate() if replicate in REPLICATED else Shard(0)
        stride = tuple(int(np.prod(s[i + 1 :])) for i in range(len(s)))  # contiguous
        if isinstance(placement, Replicate):
            local_shape = s
        else:
            sizes = [len(c) for c in torch.empty(s[0], 0).chunk(world)]
            sizes += [0] * (world - len(sizes))
            local_shape = (sizes[rank], *s[1:])
        if zeros:
            local = torch.zeros(local_shape)
        else:
            full = full_tensor(i, s)
            if isinstance(placement, Replicate):
                local = full
            else:
                pieces = full.chunk(world)
                local = pieces[rank].clone() if rank < len(pieces) else full.new_empty(local_shape)
            del full
        assert tuple(local.shape) == tuple(local_shape), (name, local.shape, local_shape)
        dt = DTensor.from_local(
            local, mesh, [placement], run_check=False, shape=torch.Size(s), stride=stride
        )
        node = state
        *path, leaf = name.split(".", 2 if name.startswith("optim.") else 1)
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = dt
    state["meta"] = {k: type(v)() for k, v in VALUES.items()} if zeros else dict(VALUES)
    return state


def locals_of(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(locals_of(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v.to_local() if hasattr(v, "to_local") else v
    return out


def check_local_shapes(state: dict[str, Any]) -> None:
    """Our shards are exactly DTensor's own ``Shard(0)`` split (where torch exposes it)."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        return
    stack = [state]
    while stack:
        node = stack.pop()
        for v in node.values():
            if isinstance(v, dict):
                stack.append(v)
            elif hasattr(v, "to_local"):
                shape, _ = compute_local_shape_and_global_offset(
                    v.shape, v.device_mesh, v.placements
                )
                assert tuple(shape) == tuple(v.to_local().shape), (shape, v.to_local().shape)


# -- helpers --------------------------------------------------------------------------------


def file_count(path: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine_facts(workdir: Path) -> dict[str, str]:
    from stepvault.engine import default_workers
    from stepvault.engine.writer import default_write_workers

    return _common.machine_facts(
        workdir / "out",
        {
            "py-spy": version("py-spy"),
            "process groups": "gloo on CPU, a spawned process per rank (world size 1: a 1-rank "
            "group)",
            "torch threads per rank": f"{torch.get_num_threads()} at world size 1, 1 above "
            "(as torchrun sets OMP_NUM_THREADS=1)",
            "stepvault threads per rank": f"{default_write_workers()} writing (fsync waits "
            f"need no core), {default_workers()} reading",
            "DCP FileSystemWriter": "defaults: thread_count=1, sync_files=True, "
            "single_file_per_rank",
        },
    )


# -- profiling (rank 0) ---------------------------------------------------------------------
class Profiler:
    """py-spy attached to this process (all threads, non-blocking) while a block runs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.proc: subprocess.Popen | None = None
        self.error: str | None = None

    def __enter__(self) -> Profiler:
        exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        cmd = [exe, "record", "--pid", str(os.getpid()), "--rate", str(PROFILE_RATE)]
        cmd += ["--format", "raw", "--output", str(self.path), "--nonblocking"]
        cmd += ["--full-filenames", "--idle"]
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        except OSError as exc:
            self.error = f"py-spy not started: {exc}"
            return self
        time.sleep(1.5)  # attach before the timed block starts
        if self.proc.poll() is not None:
            self.error = "py-spy exited: " + self.proc.stdout.read().decode()[-300:]
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.error = "py-spy did not stop"


# Stages of a sampled stack, from the innermost frame's source line (py-spy records Python
# frames only, so the line that called into C names the work: ``os.fsync(fd)`` is fsync).
# Frames inside torch's c10d collectives or Python's thread-pool/lock code are named by file.
STAGES: list[tuple[str, str]] = [
    ("fsync / writeback (files and directories)",
     r"fsync|\bos\.sync\(|_sync_dir|\.sync\(\)|SYNC_FILE_RANGE|_start_writeback"),
    ("BLAKE3 hashing / verification", r"blake3|hexdigest|\bdigest\(|content_hash|verify"),
    ("pickle / torch.save / torch.load", r"pickle|\.dump\(|\.load\(|torch\.save|"
                                          r"persistent_load|_load\(|unpickler"),
    ("write bytes", r"\.write\(|os\.write|writev|pwrite|write_record|writelines"),
    ("read bytes / map files", r"\.read\(|readinto|os\.read|pread|mmap|fromfile|from_file|"
                               r"frombuffer|get_record"),
    ("copy tensors / buffers", r"copy_\(|\.clone\(|contiguous\(|to_host\(|\.numpy\(|"
                               r"tobytes|memoryview|\bbytes\(|\w\[[^\]]*:[^\]]*\]\s*=[^=]"),
    ("allocate (zero-filled buffers)", r"\bempty\(|zeros\(|bytearray\(|new_empty|empty_like"),
    ("open/close/rename/mkdir/unlink", r"os\.open\(|\bopen\(|close\(|rename|os\.replace|"
                                       r"mkdir|makedirs|unlink|os\.stat|listdir|scandir"),
]  # fmt: skip
_STAGE_RES = [(label, re.compile(rx)) for label, rx in STAGES]
COLLECTIVE = "collectives (object pickling, waiting for ranks)"
WAITING = "waiting on worker threads / locks"
OTHER = "other Python (DCP planning, metadata, glue)"


def summarize_profile(path: Path) -> dict[str, Any]:
    """Stage shares and the hottest source lines of a py-spy raw profile."""
    stages: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    stage_lines: dict[str, Counter[str]] = {}
    total = 0
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        return {"error": f"no profile: {exc}"}
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack.strip() or not count.isdigit():
            continue
        frames = [f for f in stack.split(";") if not f.startswith("process ")]
        if any(("__enter__ (" in f or "__exit__ (" in f) and "bench_dist" in f for f in frames):
            continue  # the profiler attaching or detaching
        n = int(count)
        total += n
        stage, where = _stage(frames[-1]), _where(frames[-1])
        stages[stage] += n
        leaves[where] += n
        stage_lines.setdefault(stage, Counter())[where] += n
    return {
        "samples": total,
        "stages": dict(stages),
        "leaves": dict(leaves.most_common(4)),
        "stage_top": {k: c.most_common(1)[0][0] for k, c in stage_lines.items()},
    }


def _parse(frame: str) -> tuple[str, str, int]:
    name, _, where = frame.partition(" (")
    file, _, line = where.rstrip(")").rpartition(":")
    return name, file, int(line) if line.isdigit() else 0


def _where(frame: str) -> str:
    """``func (/path/pkg/file.py:12)`` -> ``pkg/file.py:12 `source line```."""
    _, file, line = _parse(frame)
    text = linecache.getline(file, line).strip().replace("|", "\\|")[:70]
    return f"{'/'.join(Path(file).parts[-2:])}:{line} `{text}`"


def _stage(leaf: str) -> str:
    _, file, line = _parse(leaf)
    if file.endswith(("distributed_c10d.py", "c10d_logger.py")):
        return COLLECTIVE
    if file.endswith(
        ("threading.py", "concurrent/futures/_base.py", "futures/thread.py", "queue.py")
    ):
        return WAITING
    text = linecache.getline(file, line)
    for label, rx in _STAGE_RES:
        if rx.search(text):
            return label
    return OTHER


# -- one rank -------------------------------------------------------------------------------
def rank_main(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    import torch.distributed as dist

    fault = open(Path(cfg["out"]) / f"rank{rank}.fault", "w")  # noqa: SIM115 (kept open)
    faulthandler.enable(fault)  # a rank killed by a signal leaves its Python stack here
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if world > 1:  # what torchrun does for several processes per node (OMP_NUM_THREADS=1)
        torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    result_path = Path(cfg["out"]) / f"rank{rank}.json"
    try:
        result = run_rank(rank, world, cfg)
        if rank == 0:
            result_path.write_text(json.dumps(result))
    except BaseException as exc:
        result_path.write_text(
            json.dumps({"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})
        )
        raise
    finally:
        dist.destroy_process_group()
    # The result is on disk: skip C++ static destructors, where a gloo/c10d thread still
    # joinable at interpreter exit can abort a finished rank (seen once in CI's tests).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh

    import stepvault
    import stepvault.distributed as sd

    work = Path(cfg["work"])
    repeats = int(cfg["repeats"])
    load_repeats = int(cfg.get("load_repeats", repeats))
    shape = Shape(**cfg["shape"])
    mesh = init_device_mesh("cpu", (world,))
    t0 = time.perf_counter()
    state = build_state(shape, mesh)
    targets = build_state(shape, mesh, zeros=True)
    check_local_shapes(state)
    source = locals_of(state)
    local_bytes = sum(t.nbytes for t in source.values())
    logical = sum(int(np.prod(s)) * 4 for s in shape.tensors().values())
    build_s = time.perf_counter() - t0

    def log(msg: str) -> None:
        if rank == 0:
            print(f"  [world {world}] {msg}", flush=True)

    scratch = work / f"prime-{rank}.tmp"
    views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in source.values()]

    def prime() -> None:
        # Untimed: write as many bytes as this rank will write and drop them again, so each
        # timed write starts with recently used page-cache memory (this VM writes 2-5x
        # slower into memory it has not touched for a few seconds; see bench_core.py).
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for view in views:
                while view.nbytes:
                    view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        scratch.unlink()

    def on_rank0(fn: Any) -> None:
        if rank == 0:
            fn()
        dist.barrier()

    def timed(fn: Any, *, sync: bool = True, warm_write: bool = True) -> float:
        if warm_write:
            prime()
        dist.barrier()
        if sync and rank == 0:
            os.sync()
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    def sv_save(root: Path, step: int) -> None:
        sd.save_sharded(root, state, run="bench", step=step)

    def dcp_save(path: Path) -> None:
        dcp.save(state, storage_writer=FileSystemWriter(str(path)))

    def sv_load(root: Path) -> None:
        sd.load_sharded(root, targets, run="bench", step=1)

    def dcp_load(path: Path) -> None:
        dcp.load(targets, storage_reader=FileSystemReader(str(path)))

    times: dict[str, list[float]] = {"sv_save": [], "dcp_save": [], "sv_second": []}
    times |= {"sv_load": [], "dcp_load": []}
    orders: list[list[str]] = []
    first_new: list[int] = []
    second_new: list[int] = []
    second_new_disk: list[int] = []
    dcp_bytes = 0
    files = {"stepvault": 0, "dcp": 0}
    sv_root = dcp_dir = work / "none"
    for r in range(repeats):
        order = ["stepvault", "dcp"] if r % 2 == 0 else ["dcp", "stepvault"]
        orders.append(order)
        for who in order:
            if who == "stepvault":
                old, sv_root = sv_root, work / f"sv-{r}"
                on_rank0(lambda old=old: shutil.rmtree(old, ignore_errors=True))
                dt = timed(lambda p=sv_root: sv_save(p, 1))
                times["sv_save"].append(dt)
                m1 = stepvault.open(sv_root).manifest("bench", 1)
                first_new.append(int(m1.stats.get("new_bytes", 0)))
                before = dir_bytes(sv_root / "objects") if rank == 0 else 0
                files["stepvault"] = file_count(sv_root / "objects") if rank == 0 else 0
                dt2 = timed(lambda p=sv_root: sv_save(p, 2))
                times["sv_second"].append(dt2)
                m2 = stepvault.open(sv_root).manifest("bench", 2)
                second_new.append(int(m2.stats.get("new_bytes", 0)))
                if rank == 0:
                    second_new_disk.append(dir_bytes(sv_root / "objects") - before)
                log(
                    f"save {r + 1}/{repeats} stepvault {dt:6.2f} s {logical / GB / dt:5.2f} GB/s;"
                    f" second save {dt2:5.2f} s new {second_new[-1]} B"
                )
            else:
                old, dcp_dir = dcp_dir, work / f"dcp-{r}"
                on_rank0(lambda old=old: shutil.rmtree(old, ignore_errors=True))
                dt = timed(lambda p=dcp_dir: dcp_save(p))
                times["dcp_save"].append(dt)
                if rank == 0:
                    dcp_bytes = dir_bytes(dcp_dir)
                    files["dcp"] = file_count(dcp_dir)
                log(f"save {r + 1}/{repeats} DCP       {dt:6.2f} s {logical / GB / dt:5.2f} GB/s")

    # Bitwise check (untimed; also warms the page cache and the targets), then timed loads.
    def bitwise(which: str) -> bool:
        for t in locals_of(targets).values():
            t.zero_()
        for k in targets["meta"]:
            targets["meta"][k] = type(VALUES[k])()
        (sv_load(sv_root) if which == "stepvault" else dcp_load(dcp_dir))
        got = locals_of(targets)
        ok = all(
            torch.equal(got[k].view(torch.int32), v.view(torch.int32)) for k, v in source.items()
        )
        ok = ok and targets["meta"] == VALUES
        flags = [None] * world
        dist.all_gather_object(flags, ok)
        return all(flags)

    equal = {"stepvault": bitwise("stepvault"), "dcp": bitwise("dcp")}
    log(f"bitwise equal after load: {equal}")
    load_orders: list[list[str]] = []
    for r in range(load_repeats):
        order = ["dcp", "stepvault"] if r % 2 == 0 else ["stepvault", "dcp"]
        load_orders.append(order)
        for who in order:
            if who == "stepvault":
                dt = timed(lambda: sv_load(sv_root), sync=False, warm_write=False)
                times["sv_load"].append(dt)
            else:
                dt = timed(lambda: dcp_load(dcp_dir), sync=False, warm_write=False)
                times["dcp_load"].append(dt)
            log(f"load {r + 1}/{load_repeats} {who:9s} {dt:6.2f} s {logical / GB / dt:5.2f} GB/s")

    # Profiles of both sides of every ratio below its target (one extra run each, rank 0).
    save_ratio = median(times["dcp_save"]) / median(times["sv_save"])
    load_ratio = median(times["dcp_load"]) / median(times["sv_load"])
    profile_ops: list[str] = []
    if cfg["profile"]:
        if save_ratio < SAVE_TARGET:
            profile_ops += ["sv_save", "dcp_save"]
        if load_ratio < LOAD_TARGET:
            profile_ops += ["sv_load", "dcp_load"]
    profiles: dict[str, Any] = {}
    for op in profile_ops:
        path = Path(cfg["out"]) / f"profile-w{world}-{op}.txt"
        prof_root = work / f"profile-{op}"
        on_rank0(lambda p=prof_root: shutil.rmtree(p, ignore_errors=True))
        run = {
            "sv_save": lambda p=prof_root: sv_save(p, 1),
            "dcp_save": lambda p=prof_root: dcp_save(p),
            "sv_load": lambda: sv_load(sv_root),
            "dcp_load": lambda: dcp_load(dcp_dir),
        }[op]
        writes = op.endswith("save")
        if writes:
            prime()
        dist.barrier()
        if writes and rank == 0:
            os.sync()
        profiler = Profiler(path) if rank == 0 else contextlib.nullcontext()
        with profiler:
            dist.barrier()
            start = time.perf_counter()
            run()
            dist.barrier()
            dt = time.perf_counter() - start
        on_rank0(lambda p=prof_root: shutil.rmtree(p, ignore_errors=True))
        if rank == 0:
            summary = summarize_profile(path)
            summary["seconds"] = dt
            if profiler.error:
                summary["error"] = profiler.error
            profiles[op] = summary
            log(f"profiled {op}: {dt:.2f} s, {summary.get('samples', 0)} samples")

    on_rank0(lambda: [shutil.rmtree(p, ignore_errors=True) for p in (sv_root, dcp_dir)])
    return {
        "world": world,
        "logical": logical,
        "local_bytes_rank0": local_bytes,
        "build_s": build_s,
        "times": times,
        "orders": orders,
        "load_orders": load_orders,
        "first_new": first_new,
        "second_new": second_new,
        "second_new_disk": second_new_disk,
        "dcp_bytes": dcp_bytes,
        "files": files,
        "equal": equal,
        "profiles": profiles,
    }


def spawn_world(world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.multiprocessing as mp

    out = Path(cfg["out"])
    for f in [*out.glob("rank*.json"), *out.glob("rank*.fault")]:
        f.unlink()
    ctx = mp.start_processes(
        rank_main,
        args=(world, free_port(), cfg),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    try:
        while not ctx.join():
            pass
    except Exception as exc:
        codes = {r: p.exitcode for r, p in enumerate(ctx.processes)}
        notes = [f"exit codes by rank: {codes}"]
        for f in sorted([*out.glob("rank*.json"), *out.glob("rank*.fault")]):
            text = f.read_text()
            if text.strip() and (f.suffix == ".fault" or '"error"' in text):
                notes.append(f"{f.name}: {text[-3000:]}")
        raise RuntimeError(f"world size {world} failed: {exc}\n" + "\n".join(notes)) from exc
    for f in out.glob("rank*.fault"):
        if not f.read_text().strip():
            f.unlink()
    result = json.loads((out / "rank0.json").read_text())
    if "error" in result:
        raise RuntimeError(f"world size {world}, rank 0: {result['error']}")
    return result


# -- report ---------------------------------------------------------------------------------


def world_rows(res: dict[str, Any]) -> list[Row]:
    t, logical = res["times"], res["logical"]

    def tput(key: str) -> str:
        m = median(t[key])
        return f"{logical / GB / m:.2f} GB/s ({m:.2f} s; repeats {secs(t[key])} s)"

    save_ratio = median(t["dcp_save"]) / median(t["sv_save"])
    load_ratio = median(t["dcp_load"]) / median(t["sv_load"])
    first = median(t["sv_save"])
    second = median(t["sv_second"])
    first_new = max(res["first_new"]) if res["first_new"] else 0
    new = max(res["second_new"]) if res["second_new"] else 0
    disk_new = max(res["second_new_disk"]) if res["second_new_disk"] else 0
    new_frac = new / first_new if first_new else float("nan")
    equal = res["equal"]
    return [
        Row("save: stepvault save_sharded (raw, checksums)", "—", tput("sv_save"), "info"),
        Row("save: DCP save + FileSystemWriter", "—", tput("dcp_save"), "info"),
        Row(
            "stepvault / DCP save throughput",
            f"≥ {SAVE_TARGET:.1f}",
            f"{save_ratio:.2f}",
            "PASS" if save_ratio >= SAVE_TARGET else "MISS",
        ),
        Row(
            "second unchanged stepvault save: time",
            "—",
            f"{second:.2f} s = {second / first:.3f} of the first "
            f"({logical / GB / second:.2f} GB/s; repeats {secs(t['sv_second'])} s)",
            "info",
        ),
        Row(
            "second unchanged stepvault save: new bytes / first",
            f"≤ {DEDUP_TARGET}",
            f"{new_frac:.4f} ({fmt_bytes(new)} manifest, {fmt_bytes(disk_new)} on disk, "
            f"of {fmt_bytes(first_new)})",
            "PASS" if new_frac <= DEDUP_TARGET else "MISS",
        ),
        Row(
            "files written by one save (all fsynced)",
            "—",
            f"stepvault {res['files']['stepvault']} objects + 1 manifest; "
            f"DCP {res['files']['dcp']} files",
            "info",
        ),
        Row("load: stepvault load_sharded (verifies)", "—", tput("sv_load"), "info"),
        Row("load: DCP load + FileSystemReader", "—", tput("dcp_load"), "info"),
        Row(
            "stepvault / DCP load throughput",
            f"≥ {LOAD_TARGET:.1f}",
            f"{load_ratio:.2f}",
            "PASS" if load_ratio >= LOAD_TARGET else "MISS",
        ),
        Row(
            "loaded state bitwise equal (tensors and values)",
            "both",
            f"stepvault {'yes' if equal['stepvault'] else 'NO'}, "
            f"DCP {'yes' if equal['dcp'] else 'NO'}",
            "PASS" if all(equal.values()) else "MISS",
        ),
    ]


OP_NAMES = {
    "sv_save": "stepvault save",
    "dcp_save": "DCP save",
    "sv_load": "stepvault load",
    "dcp_load": "DCP load",
}


def stage_line(op: str, prof: dict[str, Any]) -> str:
    if not prof.get("samples"):
        return f"{OP_NAMES[op]}: {prof.get('error', 'no samples')}"
    busy = {k: v for k, v in prof["stages"].items() if k != WAITING}
    total = sum(busy.values()) or 1
    parts = sorted(busy.items(), key=lambda kv: -kv[1])
    shown = ", ".join(f"{k} {v / total:.0%}" for k, v in parts[:3])
    return (
        f"{OP_NAMES[op]} ({prof['seconds']:.2f} s run; rank 0 threads "
        f"{total / PROFILE_RATE:.2f} s not idle): {shown}"
    )


def excess(sv: dict[str, Any], ref: dict[str, Any]) -> str:
    """Stages where stepvault's rank 0 spent more thread time than DCP's, largest first."""
    if not sv.get("samples") or not ref.get("samples"):
        return "no comparison (a profile is missing)"
    diffs = {
        k: (sv["stages"].get(k, 0) - ref["stages"].get(k, 0)) / PROFILE_RATE
        for k in set(sv["stages"]) | set(ref["stages"])
        if k != WAITING
    }
    top = [(k, d) for k, d in sorted(diffs.items(), key=lambda kv: -kv[1]) if d > 0.02][:2]
    if not top:
        return "no stage is slower than DCP's in the profiled run (a noise-level difference)"
    return "; ".join(f"{k} +{d:.2f} thread-s (hottest: {sv['stage_top'][k]})" for k, d in top)


def miss_causes(res: dict[str, Any]) -> list[str]:
    """Two lines per MISS: the measured excess of stepvault over DCP, then both profiles."""
    out = []
    profs = res["profiles"]
    for kind, a, b in (("save", "sv_save", "dcp_save"), ("load", "sv_load", "dcp_load")):
        if a not in profs:
            continue
        pa, pb = profs[a], profs.get(b, {})
        out.append(
            f"- **world {res['world']}, stepvault / DCP {kind} throughput**: stepvault's extra "
            f"time (py-spy, rank 0) is in {excess(pa, pb)}.  \n"
            f"  {stage_line(a, pa)}; {stage_line(b, pb)}."
        )
    return out


def profile_details(results: list[dict[str, Any]]) -> str:
    body = []
    for res in results:
        for op, prof in res["profiles"].items():
            if not prof.get("samples"):
                continue
            total = prof["samples"]  # shares of all samples, idle waits included
            w, name = str(res["world"]), OP_NAMES[op]
            for stage, n in sorted(prof["stages"].items(), key=lambda kv: -kv[1]):
                if n / total >= 0.01:
                    label = f"{stage} (idle, not compared)" if stage == WAITING else stage
                    body.append([w, name, label, f"{n / total:.0%}", f"{n / PROFILE_RATE:.2f}"])
            for where, n in prof["leaves"].items():
                body.append([w, name, f"line: {where}", f"{n / total:.0%}", ""])
    if not body:
        return ""
    header = ["world", "profiled run", "stage / hottest line (rank 0)", "share", "thread-s"]
    return table(header, body)


def render(
    command: str,
    facts: dict[str, str],
    shape: Shape,
    results: list[dict[str, Any]],
    repeats: int,
    runtime: float,
    load_repeats: int | None = None,
) -> tuple[str, list[tuple[int, Row]]]:
    logical = results[0]["logical"]
    n_tensors = len(shape.tensors())
    lines = [
        *section_head(
            "Distributed benchmark (sharded save/load, stepvault vs DCP)", command, runtime, facts
        ),
        "### Summary",
        "",
    ]
    all_rows: list[tuple[int, Row]] = []
    summary = []
    for res in results:
        rows = world_rows(res)
        all_rows += [(res["world"], r) for r in rows]
        by = {r.metric: r for r in rows}
        t = res["times"]
        summary.append(
            [
                str(res["world"]),
                f"{logical / GB / median(t['sv_save']):.2f}",
                f"{logical / GB / median(t['dcp_save']):.2f}",
                f"{by['stepvault / DCP save throughput'].measured} "
                f"{by['stepvault / DCP save throughput'].verdict}",
                f"{median(t['sv_second']):.2f} s, {fmt_bytes(max(res['second_new'] or [0]))}",
                f"{logical / GB / median(t['sv_load']):.2f}",
                f"{logical / GB / median(t['dcp_load']):.2f}",
                f"{by['stepvault / DCP load throughput'].measured} "
                f"{by['stepvault / DCP load throughput'].verdict}",
            ]
        )
    lines += [
        table(
            [
                "world",
                "save stepvault GB/s",
                "save DCP GB/s",
                f"save ratio (≥ {SAVE_TARGET:.1f})",
                "second save: time, new",
                "load stepvault GB/s",
                "load DCP GB/s",
                f"load ratio (≥ {LOAD_TARGET:.1f})",
            ],
            summary,
        ),
        "",
    ]
    for res in results:
        rows = world_rows(res)
        w = res["world"]
        lines += [
            f"### World size {w} ({'a 1-rank gloo group' if w == 1 else f'{w} gloo ranks'})",
            "",
            table(
                ["metric", "target", "measured", "result"],
                [[r.metric, r.target, r.measured, r.verdict] for r in rows],
            ),
            "",
        ]
    causes = [c for res in results for c in miss_causes(res)]
    if causes:
        lines += ["### Misses, with what the profile measured", "", *causes, ""]
        lines += [profile_details(results), ""]
    dcp_sizes = ", ".join(f"{fmt_bytes(r['dcp_bytes'])} (world {r['world']})" for r in results)
    lines += [
        "### Method",
        "",
        f"- State: {shape.describe()}; parameters + AdamW-like `exp_avg` and `exp_avg_sq`, "
        f"all fp32 (`randn * 0.02`, one seed per tensor): {n_tensors} tensors, "
        f"{logical / GB:.3f} GB logical. Every tensor is a DTensor on a 1-D CPU mesh: "
        f"`Shard(0)` (uneven `torch.chunk` split where dim 0 does not divide), except "
        f"{', '.join(REPLICATED)} (and their moments), which are `Replicate()`; plus the "
        f"values {VALUES}. Each rank builds the full tensors from the seeds and keeps its "
        "shard, so the global state is the same bytes on every world size.",
        "- Processes: world size 1, 2 and 4 each run in freshly spawned processes "
        "(`torch.multiprocessing`, `start_method=spawn`), one gloo process group per world "
        "size (world size 1 is a 1-rank group, same code path). All ranks share the "
        f"{facts['cores']} cores and one disk.",
        "- Save: wall time on rank 0 from a barrier before to a barrier after the call, "
        f"median of {repeats}; GB/s = global logical bytes / time (1 GB = 1e9 B). stepvault: "
        "`stepvault.distributed.save_sharded(root, state, run=, step=1)` into a fresh store every "
        "repeat (default codec raw, BLAKE3 checksums always on, objects fsynced, their "
        "directories fsynced, manifest committed atomically). DCP: "
        "`dcp.save(state, storage_writer=FileSystemWriter(dir))` with its defaults "
        "(`sync_files=True`: fsync of every data file and of `.metadata`; no directory "
        "fsync; one writer thread per rank). Before every timed save each rank writes its "
        "shard bytes into a scratch file and deletes it (untimed priming, as in "
        "`bench_core.py`), then rank 0 runs `os.sync()`. The order alternates: "
        f"{'; '.join(' → '.join(o) for o in results[0]['orders'])}.",
        "- Second save: `save_sharded` of the unchanged state as step 2 into the store of the "
        "stepvault save just timed (same priming and `os.sync()`); new bytes from the "
        "manifest's `stats.new_bytes` and, independently, the growth of `objects/` on disk. "
        f"DCP checkpoint size on disk: {dcp_sizes}.",
        "- Load: into pre-allocated, zero-filled DTensors of the same sharding (and "
        "placeholder values); `load_sharded(root, targets, run=, step=1)` (verifies every "
        "object it reads) vs `dcp.load(targets, storage_reader=FileSystemReader(dir))`, from "
        "the last saves above, so the files are in the page cache (warm). One untimed load "
        "of each first, checked bitwise (int32 views of every local shard on every rank, "
        "and the values); then the timed loads, order alternating, median of "
        f"{load_repeats or repeats} (loads take about a second and vary most when 4 ranks "
        "share 2 cores, so they repeat more often than saves).",
        "- Profiles (only for a ratio below its target): one extra run of each side under "
        f"`py-spy record --nonblocking --idle --rate {PROFILE_RATE}` attached to rank 0, "
        "every Python thread sampled, blocked ones too (a thread in `fsync` or waiting for "
        "other ranks counts). Each sample is named by the source line of its innermost "
        "frame (the line that called into C: `os.fsync(fd)` is fsync); frames in c10d are "
        "collectives, frames in thread-pool/lock code are idle waits and left out. "
        "thread-s = samples / rate, summed over threads (they overlap, so it can exceed the "
        "run's wall time); the cause line lists the stages where stepvault's rank 0 spent "
        "more thread time than DCP's, with the hottest line of each. One run each, on a "
        "noisy machine: read differences below ~0.1 thread-s as noise.",
        "",
    ]
    return "\n".join(lines), all_rows


def write_section(path: Path, section: str) -> None:
    """Replace only this script's section of ``path`` (re-read right before writing)."""
    _common.write_section(path, "dist", section)


# -- main -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mb", type=float, default=600.0, help="global state size (600)")
    ap.add_argument(
        "--repeats", type=int, default=5, help="repeats of each save (median; the VM varies 2x)"
    )
    ap.add_argument("--load-repeats", type=int, default=5, help="repeats of each load (median)")
    ap.add_argument(
        "--out", type=Path, default=REPO / "BENCHMARKS.md", help="markdown file to update"
    )
    ap.add_argument(
        "--workdir",
        type=Path,
        default=REPO / "bench-out" / "bench-dist",
        help="private scratch folder, emptied first (default: <repo>/bench-out/bench-dist)",
    )
    ap.add_argument("--no-profile", action="store_true", help="skip the py-spy runs of misses")
    ap.add_argument("--worlds", default="1,2,4", help="comma-separated world sizes (default 1,2,4)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.load_repeats < 1 or args.size_mb <= 0:
        ap.error("--repeats and --load-repeats must be >= 1 and --size-mb > 0")
    worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    if not worlds or min(worlds) < 1:
        ap.error("--worlds: positive integers")

    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    work = args.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    (work / "out").mkdir(parents=True)
    command = _common.command_line("bench_dist.py", argv)
    facts = machine_facts(work)
    for k, v in facts.items():
        log(f"{k}: {v}")
    shape = shape_for(args.size_mb)
    log(f"state: {shape.describe()}, {shape.state_bytes() / GB:.3f} GB")
    cfg = {
        "work": str(work),
        "out": str(work / "out"),
        "repeats": args.repeats,
        "load_repeats": args.load_repeats,
        "shape": asdict(shape),
        "profile": not args.no_profile,
    }
    results = []
    try:
        for world in worlds:
            t0 = time.perf_counter()
            log(f"world size {world}: spawning {world} process(es)")
            results.append(spawn_world(world, cfg))
            log(f"world size {world} done in {time.perf_counter() - t0:.1f} s")
    finally:
        for p in work.iterdir():  # keep only out/ (results and profiles)
            if p.name != "out":
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()
    facts["load average at end"] = load_average()
    runtime = time.perf_counter() - t_start
    section, rows = render(command, facts, shape, results, args.repeats, runtime, args.load_repeats)
    write_section(args.out, section)
    print()
    print(
        table(
            ["world", "metric", "target", "measured", "result"],
            [[str(w), r.metric, r.target, r.measured, r.verdict] for w, r in rows],
        )
    )
    for res in results:
        for line in miss_causes(res):
            print(line)
    print(f"\ntotal runtime {runtime:.1f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
