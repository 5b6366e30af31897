#!/usr/bin/env python
"""Restore after a process crash: the mem tier (node shared memory) vs the local disk with a
cold page cache vs an S3 tier (loopback server). Rewrites the ``mem`` section of
BENCHMARKS.md::

    python benchmarks/bench_mem.py [--size-mb 1536] [--repeats 3] [--out BENCHMARKS.md]

One checkpoint of a ``--size-mb`` fp32 model is saved by a ``CheckpointManager`` with a mem
tier (``tiers={"mem": ...}``: committed into /dev/shm, then to disk) and copied to an S3
tier. Each restore then runs in a fresh process, as after a crash: a new manager restores
into a freshly built model, and the time of ``mgr.restore()`` is reported (it is also in
the ``restore`` event and ``RestoreInfo.seconds``):

- **mem**: the manager with the mem tier reads from memory (``info.tier == "mem"``);
- **mem, no copy**: the same, into a model built on the ``meta`` device, with
  ``restore(assign=True)`` (the tensors map the tmpfs pages copy-on-write);
- **disk, cold cache**: a manager without a mem tier, after every object file was dropped
  from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``, no root needed);
- **S3**: ``stepvault.restore`` from the S3 tier (moto server on 127.0.0.1, 16 fetches).

Target: mem ≤ 0.3x local disk (cold cache). The save itself is reported too: its commit
time and the bytes BLAKE3 hashed (the ``hashed_bytes`` of its ``save`` event; target: each
chunk once, 1.00x the state).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common
import torch
from _common import REPO, fmt_bytes, table
from bench_tiers import S3Server, make_model, nbytes

import stepvault
from stepvault import CheckpointManager
from stepvault.manager.options import MemOptions
from stepvault.store import Store
from stepvault.store.fsspec_backend import open_fsspec
from stepvault.tiers import copy_checkpoint

RUN = "bench"
TARGET = 0.3


def drop_page_cache(root: Path) -> None:
    """Evict every file under ``root`` from the page cache (it was fsynced by the save)."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def hash_floor(mem_path: Path) -> float:
    """Seconds to BLAKE3 every object file of the mem tier, already in memory (tmpfs), one
    thread per object on every core: what verification alone costs."""
    from concurrent.futures import ThreadPoolExecutor

    import blake3

    files = [p for p in (mem_path / "objects").rglob("*") if p.is_file()]
    datas = [p.read_bytes() for p in files]  # in memory first: the hash alone is timed

    def digest(data: bytes) -> bytes:
        return blake3.blake3(data, max_threads=1).digest()

    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        t0 = time.perf_counter()
        list(pool.map(digest, datas))
        return time.perf_counter() - t0


def crash(mgr: CheckpointManager) -> None:
    """Leave the manager as a crashed process would (its mem tier kept), but hand the lease
    back so that the next process (the restart) may write the run at once."""
    mgr._p.lease.release()  # the heartbeat stops first: no renewal after this
    mgr._closed = True


def child(args: argparse.Namespace) -> None:
    """One restore in this fresh process; prints ``{"seconds": ..., "tier": ...}``."""
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    if args.child == "mem-assign":  # a restart that builds the model without memory
        with torch.device("meta"):
            model = make_model(args.size_mb, seed=1)
    else:
        model = make_model(args.size_mb, seed=1)
    state = {"model": model}
    if args.child == "s3":
        store = Store.open(open_fsspec(args.s3_url, endpoint_url=args.endpoint))
        t0 = time.perf_counter()
        stepvault.restore(store, state, run=RUN, progress=False)
        seconds, tier = time.perf_counter() - t0, "s3"
    else:
        tiers = (
            {"mem": MemOptions(path=args.mem_root, cleanup=False)}
            if args.child.startswith("mem")
            else None
        )
        mgr = CheckpointManager(args.hot, RUN, tiers=tiers, lineage=False)
        t0 = time.perf_counter()
        info = mgr.restore(state, assign=args.child == "mem-assign")
        seconds = time.perf_counter() - t0
        assert info is not None
        tier = str(info.tier)
        crash(mgr)
    print(json.dumps({"seconds": seconds, "tier": tier}), flush=True)


def run_child(mode: str, args: argparse.Namespace, extra: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--size-mb", str(args.size_mb), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} restore failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=1536)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--mem-root", default=None, help="default: /dev/shm/stepvault-bench")
    ap.add_argument("--no-s3", action="store_true")
    # child mode (internal)
    ap.add_argument("--child", choices=("mem", "mem-assign", "disk", "s3"))
    ap.add_argument("--hot")
    ap.add_argument("--s3-url")
    ap.add_argument("--endpoint")
    args = ap.parse_args()
    if args.child:
        return child(args)

    t_start = time.perf_counter()
    facts = _common.machine_facts(REPO, {"s3 server": "moto " + _common.version("moto")})
    s3 = None if args.no_s3 else S3Server()
    results: dict[str, list[float]] = {"mem": [], "mem-assign": [], "disk": [], "s3": []}
    floor: list[float] = []
    tiers_seen: dict[str, set[str]] = {k: set() for k in results}
    try:
        with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
            hot = Path(tmp) / "hot"
            mem_root = args.mem_root or tempfile.mkdtemp(
                prefix="stepvault-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else tmp
            )
            model = make_model(args.size_mb)
            size = nbytes(model)
            mgr = CheckpointManager(
                hot, RUN, tiers={"mem": MemOptions(path=mem_root, cleanup=False)}
            )
            mgr.save(1, {"model": model}, force=True)
            mgr.wait()
            saved = [e for e in mgr.events() if e["event"] == "save"][-1]
            mem_path = mgr.mem_tier.path  # type: ignore[union-attr]
            crash(mgr)
            del model
            s3_url = endpoint = None
            if s3 is not None:
                endpoint = s3.endpoint
                s3_url = f"s3://{s3.bucket()}/cold"
                cold = Store.open(open_fsspec(s3_url, endpoint_url=endpoint), create=True)
                copy_checkpoint(Store.open(hot), cold, RUN, 1)
            for _ in range(args.repeats):
                r = run_child("mem", args, ["--hot", str(hot), "--mem-root", mem_root])
                results["mem"].append(r["seconds"])
                tiers_seen["mem"].add(r["tier"])
                r = run_child("mem-assign", args, ["--hot", str(hot), "--mem-root", mem_root])
                results["mem-assign"].append(r["seconds"])
                tiers_seen["mem-assign"].add(r["tier"])
                floor.append(hash_floor(Path(mem_path)))
                drop_page_cache(hot)
                r = run_child("disk", args, ["--hot", str(hot)])
                results["disk"].append(r["seconds"])
                tiers_seen["disk"].add(r["tier"])
                if s3_url is not None:
                    r = run_child("s3", args, ["--s3-url", s3_url, "--endpoint", str(endpoint)])
                    results["s3"].append(r["seconds"])
                    tiers_seen["s3"].add(r["tier"])
            import shutil

            shutil.rmtree(mem_path, ignore_errors=True)
            if not args.mem_root:
                shutil.rmtree(mem_root, ignore_errors=True)
    finally:
        if s3 is not None:
            s3.stop()
    med = {k: _common.median(v) for k, v in results.items() if v}
    ratio = med["mem"] / med["disk"] if med.get("disk") else float("nan")
    body = []
    labels = {
        "mem": "mem tier (/dev/shm)",
        "mem-assign": "mem tier, model on `meta`, `restore(assign=True)` (no copy)",
        "disk": "local disk, cold page cache",
        "s3": "S3 tier (moto on 127.0.0.1)",
    }
    for k in ("mem", "mem-assign", "disk", "s3"):
        if results[k]:
            body.append(
                [
                    labels[k],
                    ", ".join(sorted(tiers_seen[k])),
                    _common.secs(results[k], 3),
                    f"{size / med[k] / 1e9:.2f} GB/s",
                    f"{med[k] / med['disk']:.2f}x" if med.get("disk") else "",
                ]
            )
    verdict = _common.verdict(ratio <= TARGET)
    ratio0 = med["mem-assign"] / med["disk"] if med.get("disk") else float("nan")
    lines = _common.section_head(
        "Restore after a process crash: mem tier vs disk vs S3",
        f"python benchmarks/bench_mem.py --size-mb {args.size_mb} --repeats {args.repeats}",
        time.perf_counter() - t_start,
        facts,
    )
    hashed = saved.get("hashed_bytes")
    hashed_x = hashed / saved["logical_bytes"] if hashed is not None else float("nan")
    lines += [
        f"Save (the one checkpoint restored below, memory + disk): {saved['write_seconds']:.2f} s "
        f"to commit into both ({saved.get('mem_seconds', float('nan')):.2f} s of it into "
        f"memory); BLAKE3 hashed {hashed_x:.2f}x the state's bytes (target: each chunk "
        f"once, 1.00x — {_common.verdict(hashed_x <= 1.0)}; the memory and disk writes "
        "share one set of chunk digests, issue 27; it was 2.00x).",
        "",
        f"State: one fp32 model of {fmt_bytes(size)}; each restore in a fresh process "
        "(a new manager, as after a crash); times are `mgr.restore()` (median of "
        f"{args.repeats}).",
        "",
        table(["restore from", "tier reported", "seconds", "throughput", "vs disk cold"], body),
        "",
        f"Target mem ≤ {TARGET}x local disk (cold cache): measured {ratio:.2f}x with the "
        f"default restore (copying into a built model) — {verdict}; {ratio0:.2f}x with the "
        f"no-copy restart — {_common.verdict(ratio0 <= TARGET)}.",
        "",
        f"- The floor of a verified restore from memory here: BLAKE3 over the same objects "
        f"already in memory, {os.cpu_count()} threads (one per object, as the restore "
        f"does), takes {_common.median(floor):.3f} s (median of {len(floor)}; "
        f"{_common.median(floor) / med['disk']:.2f}x of the cold disk restore). With "
        "`assign=True` the restore is that hash plus opening the objects; the default "
        "restore adds one copy into the live tensors.",
        "- `assign=True` into a model built under `torch.device('meta')` (no memory "
        "allocated or initialised before the restore): the modules take the verified "
        "tensors themselves, each a view of its object's private copy-on-write mapping of "
        "the tmpfs file (training them never changes the mem tier); the optimizer is "
        "created after the restore. Into a model built in memory, `assign=True` also "
        "frees the old parameters (about 0.1 s for 1.6 GB here).",
    ]
    section = "\n".join(lines)
    _common.write_section(args.out, "mem", section)
    print(section)


if __name__ == "__main__":
    main()
