#!/usr/bin/env python
"""Object storage and tiers benchmark: upload throughput to a local S3 server, restore from a
cold (S3) tier vs the hot (local) tier, and the bytes a tier policy moves over 100
checkpoints. Rewrites the section between ``<!-- tiers:begin -->`` and ``<!-- tiers:end -->``
of BENCHMARKS.md (the rest is kept)::

    python benchmarks/bench_tiers.py [--size-mb 256] [--steps 100] [--out BENCHMARKS.md]

The S3 server is moto's server mode in its own process on 127.0.0.1 (in-memory, Python,
sharing this machine's cores with the client): the numbers measure stepvault's request
pattern and parallelism against a real HTTP S3 API, not AWS's bandwidth.

1. Upload: ``put_atomic`` of 32 MiB objects, 8 in flight, as single PUTs and as parallel
   multipart uploads (8 MiB parts); ``stepvault.save`` of a ``--size-mb`` fp32 model
   straight to ``s3://`` with the default workers and with 16.
2. Restore into an ``nn.Module``: from the hot tier (local directory, page cache warm) and
   from the cold tier only (S3; 16 parallel fetches, and 2 for comparison); the tier move
   (``copy_checkpoint`` hot → S3) itself.
3. A ``CheckpointManager`` run of ``--steps`` saves of a model whose last quarter trains
   (the rest frozen, as in fine-tuning) with ``HotLast(3) | CopyEvery("archive", steps=5)
   | ArchiveProtected("archive")``: bytes written to each tier against full copies.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common
import torch
from _common import REPO, fmt_bytes, table

import stepvault
from stepvault import CheckpointManager
from stepvault.engine.gc import sweep
from stepvault.ops.usage import usage_by_tier
from stepvault.store import Store
from stepvault.store.fsspec_backend import open_fsspec
from stepvault.tiers import (
    ArchiveProtected,
    CopyEvery,
    HotLast,
    Tiers,
    TierSpec,
    add_tier,
    copy_checkpoint,
)

MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """moto's S3 server in a child process on 127.0.0.1."""

    def __init__(self) -> None:
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(200):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("moto server did not start")

    def bucket(self) -> str:
        import boto3

        name = f"bench-{uuid.uuid4().hex[:10]}"
        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def make_model(size_mb: int, width: int = 2048, seed: int = 0) -> torch.nn.Module:
    layers = max(1, size_mb * MiB // (width * width * 4))
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))


def nbytes(m: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_upload(s3: S3Server, size_mb: int, rows: list[list[str]]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    payload = os.urandom(32 * MiB)
    n = max(2, size_mb // 32)
    for label, part in (("single PUT per object", 64 * MiB), ("multipart, 8 MiB parts", 8 * MiB)):
        b = open_fsspec(f"s3://{s3.bucket()}/raw", endpoint_url=s3.endpoint, part_size=part)
        b.put_atomic("warmup", [b"x"])

        def put(i: int, b=b) -> None:
            b.put_atomic(f"objects/{i:02x}/{i}", [payload], overwrite=False)

        with ThreadPoolExecutor(8) as pool:
            secs = timed(lambda pool=pool: list(pool.map(put, range(n))))
        rows.append(
            [
                f"put_atomic, {label} (32 MiB objects, 8 in flight)",
                fmt_bytes(n * 32 * MiB),
                f"{secs:.2f} s",
                f"{n * 32 * MiB / secs / 1e6:.0f} MB/s",
            ]
        )
    model = make_model(size_mb)
    for workers in (None, 16):
        url = f"s3://{s3.bucket()}/ckpts"
        os.environ["AWS_ENDPOINT_URL"] = s3.endpoint
        secs = timed(
            lambda url=url, w=workers: stepvault.save(
                url, {"model": model}, run="r", step=1, workers=w
            )
        )
        label = "default (CPU-based)" if workers is None else str(workers)
        rows.append(
            [
                f"stepvault.save to s3://, workers {label}",
                fmt_bytes(nbytes(model)),
                f"{secs:.2f} s",
                f"{nbytes(model) / secs / 1e6:.0f} MB/s",
            ]
        )


def bench_restore(s3: S3Server, size_mb: int, work: Path, rows: list[list[str]]) -> None:
    model = make_model(size_mb, seed=1)
    hot_root = work / "hot-restore"
    stepvault.save(hot_root, {"model": model}, run="r", step=1)
    hot = Store.open(hot_root)
    spec = TierSpec("archive", f"s3://{s3.bucket()}/cold", options={"endpoint_url": s3.endpoint})
    add_tier(hot, spec)
    tiers = Tiers.of(hot)
    stats = copy_checkpoint(hot, tiers["archive"], "r", 1)
    rows.append(
        [
            "tier move hot → S3 (copy_checkpoint, 16 in flight, hashes verified)",
            fmt_bytes(stats.bytes_written),
            f"{stats.seconds:.2f} s",
            f"{stats.bytes_written / stats.seconds / 1e6:.0f} MB/s",
        ]
    )
    target = make_model(size_mb, seed=2)
    stepvault.restore(hot_root, {"model": target}, run="r", step=1)  # warm the page cache
    secs = min(
        timed(lambda: stepvault.restore(hot_root, {"model": target}, run="r", step=1))
        for _ in range(2)
    )
    rows.append(
        [
            "restore from hot (local dir, page cache warm)",
            fmt_bytes(nbytes(model)),
            f"{secs:.2f} s",
            f"{nbytes(model) / secs / 1e6:.0f} MB/s",
        ]
    )
    hot.delete_manifest("r", 1)  # now only the archive holds it
    sweep(hot, grace_seconds=0)
    for workers in (16, 2):
        secs = timed(
            lambda w=workers: stepvault.restore(
                hot_root, {"model": target}, run="r", step=1, workers=w
            )
        )
        default = " (default for S3)" if workers == 16 else ""
        rows.append(
            [
                f"restore from cold (S3 only), {workers} parallel fetches{default}",
                fmt_bytes(nbytes(model)),
                f"{secs:.2f} s",
                f"{nbytes(model) / secs / 1e6:.0f} MB/s",
            ]
        )
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), target.parameters()))


def bench_policy(s3: S3Server, steps: int, work: Path) -> tuple[list[list[str]], str]:
    torch.manual_seed(3)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(8)))  # 8 MiB
    trainable = list(model[6:].parameters())  # the last quarter trains, the rest is frozen
    policy = HotLast(3) | CopyEvery("archive", steps=5) | ArchiveProtected("archive")
    spec = TierSpec("archive", f"s3://{s3.bucket()}/cold", options={"endpoint_url": s3.endpoint})
    hot_root = work / "hot-policy"
    pinned = next(s for s in range(steps // 2 + 2, steps + 1) if s % 5)  # 52 of 100
    t0 = time.perf_counter()
    with CheckpointManager(
        hot_root, "run", tiers={"archive": spec}, tier_policy=policy, lineage=False
    ) as mgr:
        for step in range(1, steps + 1):
            with torch.no_grad():
                for p in trainable:
                    p.add_(0.01)
            mgr.save(step, {"model": model})
            if step == pinned:
                mgr.wait()
                mgr.pin(pinned)
        mover = mgr.tier_mover
    seconds = time.perf_counter() - t0
    assert mover is not None and mover.last_error is None, mover.last_error
    stats = mgr.stats()
    hot = Store.open(hot_root)
    swept = sweep(hot, grace_seconds=0)  # what the grace period was still holding back
    usage = usage_by_tier(hot)
    full = nbytes(model)
    copies = sum(len(r.copies) for r in mover.reports)
    archived = usage["archive"].checkpoints
    rows = [
        [
            "hot (local)",
            str(steps),
            fmt_bytes(stats["new_bytes"]),
            fmt_bytes(steps * full),
            str(usage["hot"].checkpoints),
            fmt_bytes(usage["hot"].stored_bytes),
        ],
        [
            "archive (S3)",
            str(copies),
            fmt_bytes(mover.bytes_moved.get("archive", 0)),
            fmt_bytes(archived * full),
            str(archived),
            fmt_bytes(usage["archive"].stored_bytes),
        ],
    ]
    note = (
        f"{steps} asynchronous saves in {seconds:.1f} s, the mover's copies, evictions and GC "
        f"included; the training thread waited {stats['mean_stall_seconds'] * 1e3:.1f} ms per "
        f"save on average (max {stats['max_stall_seconds'] * 1e3:.1f} ms; the mover runs on "
        f"its own thread). Model {fmt_bytes(full)}, 25% of it trained per step; hot GC freed "
        f"{fmt_bytes(stats['freed_bytes'] + swept.freed_bytes)} of evicted checkpoints. "
        f"The archive holds every 5th checkpoint plus the pinned step {pinned}."
    )
    return rows, note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    ap.add_argument(
        "--workdir", type=Path, default=REPO / "bench-out", help="scratch space (a temp dir in it)"
    )
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    facts = _common.machine_facts(REPO, {"s3 server": "moto " + _common.version("moto")})
    s3 = S3Server()
    try:
        with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
            work = Path(tmp)
            throughput: list[list[str]] = []
            bench_upload(s3, args.size_mb, throughput)
            bench_restore(s3, args.size_mb, work, throughput)
            policy_rows, policy_note = bench_policy(s3, args.steps, work)
    finally:
        s3.stop()
    minutes = (time.perf_counter() - t0) / 60
    section = "\n".join(
        [
            "## Object storage and tiers",
            "",
            f"Generated by `python benchmarks/bench_tiers.py` in {minutes:.1f} min on "
            f"{facts['date']}. {_common.facts_line(facts)}.",
            "",
            "The S3 server is moto's server mode (in-memory, Python) in its own process on "
            "127.0.0.1, sharing the machine's cores with the client: these numbers show "
            "stepvault's request pattern and parallelism against a real HTTP S3 API, not a "
            "cloud provider's bandwidth.",
            "",
            "### Throughput",
            "",
            table(["operation", "bytes", "time", "throughput"], throughput),
            "",
            "Single PUTs beat multipart uploads at this object size on a loopback server "
            "(multipart pays extra requests and a server-side reassembly); multipart is for "
            "objects from `2 × part_size` (64 MiB by default), where one stream would be "
            "the bottleneck on a real network. Client and server share two cores here, so "
            "rows that differ by less than ~50% (e.g. save with 2 vs 16 workers) swap places "
            "from run to run. Restoring from the "
            "cold tier fetches 16 objects at once and verifies every hash; the hot row is "
            "the local disk from the page cache (memory-mapped, copied into the parameters).",
            "",
            f'### Bytes per tier: `HotLast(3) | CopyEvery("archive", steps=5) | '
            f'ArchiveProtected("archive")` over {args.steps} checkpoints',
            "",
            table(
                [
                    "tier",
                    "checkpoints written",
                    "bytes written",
                    "full copies would write",
                    "checkpoints held at the end",
                    "stored at the end",
                ],
                policy_rows,
            ),
            "",
            policy_note + " Bytes written count only objects the tier lacked (dedup within "
            "each tier).",
        ]
    )
    _common.write_section(args.out, "tiers", section)
    print(section)


if __name__ == "__main__":
    main()
