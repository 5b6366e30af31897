#!/usr/bin/env python
"""Core benchmark: durable save, dedup, async stall, restore and the float codec, measured here.

One command measures everything in one run and rewrites the section between
``<!-- core:begin -->`` and ``<!-- core:end -->`` of BENCHMARKS.md (the rest is kept)::

    python benchmarks/bench_core.py [--size-mb N] [--repeats R] [--out BENCHMARKS.md]

What it measures:

1. A GPT-2-small-shaped fp32 state with AdamW-like moments (~1.5 GB at the default size);
   ``--size-mb`` scales the number of blocks (then vocabulary, then width) down.
2. Durable save throughput (logical GB/s, fsync included, median of R) of safetensors,
   torch.save, stepvault (codec raw and auto) and a plain sequential write (the disk limit).
   An untimed priming write and ``os.sync()`` before each timed write; the order of writers
   rotates every repeat.
3. A second, unchanged save into the same store: time and new bytes relative to the first.
4. Restore into existing tensors: safetensors (load_file + copy_) vs stepvault.restore,
   warm (files in the page cache) and cold (``sync`` + drop_caches, then a fresh process),
   with a cold sequential read of the safetensors file as the disk's reading limit.
5. ``CheckpointManager`` saves of the same state as an ``nn.Module`` plus an optimizer-like
   dict: the training-thread stall of asynchronous saves (first and later ones) against a
   synchronous save, the host memory held for staging and the background write time.
6. The float codec on real weights (all-MiniLM-L6-v2), fp32 and a bf16 cast, against
   zstd-3 and zipnn, single thread.

The cold-restore children are this script run with the hidden ``--cold-child`` option.
Each part is a module of ``benchmarks/_core/`` (save, restore, cold, stall, codecs), the
verdicts are in ``_core/rows.py`` and the markdown in ``_core/report.py``; this file is the
command line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when loaded by path
import _common
from _common import GB, REPO, build_state, load_average, make_prime, shape_for, table
from _core.base import COLD_CHILD, machine_facts
from _core.codecs import bench_codecs
from _core.cold import cold_child
from _core.report import codec_json, print_results, render
from _core.restore import bench_restore
from _core.rows import codec_rows, evaluate
from _core.save import bench_save
from _core.stall import bench_async


def codecs_only(repeats: int, json_path: Path | None) -> int:
    """``--codecs-only``: part 6 alone, printed (the markdown file is not touched)."""
    t_start = time.perf_counter()
    codecs, source = bench_codecs(
        repeats, lambda msg: print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)
    )
    rows = codec_rows(codecs)
    print(f"\n{source}; median of {repeats}; load average now {load_average()}\n")
    print(
        table(
            ["codec", "dtype", "ratio", "encode MB/s", "decode MB/s"],
            [
                [name, c.dtype, f"{c.ratio[name]:.3f}", f"{c.enc[name]:.0f}", f"{c.dec[name]:.0f}"]
                for c in codecs
                for name in c.ratio
            ],
        )
    )
    print()
    print(
        table(
            ["float codec stage (same loop, median)", "dtype", "seconds"],
            [[k, c.dtype, f"{v:.4f}"] for c in codecs for k, v in c.breakdown.items()],
        )
    )
    print()
    print_results(rows)
    if json_path:
        data = {"codecs": codec_json(codecs), "rows": [r.__dict__ for r in rows]}
        json_path.write_text(json.dumps(data, indent=1))
    return 0


def write_section(path: Path, section: str) -> None:
    """Replace only this script's section of ``path`` (re-read right before writing)."""
    _common.write_section(path, "core", section)


# -- main -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == COLD_CHILD:
        return cold_child(argv[1:])
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--size-mb",
        type=float,
        default=None,
        help="state size (default: full GPT-2 small, ~1.5 GB)",
    )
    ap.add_argument("--repeats", type=int, default=5, help="repeats of each save (median)")
    ap.add_argument(
        "--restore-repeats", type=int, default=5, help="repeats of each warm restore (median)"
    )
    ap.add_argument(
        "--cold-repeats",
        type=int,
        default=5,
        help="repeats of each cold restore (median; 0 skips the cold restore)",
    )
    ap.add_argument(
        "--async-repeats",
        type=int,
        default=3,
        help="fresh async managers (each: a first save and later ones) and sync saves (median)",
    )
    ap.add_argument(
        "--async-saves", type=int, default=3, help="saves per async manager (first + later)"
    )
    ap.add_argument(
        "--codec-repeats", type=int, default=7, help="repeats of each codec run (median)"
    )
    ap.add_argument(
        "--codecs-only",
        action="store_true",
        help="run only part 6 (the float codec against zstd-3 and zipnn, ~1 min): print its "
        "rows and stage times; --out is left alone (--json is still written)",
    )
    ap.add_argument(
        "--out", type=Path, default=REPO / "BENCHMARKS.md", help="markdown file to update"
    )
    ap.add_argument(
        "--workdir", type=Path, default=None, help="scratch parent (default: <repo>/bench-out)"
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args(argv)
    if min(args.repeats, args.restore_repeats, args.codec_repeats) < 1 or args.cold_repeats < 0:
        ap.error("repeats must be >= 1")
    if args.async_repeats < 1 or args.async_saves < 2:
        ap.error("--async-repeats must be >= 1 and --async-saves >= 2 (a first and a later save)")

    if args.codecs_only:
        return codecs_only(args.codec_repeats, args.json)

    t_start = time.perf_counter()
    parent = args.workdir or REPO / "bench-out"
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-core-", dir=parent))

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    command = _common.command_line("bench_core.py", argv)
    try:
        facts = machine_facts(work)
        for k, v in facts.items():
            log(f"{k}: {v}")
        shape = shape_for(args.size_mb)
        state, flat = build_state(shape)
        log(f"state: {shape.describe()}, {sum(t.nbytes for t in flat.values()) / GB:.3f} GB")
        save = bench_save(state, flat, work, args.repeats, log)
        restore = bench_restore(flat, shape, work, args.restore_repeats, args.cold_repeats, log)
        # Last user of the state: it changes the tensors in place between saves.
        manager = bench_async(
            state,
            flat,
            work,
            args.async_repeats,
            args.async_saves,
            make_prime(flat, work),
            log,
        )
        del state, flat
        codecs, source = bench_codecs(args.codec_repeats, log)
        rows = evaluate(shape, save, restore, manager, codecs)
        facts["load average at end"] = load_average()
        runtime = time.perf_counter() - t_start
        section = render(
            command,
            facts,
            shape,
            save,
            restore,
            manager,
            codecs,
            source,
            rows,
            args,
            runtime,
        )
        write_section(args.out, section)
        if args.json:
            data = {"codecs": codec_json(codecs), "rows": [r.__dict__ for r in rows]}
            args.json.write_text(json.dumps(data, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print_results(rows)
    print(f"\ntotal runtime {runtime:.1f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
