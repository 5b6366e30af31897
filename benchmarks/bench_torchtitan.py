#!/usr/bin/env python
"""torchtitan through stepvault (issue 30): the same 2-rank torchtitan job (its own Trainer
and entry point, the llama3 debug model under FSDP2, torchrun, gloo on CPU) checkpointing
through ``StepvaultCheckpointManager`` against torchtitan's own DCP checkpointer, sync
(``async_mode="disabled"``) and async (``async_mode="async"``). Measured in one run, the
modes alternating: the stall of a save (how long ``checkpointer.save`` holds the loop,
rank 0), the time until it is durable (the save then its wait), the step without a save,
and the bytes stored after every save (all kept: ``keep_last=0`` / ``keep_latest_k=0``).

torchtitan runs in its own environment (``.venv-torchtitan``, built once by
tests/torchtitan_env.py); the job is tests/scripts/torchtitan_train.py, whose test-only
patches make torchtitan run on CPU. Rewrites the section between
``<!-- torchtitan:begin -->`` and ``<!-- torchtitan:end -->`` of BENCHMARKS.md::

    python benchmarks/bench_torchtitan.py [--saves 10] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
TESTS = HERE.parent / "tests"

SECTION = "torchtitan"
#: mode -> (the job's checkpointer, torchtitan's options for it)
MODES: dict[str, tuple[str, list[str]]] = {
    "dcp-sync": ("dcp", ["--checkpoint.async_mode", "disabled", "--checkpoint.keep_latest_k", "0"]),
    "dcp-async": ("dcp", ["--checkpoint.async_mode", "async", "--checkpoint.keep_latest_k", "0"]),
    "stepvault": ("stepvault", ["--checkpoint.keep_last", "0"]),
}
LABELS = {
    "dcp-sync": "torchtitan DCP, sync",
    "dcp-async": "torchtitan DCP, async_mode=async",
    "stepvault": "stepvault (async_save)",
}


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_job(python: Path, assets: Path, mode: str, dump: Path, saves: int) -> dict[str, Any]:
    checkpointer, options = MODES[mode]
    timings = dump.parent / f"{dump.name}.json"
    cmd = [
        str(python), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(TESTS / "scripts" / "torchtitan_train.py"), str(assets), str(dump), str(dump / "out"),
        "--checkpointer", checkpointer, "--timings", str(timings),
        "--training.steps", str(saves), "--checkpoint.interval", "1", *options,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    begin = time.perf_counter()
    subprocess.run(
        cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        timeout=1200,
    )  # fmt: skip
    out: dict[str, Any] = json.loads(timings.read_text())
    out["wall"] = time.perf_counter() - begin
    out["bytes"] = du(dump / "checkpoint")
    if len(out["stall"]) != saves:
        raise RuntimeError(f"{mode}: {len(out['stall'])} saves, expected {saves}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--saves", type=int, default=10, help="steps, one save after each")
    ap.add_argument("--rounds", type=int, default=1, help="jobs per mode (medians over all)")
    ap.add_argument(
        "--no-build",
        action="store_true",
        help="skip (exit 0) unless .venv-torchtitan is built already (run_all's quick run)",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    import _common
    from _common import REPO, machine_facts, table

    sys.path.insert(0, str(TESTS))
    import torchtitan_env

    out_md = args.out or REPO / "BENCHMARKS.md"
    t_all = time.perf_counter()
    try:
        python = torchtitan_env.ready() if args.no_build else torchtitan_env.build()
    except torchtitan_env.RegistryUnreachable as exc:
        print(f"skipped: {exc}")
        return
    if python is None:
        print(f"skipped: {torchtitan_env.VENV.name} is not built (--no-build)")
        return
    work = Path(tempfile.mkdtemp(prefix="bench-torchtitan-", dir=args.workdir))
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    try:
        assets = work / "assets"
        subprocess.run(
            [str(python), str(TESTS / "scripts" / "torchtitan_assets.py"), str(assets)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        # The modes alternate, so that each sees the same drift of a shared machine.
        for r in range(args.rounds):
            for mode in MODES:
                dump = work / f"{mode}-{r}"
                results[mode].append(run_job(python, assets, mode, dump, args.saves))
                shutil.rmtree(dump, ignore_errors=True)
                print(mode, {k: results[mode][-1][k] for k in ("wall", "bytes")})
        facts = machine_facts(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def median(mode: str, key: str) -> float:
        return statistics.median(v for run in results[mode] for v in run[key])

    def mb(mode: str) -> float:
        return statistics.median(run["bytes"] for run in results[mode]) / 1e6

    rows = [
        [
            LABELS[mode],
            f"{median(mode, 'stall') * 1000:.0f} ms",
            f"{median(mode, 'durable') * 1000:.0f} ms",
            f"{median(mode, 'step') * 1000:.0f} ms",
            f"{mb(mode):.1f} MB",
        ]
        for mode in MODES
    ]
    sv = median("stepvault", "stall")
    lines = _common.section_head(
        "torchtitan through stepvault (issue 30)",
        "python benchmarks/bench_torchtitan.py",
        time.perf_counter() - t_all,
        facts,
    )
    lines += [
        "### Results",
        "",
        "A 2-rank torchtitan 0.3.0 job (its own Trainer, torchrun, gloo, CPU): the llama3 "
        "debug model under FSDP2 (float32, AdamW), seq 64, batch 2, "
        f"{args.saves} steps with a save after each; {args.rounds} job(s) per mode, "
        "medians over the saves. Stall: how long `checkpointer.save` holds the loop on "
        "rank 0; durable: the save and its wait (background write, commit).",
        "",
        table(
            [
                "checkpointing",
                "stall of a save (rank 0)",
                "save until durable",
                "step without a save",
                f"bytes stored after {args.saves} saves",
            ],
            rows,
        ),
        "",
        f"Stall of a save: stepvault / DCP sync = {sv / median('dcp-sync', 'stall'):.2f}, "
        f"stepvault / DCP async = {sv / median('dcp-async', 'stall'):.2f}. Save until "
        "durable: stepvault / DCP sync = "
        f"{median('stepvault', 'durable') / median('dcp-sync', 'durable'):.2f}. Bytes: "
        f"stepvault / DCP = {mb('stepvault') / mb('dcp-sync'):.2f} (every weight and "
        "moment changes at each step: nothing to share between saves).",
    ]
    _common.write_section(out_md, SECTION, "\n".join(lines) + "\n")
    print(f"wrote the {SECTION} section of {out_md}")


if __name__ == "__main__":
    main()
