#!/usr/bin/env python
"""GPU save path: training-thread stall, the next training step and throughput of
``CheckpointManager`` saves of a CUDA state against DCP ``async_save`` of the same state,
and the restore of that state onto the GPU::

    python benchmarks/bench_gpu.py [--size-mb 1024] [--saves 5] [--workdir DIR] [--markdown F]

Without a CUDA device it prints why and exits 0 (nothing is measured). ``--device cpu``
runs the same sequence on CPU tensors (no pinned memory): a smoke run of this script
itself, which the test suite uses so that it cannot rot between GPU runs.

Every saver gets the same model (``nn.Linear(4096, 4096)`` layers on the GPU) and AdamW
state, one training step before each save and one right after it (its time is reported:
a device-to-host copy still running delays its kernels).

- stepvault async: staging prepared first (``mgr.prepare``: pinned host buffers), stall =
  ``handle.stall_seconds`` (the copies are enqueued on a side stream), throughput =
  logical bytes / (stall + background write). The first save is reported on its own.
- stepvault sync: ``async_save=False``, the reference for the stall ratio (≤ 0.1x).
- DCP ``async_save`` into a ``FileSystemWriter`` on a one-rank gloo group, twice: with its
  default stager (a fresh pageable CPU copy per call) and with one ``DefaultStager`` that
  caches pinned buffers across saves (``use_pinned_memory=True, use_non_blocking_copy=True``,
  DCP's own fast path; a stepvault ``KeptStager``, since torch 2.11's ``async_save``
  closes a caller's stager after each upload). Stall = the call's wall time, throughput =
  bytes / time until its future is done.
- Restore onto the GPU: ``stepvault.restore`` (verified) vs ``dcp.load``, into the live
  model and optimizer, median of 3.

Medians over the later saves (the first of each warms up). Every checkpoint is written to
``--workdir`` (a local disk) and removed after it is measured.
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

WIDTH = 4096
DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _model(size_mb: int) -> torch.nn.Module:
    layers = max(1, int(size_mb * 1e6 / 3 / (WIDTH * WIDTH * 4)))  # params + 2 Adam moments
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).to(DEVICE)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    t0 = time.perf_counter()
    x = torch.randn(64, WIDTH, device=DEVICE)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    _sync()
    return time.perf_counter() - t0


def _bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(p.nbytes for p in model.parameters())
    n += sum(t.nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    return n


def _result() -> dict[str, list[float]]:
    return {"stall": [], "next_step": [], "throughput": []}


def bench_stepvault(model, opt, root: Path, saves: int, async_save: bool) -> dict:
    import stepvault

    out = _result()
    state = {"model": model, "optimizer": opt}
    with stepvault.CheckpointManager(
        root, "gpu", async_save=async_save, lineage=False, keep=stepvault.KeepLast(1)
    ) as mgr:
        if async_save:
            mgr.prepare(state, wait=True)
        for i in range(saves):
            _step(model, opt)
            _sync()
            t0 = time.perf_counter()
            handle = mgr.save(i + 1, state)
            out["next_step"].append(_step(model, opt))  # overlaps the copy and the write
            info = handle.result()
            assert handle.asynchronous == async_save, "the save was not what was asked"
            if async_save:  # the training thread's part, then the background write
                stall = handle.stall_seconds
                seconds = stall + info.seconds
            else:  # the whole save ran inside save(), before the next step
                stall = seconds = time.perf_counter() - t0 - out["next_step"][-1]
            out["stall"].append(stall)
            out["throughput"].append(info.logical_bytes / seconds)
    return out


def bench_dcp(model, opt, root: Path, saves: int, pinned: bool) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    stager = None
    if pinned:
        from torch.distributed.checkpoint.staging import StagingOptions

        from stepvault.distributed.stager import KeptStager

        # DefaultStager that survives the close torch 2.11's async_save gives it after
        # each upload (which empties it: the next save fails with KeyError: <class 'type'>)
        stager = KeptStager(
            StagingOptions(
                use_pinned_memory=DEVICE == "cuda",
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=DEVICE == "cuda",
            )
        )
    out = _result()
    nbytes = _bytes(model, opt)
    try:
        for i in range(saves):
            _step(model, opt)
            msd, osd = get_state_dict(model, opt)
            _sync()
            where = root / f"dcp-{i}"
            t0 = time.perf_counter()
            future = dcp.async_save(
                {"model": msd, "optim": osd},
                storage_writer=dcp.FileSystemWriter(str(where)),
                process_group=dist.group.WORLD,
                async_stager=stager,
            )
            stall = time.perf_counter() - t0
            out["next_step"].append(_step(model, opt))
            future.result()
            seconds = time.perf_counter() - t0 - out["next_step"][-1]
            out["stall"].append(stall)
            out["throughput"].append(nbytes / seconds)
            shutil.rmtree(where, ignore_errors=True)
    finally:
        if stager is not None:
            print(f"DCP pinned stager: closed by async_save {stager.ignored_closes} times")
            stager.release()
    return out


def bench_restore(model, opt, work: Path, repeats: int = 3) -> dict[str, float]:
    """Restore the state saved once by each library back into the live GPU objects."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import stepvault

    state = {"model": model, "optimizer": opt}
    stepvault.save(work / "restore-sv", state, run="gpu", step=1, lineage=False)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(work / "restore-dcp"))
    times: dict[str, list[float]] = {"stepvault.restore": [], "dcp.load": []}
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        stepvault.restore(work / "restore-sv", state, run="gpu")
        _sync()
        times["stepvault.restore"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(work / "restore-dcp"))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        _sync()
        times["dcp.load"].append(time.perf_counter() - t0)
    shutil.rmtree(work / "restore-sv", ignore_errors=True)
    shutil.rmtree(work / "restore-dcp", ignore_errors=True)
    return {k: statistics.median(v) for k, v in times.items()}


def _pinned_copy_seconds(model, opt) -> float:
    """A bare device-to-host copy of every tensor into pinned memory (the copy's floor)."""
    tensors = list(model.parameters()) + [
        t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()
    ]
    pinned = DEVICE == "cuda"
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in tensors]
    runs = []
    for _ in range(3):
        _sync()
        t0 = time.perf_counter()
        for d, t in zip(dst, tensors, strict=True):
            d.copy_(t, non_blocking=True)
        _sync()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def _device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "none (--device cpu smoke run)"


def _table(results: dict[str, dict], nbytes: int, bare: float, copy: float, restore) -> str:
    med = statistics.median
    sync = med(results["stepvault sync"]["stall"][1:] or results["stepvault sync"]["stall"])
    lines = [
        f"GPU: {_device_name()}; torch {torch.__version__}; "
        f"{os.cpu_count()} CPU cores; state {nbytes / 1e9:.2f} GB (fp32 Linear({WIDTH}) "
        f"layers + AdamW); training step alone {bare * 1e3:.1f} ms; bare pinned "
        f"device-to-host copy of the state {copy * 1e3:.1f} ms "
        f"({nbytes / copy / 1e9:.1f} GB/s). Medians of the later saves.",
        "",
        "| saver | first stall | stall | stall / stepvault sync save | next step | "
        "save throughput |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        later = {k: (v[1:] or v) for k, v in r.items()}
        stall = med(later["stall"])
        lines.append(
            f"| {name} | {r['stall'][0] * 1e3:.1f} ms | {stall * 1e3:.1f} ms | "
            f"{stall / sync:.3f} | {med(later['next_step']) * 1e3:.1f} ms | "
            f"{med(later['throughput']) / 1e9:.2f} GB/s |"
        )
    lines += ["", "| restore onto the GPU (live model + AdamW, warm files) | seconds |"]
    lines += ["|---|---|"] + [f"| {k} | {v:.3f} s |" for k, v in restore.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024, help="model + optimizer state size")
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    global DEVICE, WIDTH
    DEVICE = args.device
    if args.size_mb < 3 * WIDTH * WIDTH * 4 / 1e6:  # smaller than one layer: narrower layers
        WIDTH = 1024
    if DEVICE == "cuda" and not torch.cuda.is_available():
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
        copy = _pinned_copy_seconds(model, opt)
        results: dict[str, dict] = {}
        failed: dict[str, str] = {}
        for name, run in (
            ("stepvault async", lambda: bench_stepvault(model, opt, work / "a", args.saves, True)),
            ("stepvault sync", lambda: bench_stepvault(model, opt, work / "s", args.saves, False)),
            ("DCP async_save", lambda: bench_dcp(model, opt, work, args.saves, False)),
            (
                "DCP async_save, pinned stager",
                lambda: bench_dcp(model, opt, work, args.saves, True),
            ),
        ):
            try:
                results[name] = run()
            except Exception as exc:  # a peer's failure is reported, not fatal to the run
                failed[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(f"{name}: {failed.get(name, 'done')}", flush=True)
            shutil.rmtree(work / "a", ignore_errors=True)
            shutil.rmtree(work / "s", ignore_errors=True)
        restore = bench_restore(model, opt, work)
        table = _table(results, nbytes, bare, copy, restore)
        if failed:
            table += "\n\nNot measured: " + "; ".join(f"{k}: {v}" for k, v in failed.items())
        print(table)
        if args.markdown is not None:
            args.markdown.write_text(table + "\n")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    sys.exit(main())
