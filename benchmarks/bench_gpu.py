#!/usr/bin/env python
"""GPU save path: training-thread stall and throughput of ``CheckpointManager`` saves of a
CUDA state against DCP ``async_save`` of the same state::

    python benchmarks/bench_gpu.py [--size-mb 1024] [--saves 5] [--workdir DIR]

Without a CUDA device it prints why and exits 0 (nothing is measured).

Both savers get the same model (``nn.Linear`` layers on the GPU) and AdamW state, one
training step between saves (its time is measured too: a device-to-host copy still running
on the side stream delays its kernels). stepvault: staging prepared first (``mgr.prepare``,
pinned host buffers), stall = ``handle.stall_seconds`` (enqueue of the copies on a side
stream), throughput = logical bytes / (stall + background write). DCP: ``async_save`` into
a ``FileSystemWriter`` on a one-rank gloo group, stall = the call's wall time (its
staging), throughput = bytes / time until its future is done. Medians over the later saves
(the first of each warms up).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch


def _model(size_mb: int) -> torch.nn.Module:
    width = 4096
    layers = max(1, int(size_mb * 1e6 / 3 / (width * width * 4)))  # params + 2 Adam moments
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).cuda()


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    t0 = time.perf_counter()
    x = torch.randn(64, 4096, device="cuda")
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(p.nbytes for p in model.parameters())
    n += sum(t.nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    return n


def bench_stepvault(model, opt, root: Path, saves: int) -> dict[str, list[float]]:
    import stepvault

    out: dict[str, list[float]] = {"stall": [], "next_step": [], "throughput": []}
    state = {"model": model, "optimizer": opt}
    with stepvault.CheckpointManager(root, "gpu", async_save=True, lineage=False) as mgr:
        mgr.prepare(state, wait=True)
        for i in range(saves):
            _step(model, opt)
            handle = mgr.save(i + 1, state)
            out["next_step"].append(_step(model, opt))  # overlaps the copy and the write
            info = handle.result()
            out["stall"].append(handle.stall_seconds)
            out["throughput"].append(info.logical_bytes / (handle.stall_seconds + info.seconds))
    return out


def bench_dcp(model, opt, root: Path, saves: int) -> dict[str, list[float]]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out: dict[str, list[float]] = {"stall": [], "next_step": [], "throughput": []}
    nbytes = _bytes(model, opt)
    for i in range(saves):
        _step(model, opt)
        msd, osd = get_state_dict(model, opt)
        t0 = time.perf_counter()
        future = dcp.async_save(
            {"model": msd, "optim": osd},
            storage_writer=dcp.FileSystemWriter(str(root / f"dcp-{i}")),
            process_group=dist.group.WORLD,
        )
        stall = time.perf_counter() - t0
        out["next_step"].append(_step(model, opt))
        future.result()
        out["stall"].append(stall)
        out["throughput"].append(nbytes / (time.perf_counter() - t0))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024, help="model + optimizer state size")
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench_gpu: no CUDA device (torch.cuda.is_available() is False): nothing "
            "measured. Run it on a machine with a GPU and a CUDA build of torch."
        )
        return 0
    import torch.distributed as dist

    work = Path(tempfile.mkdtemp(prefix="bench-gpu-", dir=args.workdir))
    try:
        dist.init_process_group("gloo", init_method=f"file://{work / 'pg'}", rank=0, world_size=1)
        torch.manual_seed(0)
        model = _model(args.size_mb)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        _step(model, opt)  # creates the Adam moments
        bare = statistics.median(_step(model, opt) for _ in range(5))
        nbytes = _bytes(model, opt)
        results = {
            "stepvault": bench_stepvault(model, opt, work / "sv", args.saves),
            "dcp async_save": bench_dcp(model, opt, work, args.saves),
        }
        print(
            f"GPU: {torch.cuda.get_device_name()}  state {nbytes / 1e9:.2f} GB  "
            f"training step alone {bare * 1e3:.1f} ms  (median of later saves)"
        )
        print(f"{'saver':16} {'stall':>10} {'next step':>10} {'throughput':>12}")
        for name, r in results.items():
            later = {k: v[1:] or v for k, v in r.items()}
            print(
                f"{name:16} {statistics.median(later['stall']) * 1e3:8.1f}ms "
                f"{statistics.median(later['next_step']) * 1e3:8.1f}ms "
                f"{statistics.median(later['throughput']) / 1e9:9.2f}GB/s"
            )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    sys.exit(main())
