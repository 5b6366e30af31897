#!/usr/bin/env python
"""Scale benchmark: listing runs of 1k and 10k checkpoints, and saving 10k small tensors.

Rewrites the section between ``<!-- scale:begin -->`` and ``<!-- scale:end -->`` of
BENCHMARKS.md::

    python benchmarks/bench_scale.py [--counts 1000,10000] [--small 10000] [--out BENCHMARKS.md]

1. Runs of N checkpoints (real ``stepvault.save`` calls, one small model each time with a
   metric): ``Vault.checkpoints(run)`` (the API behind ``stepvault ls RUN``) the first time
   and again, and the ``stepvault ls RUN --json`` command in a fresh process (with the
   command's start-up measured alone on an empty store).
2. A state of ``--small`` tensors of 256 fp32 each against one tensor holding the same
   bytes: ``stepvault.save`` (fresh store each time), ``torch.save``+fsync and
   ``safetensors.save_file``+fsync; the per-tensor overhead; and restoring it.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when loaded by path
import _common
from _common import (
    REPO,
    Row,
    facts_line,
    fmt_bytes,
    fsync_dir,
    fsync_file,
    machine_facts,
    median,
    remove,
    secs,
    table,
    verdict,
)

import stepvault

SECTION = "scale"
LIST_TARGET = 1.0  # seconds to list 10k checkpoints
LS_TARGET = 1.5  # seconds for `stepvault ls RUN` of 10k checkpoints to draw (a new process)
SMALL_NUMEL = 256


@dataclass
class Listing:
    count: int
    create_s: float = 0.0
    manifest_bytes: int = 0
    first: float = 0.0
    again: list[float] = field(default_factory=list)
    cli: list[float] = field(default_factory=list)
    rows: int = 0
    uncached: float = 0.0  # a listing with the run's summary files removed (full parse)
    page: list[float] = field(default_factory=list)  # `stepvault ls RUN` (newest page)
    every: list[float] = field(default_factory=list)  # `stepvault ls RUN --limit 0`


@dataclass
class Small:
    count: int
    times: dict[str, list[float]] = field(default_factory=dict)
    restore: dict[str, list[float]] = field(default_factory=dict)


def small_model() -> torch.nn.Module:
    """24 linear layers of 64x64 (48 tensors, ~400 kB): a manifest of realistic shape."""
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(24)])


def bench_listing(
    counts: list[int], work: Path, cli_repeats: int, log: Callable[[str], None]
) -> list[Listing]:
    out = []
    empty = work / "empty-store"
    stepvault.save(empty, {"x": torch.zeros(1)}, run="other", step=0)
    exe = shutil.which("stepvault") or str(Path(sys.executable).parent / "stepvault")
    startup = []
    for _ in range(cli_repeats):
        t0 = time.perf_counter()
        subprocess.run([exe, "ls", "--root", str(empty), "--json"], check=True, capture_output=True)
        startup.append(time.perf_counter() - t0)
    for n in counts:
        root = work / f"list-{n}"
        model = small_model()
        state = {"model": model}
        res = Listing(n)
        t0 = time.perf_counter()
        for step in range(n):
            with torch.no_grad():
                model[step % 24].bias[0] = step  # every checkpoint differs a little
            stepvault.save(root, state, run="run", step=step, metrics={"loss": 1 / (step + 1)})
        res.create_s = time.perf_counter() - t0
        res.manifest_bytes = (root / "runs/run/checkpoints/0.json").stat().st_size
        log(f"  created {n} checkpoints in {res.create_s:.1f} s")
        vault = stepvault.open(root)
        t0 = time.perf_counter()
        first = vault.checkpoints("run")
        res.first = time.perf_counter() - t0
        res.rows = len(first)
        if res.rows != n or any(s.error for s in first):
            raise SystemExit(f"listing returned {res.rows} rows of {n}, or damaged ones")
        for _ in range(3):
            t0 = time.perf_counter()
            again = stepvault.open(root).checkpoints("run")
            res.again.append(time.perf_counter() - t0)
        if [s.step for s in again] != list(range(n)) or again[-1].metrics != first[-1].metrics:
            raise SystemExit("a second listing differs from the first")
        for name in ("summaries.json", "summaries.log"):
            (root / "runs/run" / name).unlink(missing_ok=True)
        t0 = time.perf_counter()
        uncached = stepvault.open(root).checkpoints("run")
        res.uncached = time.perf_counter() - t0
        if [(s.step, s.metrics) for s in uncached] != [(s.step, s.metrics) for s in first]:
            raise SystemExit("the listing without summary cache differs")
        for _ in range(cli_repeats):
            t0 = time.perf_counter()
            proc = subprocess.run(
                [exe, "ls", "run", "--root", str(root), "--json"],
                check=True,
                capture_output=True,
            )
            res.cli.append(time.perf_counter() - t0)
        if len(json.loads(proc.stdout)) != n:
            raise SystemExit("stepvault ls listed the wrong number of checkpoints")
        for extra, times, lines in (([], res.page, min(n, 50)), (["--limit", "0"], res.every, n)):
            for _ in range(cli_repeats):  # as printed for a person (plain lines: a pipe)
                t0 = time.perf_counter()
                proc = subprocess.run(
                    [exe, "ls", "run", "--root", str(root), *extra],
                    check=True,
                    capture_output=True,
                )
                times.append(time.perf_counter() - t0)
            if len(proc.stdout.splitlines()) != lines + 1:  # + the header line
                raise SystemExit(f"stepvault ls {extra} printed the wrong number of lines")
        log(
            f"  list {n}: Vault.checkpoints first {res.first:.3f} s, again "
            f"{median(res.again):.3f} s, without summaries {res.uncached:.3f} s; "
            f"stepvault ls {median(res.cli):.2f} s"
        )
        out.append(res)
        remove(root)
    out[0].cli_startup = startup  # type: ignore[attr-defined]
    remove(empty)
    return out


def bench_small(count: int, work: Path, repeats: int, log: Callable[[str], None]) -> Small:
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    many = {f"t{i}": torch.randn(SMALL_NUMEL, generator=gen) for i in range(count)}
    one = {"t": torch.cat(list(many.values()))}
    res = Small(count)

    def sv(state: dict[str, torch.Tensor]) -> Callable[[Path], None]:
        return lambda path: stepvault.save(path, state, run="r", step=1) and None

    def ts(state: dict[str, torch.Tensor]) -> Callable[[Path], None]:
        def run(path: Path) -> None:
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(path.parent)

        return run

    def st(state: dict[str, torch.Tensor]) -> Callable[[Path], None]:
        def run(path: Path) -> None:
            save_file(state, str(path))
            fsync_file(path)

        return run

    cases = {
        f"stepvault.save, {count} tensors": sv(many),
        "stepvault.save, 1 tensor": sv(one),
        f"torch.save + fsync, {count} tensors": ts(many),
        "torch.save + fsync, 1 tensor": ts(one),
        f"safetensors.save_file + fsync, {count} tensors": st(many),
        "safetensors.save_file + fsync, 1 tensor": st(one),
    }
    for r in range(repeats + 1):  # the first round is a warm-up
        for name, fn in cases.items():
            path = work / "small"
            remove(path)
            t0 = time.perf_counter()
            fn(path)
            dt = time.perf_counter() - t0
            if r:
                res.times.setdefault(name, []).append(dt)
            if r == repeats and name.startswith("stepvault"):
                state = many if "1 tensor" not in name else one
                dest = {k: torch.zeros_like(v) for k, v in state.items()}
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    stepvault.restore(path, dest, run="r", step=1)
                    res.restore.setdefault(name.replace("save", "restore"), []).append(
                        time.perf_counter() - t0
                    )
                assert all(torch.equal(dest[k], state[k]) for k in state)
            remove(path)
    for name, v in {**res.times, **res.restore}.items():
        log(f"  {name}: {median(v):.3f} s")
    return res


def evaluate(listings: list[Listing], small: Small) -> list[Row]:
    rows = []
    for lst in listings:
        target = f"< {LIST_TARGET:g} s" if lst.count >= 10000 else "—"
        t = max(lst.first, median(lst.again))
        rows.append(
            Row(
                f"list {lst.count} checkpoints: Vault.checkpoints(run)",
                target,
                f"{lst.first:.3f} s the first time, {median(lst.again):.3f} s again",
                verdict(t < LIST_TARGET) if lst.count >= 10000 else "info",
                f"slowest of first and later listings {t:.3f} s",
            )
        )
        rows.append(
            Row(
                f"list {lst.count} checkpoints with the run's summary files deleted",
                "—",
                f"{lst.uncached:.3f} s ({lst.uncached / lst.count * 1e6:.0f} µs per manifest: "
                "every manifest parsed in full, as before the summaries existed)",
                "info",
            )
        )
        startup = median(getattr(listings[0], "cli_startup", [float("nan")]))
        page = median(lst.page)
        rows.append(
            Row(
                f"list {lst.count} checkpoints: `stepvault ls RUN` as printed (new process)",
                f"< {LS_TARGET:g} s" if lst.count >= 10000 else "—",
                f"{page:.2f} s for the newest {min(lst.count, 50)} (the default page); "
                f"`--limit 0`, all {lst.count} lines: {median(lst.every):.2f} s",
                verdict(page < LS_TARGET) if lst.count >= 10000 else "info",
            )
        )
        rows.append(
            Row(
                f"list {lst.count} checkpoints: `stepvault ls RUN --json` (new process)",
                "—",
                f"{median(lst.cli):.2f} s (the command's start-up alone {startup:.2f} s)",
                "info",
            )
        )
    many = f"stepvault.save, {small.count} tensors"
    one = "stepvault.save, 1 tensor"
    per = (median(small.times[many]) - median(small.times[one])) / small.count
    rows.append(
        Row(
            f"save a state of {small.count} tensors of {SMALL_NUMEL} fp32 "
            f"({fmt_bytes(small.count * SMALL_NUMEL * 4)})",
            "—",
            f"{median(small.times[many]):.3f} s vs {median(small.times[one]):.3f} s for one "
            f"tensor of the same bytes: {per * 1e6:.0f} µs per tensor (torch.save "
            f"{median(small.times[f'torch.save + fsync, {small.count} tensors']):.3f} s, "
            f"safetensors "
            f"{median(small.times[f'safetensors.save_file + fsync, {small.count} tensors']):.3f}"
            " s)",
            "info",
        )
    )
    return rows


def render(
    command: str,
    facts: dict[str, str],
    listings: list[Listing],
    small: Small,
    rows: list[Row],
    repeats: int,
    runtime: float,
) -> str:
    out = [
        "## Scale: long runs and many small tensors",
        "",
        f"Generated by `{command}` in {runtime / 60:.1f} min on {facts['date']}.",
        "",
        f"Machine: {facts_line(facts)}; load average {facts['load average at start']}.",
        "",
        table(
            ["metric", "target", "measured", "result"],
            [[r.metric, r.target, r.measured, r.verdict] for r in rows],
        ),
        "",
        table(
            [
                "checkpoints",
                "created in",
                "manifest size",
                "Vault.checkpoints first",
                "again (each)",
                "stepvault ls (each)",
            ],
            [
                [
                    str(x.count),
                    f"{x.create_s:.1f} s",
                    fmt_bytes(x.manifest_bytes),
                    f"{x.first:.3f} s",
                    secs(x.again, 3),
                    secs(x.cli),
                ]
                for x in listings
            ],
        ),
        "",
        table(
            ["save / restore", "median s", "all (s)"],
            [
                [k, f"{median(v):.3f}", secs(v, 3)]
                for k, v in {**small.times, **small.restore}.items()
            ],
        ),
        "",
        "### Method",
        "",
        "- Listing: one run per size, created by real `stepvault.save` calls of a 24-layer "
        "64x64 MLP (48 tensors) with a `loss` metric, one bias value changed per step. "
        "`Vault.checkpoints(run)` returns a summary per checkpoint (step, epoch, time, "
        "sizes, metrics, damage); every manifest is read and its checksum verified on every "
        "listing; a manifest is parsed in full only when its checksum is not in the run's "
        "summaries (`runs/<run>/summaries.log`, appended by the writer at each commit, "
        "compacted into `summaries.json` by a listing; both only caches, keyed by the "
        "manifest checksum). 'Without summaries': both files deleted first, so every "
        "manifest is parsed (the cost before this cache existed, and after a store copy "
        "that drops them). "
        "`stepvault ls RUN --json` runs as a new process (Python and library imports "
        "included; its start-up is timed alone on a store with one tiny run). "
        "`stepvault ls RUN` as printed for a person: the newest 50 by default (only those "
        "manifests are read), `--limit 0` every checkpoint, one plain aligned line each "
        "(the output is a pipe; a rich table is drawn only on a terminal, for at most 200 "
        "rows: drawing 10k rows as a table took ~8 s).",
        f"- Small tensors: {small.count} tensors of {SMALL_NUMEL} fp32 against one tensor of "
        f"the same bytes; each save into a fresh store/file, durable (fsync); median of "
        f"{repeats} after one warm-up round; restore = `stepvault.restore` into existing "
        "tensors.",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--counts", default="1000,10000", help="run lengths to list")
    ap.add_argument("--small", type=int, default=10000, help="small tensors in one state")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cli-repeats", type=int, default=3, help="runs of `stepvault ls` (median)")
    ap.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch parent")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",") if c.strip()]
    if not counts or min(counts) < 1 or args.small < 1 or args.repeats < 1:
        ap.error("--counts, --small and --repeats must be positive")
    t_start = time.perf_counter()
    parent = args.workdir or REPO / "bench-out"
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=parent))

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    command = _common.command_line("bench_scale.py", argv)
    try:
        facts = machine_facts(work)
        log(facts_line(facts))
        listings = bench_listing(counts, work, args.cli_repeats, log)
        small = bench_small(args.small, work, args.repeats, log)
        rows = evaluate(listings, small)
        runtime = time.perf_counter() - t_start
        section = render(command, facts, listings, small, rows, args.repeats, runtime)
        _common.write_section(args.out, SECTION, section)
        if args.json:
            data = {
                "listing": {
                    x.count: {
                        "first": x.first,
                        "again": median(x.again),
                        "uncached": x.uncached,
                        "cli": median(x.cli),
                    }
                    for x in listings
                },
                "rows": [r.__dict__ for r in rows],
            }
            args.json.write_text(json.dumps(data, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        table(
            ["metric", "target", "measured", "result"],
            [[r.metric, r.target, r.measured, r.verdict] for r in rows],
        )
    )
    print(f"total runtime {runtime:.1f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
