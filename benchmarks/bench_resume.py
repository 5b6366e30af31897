#!/usr/bin/env python
"""Resume a real training state after a crash: a GPT-2-shaped model and its AdamW state,
restored into a freshly built model and a fresh optimizer in a new process, then trained on.
Rewrites the ``resume`` section of BENCHMARKS.md::

    python benchmarks/bench_resume.py [--size-mb 1500] [--repeats 3] [--out BENCHMARKS.md]

What a restart costs is the restore *and* the first training step after it: a restore
that hands out optimizer moments as views of file mappings (or of memory never touched)
moves its cost into the first ``optimizer.step()``, one page fault at a time. So each
child process builds the model and ``torch.optim.AdamW`` (no state yet), restores, sets
gradients and times two ``optimizer.step()`` calls. Compared, each with the page cache
warm (right after the save) and cold (the checkpoint's files dropped from it):

- **stepvault**: ``stepvault.restore(root, {"model": model, "optimizer": opt}, run=...)``
  (every object BLAKE3-verified first; ``CheckpointManager.restore`` does the same and then
  prepares the staging memory of the first asynchronous save in the background);
- **torch.load**: ``torch.load(path, weights_only=True)`` of one ``torch.save`` file, then
  ``model.load_state_dict`` and ``opt.load_state_dict``; and the same with ``mmap=True``;
- **DCP**: ``torch.distributed.checkpoint.load`` of ``get_state_dict(model, opt)``, then
  ``set_state_dict`` (the torchtitan recipe; no process group).

Every child checks that its restored state equals the saved one bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common
import numpy as np
import torch
from _common import REPO, build_module, fmt_bytes, shape_for, table
from bench_mem import drop_page_cache

import stepvault
from stepvault import CheckpointManager

RUN = "bench"
MODES = ("stepvault", "torch", "torch-mmap", "dcp")
LABELS = {
    "stepvault": "`stepvault.restore`",
    "torch": "`torch.load(weights_only=True)` + `load_state_dict`",
    "torch-mmap": "`torch.load(mmap=True, weights_only=True)` + `load_state_dict`",
    "dcp": "DCP `dcp.load` + `set_state_dict`",
}


def make_training_state(size_mb: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A GPT-2-shaped module and an AdamW over it; with ``seed`` 0 it has taken one step."""
    gen = torch.Generator().manual_seed(seed)
    shape = shape_for(size_mb)
    params = {n: torch.randn(s, generator=gen) * 0.02 for n, s in shape.params().items()}
    model = build_module(params)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1)
    if seed == 0:
        set_grads(model, seed=2)
        opt.step()
    return model, opt


def set_grads(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 0.01


def fingerprint(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """BLAKE3 of every parameter and optimizer tensor's bytes, in order (bitwise equality)."""
    import blake3

    h = blake3.blake3()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
        for v in opt.state[p].values():
            h.update(v.contiguous().numpy().tobytes())
    return h.hexdigest()


def save_all(root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Path]:
    """The same state written by each library; the durable write is not what is measured."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    paths = {"stepvault": root / "stepvault", "torch": root / "state.pt", "dcp": root / "dcp"}
    mgr = CheckpointManager(paths["stepvault"], RUN, async_save=False, lineage=False)
    mgr.save(1, {"model": model, "optimizer": opt}, force=True)
    mgr.close()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, paths["torch"])
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(paths["dcp"]))
    for p in paths.values():
        _common.fsync_tree(p) if p.is_dir() else _common.fsync_file(p)
    return paths


def restore(mode: str, path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    if mode == "stepvault":
        info = stepvault.restore(path, {"model": model, "optimizer": opt}, run=RUN, mem=False)
        assert info is not None and info.step == 1, info
    elif mode in ("torch", "torch-mmap"):
        sd = torch.load(path, weights_only=True, mmap=mode == "torch-mmap")
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optimizer": osd}
        dcp.load(sd, checkpoint_id=str(path))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])


def child(args: argparse.Namespace) -> None:
    """One restart in this fresh process; prints the seconds of each phase as JSON."""
    import warnings

    warnings.filterwarnings("ignore")  # DCP without a process group says so on every call
    prime_memory(int(args.prime_gb * 1e9))
    model, opt = make_training_state(args.size_mb, seed=1)
    t0 = time.perf_counter()
    restore(args.child, Path(args.path), model, opt)
    seconds = time.perf_counter() - t0
    ok = fingerprint(model, opt) == args.expect
    set_grads(model, seed=3)
    steps = []
    for _ in range(2):
        t = time.perf_counter()
        opt.step()
        steps.append(time.perf_counter() - t)
    print(json.dumps({"restore": seconds, "step1": steps[0], "step2": steps[1], "ok": ok}))


def prime_memory(nbytes: int) -> None:
    """Touch and free ``nbytes`` of anonymous memory. On a VM whose host backs guest memory
    lazily, the first touch of a guest page costs a host fault (measured here: 1 GiB filled
    in 2.3 s the first time, 0.13 s once the pages had been used); priming makes every
    library's fresh allocations cost what they cost on a machine with its memory backed, and
    the same for all of them, whichever child ran before."""
    if nbytes > 0:
        scratch = np.ones(nbytes, dtype=np.uint8)
        del scratch


def run_child(mode: str, path: Path, expect: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--size-mb", str(args.size_mb)]
    cmd += ["--path", str(path), "--expect", expect, "--prime-gb", str(args.prime_gb)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} restore failed: {out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if not r["ok"]:
        raise RuntimeError(f"{mode}: the restored state differs from the saved one")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument(
        "--prime-gb",
        type=float,
        default=None,
        help="anonymous memory each child touches and frees first (default: 2.5x the state)",
    )
    ap.add_argument("--child", choices=MODES)  # child mode (internal)
    ap.add_argument("--path")
    ap.add_argument("--expect")
    args = ap.parse_args()
    if args.child:
        return child(args)

    t_start = time.perf_counter()
    facts = _common.machine_facts(args.workdir or REPO)
    shape = shape_for(args.size_mb)
    if args.prime_gb is None:
        args.prime_gb = round(2.5 * shape.state_bytes() / 1e9, 2)
    runs: dict[tuple[str, str], list[dict]] = {(m, c): [] for m in MODES for c in ("warm", "cold")}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        model, opt = make_training_state(args.size_mb, seed=0)
        expect = fingerprint(model, opt)
        size = sum(p.nbytes for p in model.parameters())
        size += sum(v.nbytes for s in opt.state.values() for v in s.values())
        paths = save_all(Path(tmp), model, opt)
        del model, opt
        paths["torch-mmap"] = paths["torch"]
        for _ in range(args.repeats):
            for mode in MODES:
                runs[mode, "warm"].append(run_child(mode, paths[mode], expect, args))
                if paths[mode].is_dir():
                    drop_page_cache(paths[mode])
                else:
                    drop_page_cache_file(paths[mode])
                runs[mode, "cold"].append(run_child(mode, paths[mode], expect, args))
        shutil.rmtree(tmp, ignore_errors=True)

    def med(mode: str, cache: str, key: str) -> float:
        return _common.median([r[key] for r in runs[mode, cache]])

    def first(mode: str, cache: str) -> float:
        return _common.median([r["restore"] + r["step1"] for r in runs[mode, cache]])

    body = []
    for cache in ("warm", "cold"):
        base = first("torch", cache)
        for mode in MODES:
            body.append(
                [
                    cache,
                    LABELS[mode],
                    f"{med(mode, cache, 'restore'):.2f}",
                    f"{med(mode, cache, 'step1'):.2f}",
                    f"{med(mode, cache, 'step2'):.2f}",
                    f"{first(mode, cache):.2f}",
                    f"{first(mode, cache) / base:.2f}x",
                ]
            )
    lines = _common.section_head(
        "Resume a training state: restore + the first optimizer step",
        _common.command_line("bench_resume.py", sys.argv[1:]),
        time.perf_counter() - t_start,
        facts,
    )
    lines += [
        f"State: {shape.describe()}, fp32, and its `torch.optim.AdamW` state "
        f"(exp_avg, exp_avg_sq): {fmt_bytes(size)}. Each restart in a fresh process: the "
        "model and a fresh optimizer are built, the checkpoint restored, gradients set and "
        f"two `optimizer.step()` calls timed (seconds, median of {args.repeats}; every "
        "restore checked bitwise against the saved state). Cold: the checkpoint's files "
        "dropped from the page cache first. Each child first touches and frees "
        f"{args.prime_gb:g} GB of memory (this VM's host backs guest memory lazily: the "
        "first touch of a page costs a host fault, which would land on whichever library "
        "allocated first).",
        "",
        table(
            [
                "page cache",
                "restore with",
                "restore",
                "1st step",
                "2nd step",
                "restore + 1st step",
                "vs torch.load",
            ],
            body,
        ),
        "",
        "- The second step is the steady training step; a first step slower than it is the "
        "restore's cost showing up late: tensors that are views of a file mapping "
        "(`mmap=True`) copy each page on its first write, inside the step.",
        "- stepvault verifies every object (BLAKE3) before it touches the live state, and "
        "builds the optimizer moments in fresh memory with every core's copy (huge pages "
        "where the kernel gives them), so its first step costs what the second does.",
    ]
    section = "\n".join(lines)
    _common.write_section(args.out, "resume", section)
    print(section)


def drop_page_cache_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
