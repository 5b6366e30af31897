#!/usr/bin/env python
"""The save pipeline at scale: a save costs the same at checkpoint 10,000 as at checkpoint 1.

Rewrites the section between ``<!-- pipeline:begin -->`` and ``<!-- pipeline:end -->`` of
BENCHMARKS.md::

    python benchmarks/bench_pipeline.py [--checkpoints 10000] [--other 100] [--out BENCHMARKS.md]

1. **Saves per second** of ``stepvault.save`` (a small model, one process) into a fresh run
   and into a run already holding ``--checkpoints`` checkpoints, alternated in rounds
   (medians). Target: the long run ≥ 0.9x the fresh one.
2. **Retention reads**: a ``CheckpointManager(keep=KeepLast(2))`` saving into a store that
   holds ``--other`` checkpoints of two other runs; manifests parsed during each save (its
   commit and its retention, deletions included), by run. Target: none of another run, a
   bounded number of its own.
3. **Backend requests per unchanged save** into an fsspec store (``memory://``, the code
   path of S3) holding a run of 10 and of ``--requests-long`` checkpoints: every backend
   call counted (a proxy for S3 requests). Target: the same for both lengths.
4. **GC's mark** over the ``--checkpoints`` store: manifests parsed with the object lists
   recorded at commit and without them (removed), and the time of each.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when loaded by path
import _common
from _common import Row, facts_line, machine_facts, median, rows_table, verdict

import stepvault
from stepvault.format import manifest as manifest_format
from stepvault.store import Store

SECTION = "pipeline"
SAVES_RATIO_TARGET = 0.9
#: Backend methods counted as requests (each is one request or more on S3).
BACKEND_CALLS = (
    "read_bytes",
    "read_range",
    "read_many",
    "put_atomic",
    "exists",
    "list",
    "delete",
    "append",
    "mtime",
    "size",
    "touch",
    "rename",
    "put_parts",
)


def small_state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(16, 4), "step": 0}


@contextmanager
def counting_parses() -> Iterator[Counter[str]]:
    """Count full manifest parses by run (``parse_manifest`` builds every manifest through
    ``_from_json``, looked up at call time, so one patch sees every caller)."""
    counts: Counter[str] = Counter()
    original = manifest_format._from_json

    def counted(doc: dict[str, Any]) -> Any:
        counts[str(doc.get("run"))] += 1
        return original(doc)

    manifest_format._from_json = counted  # type: ignore[assignment]
    try:
        yield counts
    finally:
        manifest_format._from_json = original  # type: ignore[assignment]


@contextmanager
def counting_manifest_reads() -> Iterator[Counter[str]]:
    """Count manifests read from the store (parsed or not), by run."""
    counts: Counter[str] = Counter()
    one, many = Store.read_manifest, Store.read_manifests

    def read_manifest(self: Store, run: str, step: int) -> bytes:
        counts[run] += 1
        return one(self, run, step)

    def read_manifests(self: Store, run: str, steps: Any) -> Any:
        steps = list(steps)
        counts[run] += len(steps)
        return many(self, run, steps)

    Store.read_manifest = read_manifest  # type: ignore[method-assign]
    Store.read_manifests = read_manifests  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        Store.read_manifest = one  # type: ignore[method-assign]
        Store.read_manifests = many  # type: ignore[method-assign]


def count_backend_calls(store: Store) -> Counter[str]:
    """Wrap ``store.backend``'s request methods on the instance; returns the live counter."""
    counts: Counter[str] = Counter()
    backend = store.backend
    for name in BACKEND_CALLS:
        method = getattr(backend, name, None)
        if method is None:
            continue

        def wrapped(*a: Any, __m: Callable[..., Any] = method, __n: str = name, **k: Any) -> Any:
            counts[__n] += 1
            return __m(*a, **k)

        setattr(backend, name, wrapped)
    return counts


def fill_run(root: Any, run: str, count: int, state: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    for step in range(count):
        state["step"] = step
        stepvault.save(root, state, run=run, step=step)
    return time.perf_counter() - t0


def saves_per_second(root: Path, long_run: str, start: int, args: argparse.Namespace) -> Row:
    state = small_state()
    fresh, long = [], []
    for r in range(args.rounds):
        for which in ("fresh", "long") if r % 2 == 0 else ("long", "fresh"):
            run = f"fresh{r}" if which == "fresh" else long_run
            first = 0 if which == "fresh" else start + r * args.saves
            t0 = time.perf_counter()
            for i in range(args.saves):
                stepvault.save(root, state, run=run, step=first + i)
            rate = args.saves / (time.perf_counter() - t0)
            (fresh if which == "fresh" else long).append(rate)
    ratio = median(long) / median(fresh)
    return Row(
        f"saves/s into a run of {args.checkpoints:,} checkpoints vs a fresh run",
        f"≥ {SAVES_RATIO_TARGET}x",
        f"{ratio:.2f}x ({median(long):.0f} vs {median(fresh):.0f} saves/s, medians of "
        f"{args.rounds} rounds of {args.saves})",
        verdict(ratio >= SAVES_RATIO_TARGET),
    )


def retention_reads(work: Path, args: argparse.Namespace) -> tuple[Row, dict[str, Any]]:
    root = work / "retention"
    state = small_state()
    for run in ("other-a", "other-b"):
        fill_run(root, run, args.other // 2, state)
    per_save: list[tuple[Counter[str], Counter[str]]] = []
    with stepvault.CheckpointManager(
        root, "r", keep=stepvault.KeepLast(2), async_save=False, lineage=False
    ) as mgr:
        for step in range(1, 9):
            with counting_parses() as parses, counting_manifest_reads() as reads:
                mgr.save(step, state)
            per_save.append((parses, reads))
    others = max(c["other-a"] + c["other-b"] for _, c in per_save)
    own = max(c["r"] for _, c in per_save)
    parsed = max(sum(p.values()) for p, _ in per_save)
    ok = others == 0 and own <= 2
    return Row(
        f"manifests read by one KeepLast(2) save (commit + retention) with "
        f"{args.other} checkpoints of 2 other runs in the store",
        "0 of other runs, bounded of its own",
        f"{others} of other runs, at most {own} of its own, {parsed} parsed in full "
        "(8 saves, 6 with deletions)",
        verdict(ok),
    ), {"other_runs": others, "own": own, "parsed": parsed}


def requests_per_save(args: argparse.Namespace) -> tuple[Row, dict[str, Any]]:
    state = small_state()
    out: dict[str, Any] = {}
    for length in (10, args.requests_long):
        url = f"memory://stepvault-bench-{length}-{time.time_ns()}"
        store = Store.open(url, create=True)
        fill_run(store, "r", length, state)
        # A new process's store: nothing remembered from the filling saves.
        try:
            from stepvault.engine import parent

            parent.forget_commits(store, "r")
        except ImportError:  # a stepvault before the parent was remembered
            pass
        counts = count_backend_calls(store)
        stepvault.save(store, state, run="r", step=length)  # the process's first save
        first = sum(counts.values())
        counts.clear()
        saves = 5
        for i in range(1, saves + 1):
            stepvault.save(store, state, run="r", step=length + i)  # unchanged state
        out[str(length)] = {"first": first, "per_save": sum(counts.values()) / saves}
        out[f"{length}_calls"] = dict(counts)
    short, long = out["10"]["per_save"], out[str(args.requests_long)]["per_save"]
    return Row(
        f"backend requests per unchanged save (fsspec memory://), run of 10 vs "
        f"{args.requests_long:,}",
        "equal",
        f"{short:.1f} vs {long:.1f} (first save of a process: {out['10']['first']} vs "
        f"{out[str(args.requests_long)]['first']})",
        verdict(long <= short),
    ), out


def mark_cost(root: Path) -> tuple[Row, dict[str, Any]]:
    from stepvault.engine.gc import referenced_objects

    store = Store.open(root)
    with counting_parses() as first:
        t0 = time.perf_counter()
        live, _ = referenced_objects(store)  # absorbs the logs into objects.json
        t_first = time.perf_counter() - t0
    with counting_parses() as parsed:
        t0 = time.perf_counter()
        live2, _ = referenced_objects(store)
        t_lists = time.perf_counter() - t0
    for run in store.list_runs():
        for name in ("objects.json", "objects.log"):
            (root / "runs" / run / name).unlink(missing_ok=True)
    with counting_parses() as without:
        t0 = time.perf_counter()
        live3, _ = referenced_objects(store)
        t_parse = time.perf_counter() - t0
    assert live == live2 == live3, "the mark must not depend on the object lists"
    n = sum(len(store.list_steps(r)) for r in store.list_runs())
    data = {
        "manifests": n,
        "parsed_first": sum(first.values()),
        "seconds_first": t_first,
        "parsed_with_lists": sum(parsed.values()),
        "seconds_with_lists": t_lists,
        "parsed_without": sum(without.values()),
        "seconds_without": t_parse,
    }
    return Row(
        f"GC mark over {n:,} manifests: parses with object lists recorded at commit vs without",
        "no parse",
        f"{data['parsed_with_lists']} parses, {t_lists:.2f} s vs {data['parsed_without']} "
        f"parses, {t_parse:.2f} s",
        verdict(data["parsed_with_lists"] == 0),
    ), data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoints", type=int, default=10_000)
    ap.add_argument("--saves", type=int, default=100, help="saves per timed round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--other", type=int, default=100)
    ap.add_argument("--requests-long", type=int, default=1000)
    ap.add_argument("--out", default=str(_common.REPO / "BENCHMARKS.md"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-", dir=args.workdir))
    try:
        root = work / "store"
        build = fill_run(root, "long", args.checkpoints, small_state())
        print(f"filled a run of {args.checkpoints} checkpoints in {build:.1f} s", flush=True)
        rows = [saves_per_second(root, "long", args.checkpoints, args)]
        print(rows[-1], flush=True)
        row, retention = retention_reads(work, args)
        rows.append(row)
        print(row, flush=True)
        row, requests = requests_per_save(args)
        rows.append(row)
        print(row, flush=True)
        row, mark = mark_cost(root)
        rows.append(row)
        print(row, flush=True)
        facts = machine_facts(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    runtime = time.perf_counter() - t_start
    cmd = "python benchmarks/bench_pipeline.py" + (
        f" --checkpoints {args.checkpoints}" if args.checkpoints != 10_000 else ""
    )
    lines = [
        f"## The save pipeline at scale ({cmd})",
        "",
        f"{facts_line(facts)}; {runtime / 60:.1f} min.",
        "",
        rows_table(rows),
        "",
        "Requests are backend calls of an fsspec store (the code path of S3); a listing is one "
        "call here and one LIST per 1,000 keys on S3. Per-call counts of the last run: "
        f"`{json.dumps(requests)}`.",
    ]
    _common.write_section(Path(args.out), SECTION, "\n".join(lines))
    if args.json:
        doc = {
            "rows": [r.__dict__ for r in rows],
            "retention": retention,
            "requests": requests,
            "mark": mark,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
