"""Restore at the storage limit (issue 31): verification cost per checksum, warm and cold
restores against safetensors and a parallel raw read, a model + AdamW state into a live
optimizer, the warm restore with glibc's streaming-store copies (child processes), one
tensor with ``mmap=True`` against ``safe_open``, and the save with and without the
recorded segment checksums.

    .venv/bin/python benchmarks/bench_restore.py [--size-mb 512] [--repeats 3] [--out BENCHMARKS.md]

Every ratio is measured in this one run, peers alternated. "fast" is the default read
(xxh3-128 segment checksums recorded at save), "full" re-hashes every object with BLAKE3
(what every read did before: the "before" column). Cold runs drop the page cache
(``/proc/sys/vm/drop_caches``, root only; skipped otherwise) before each read.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np
import torch
from _common import load_average, median, table, write_section

import stepvault

DROP = Path("/proc/sys/vm/drop_caches")


def cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def make_state(total: int) -> dict[str, torch.Tensor]:
    """A GPT-2-like mix: 24 MB matrices (one object each), 3 MB ones, and many small."""
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    left, i = total, 0
    while left > 0:
        n = (6 << 20, 768 * 1024, 3072, 768)[i % 4]  # elements (fp32)
        n = min(n, max(1, left // 4))
        state[f"t{i:04d}"] = torch.randn(n, generator=g)
        left -= n * 4
        i += 1
    return state


def checksum_costs(nbytes: int) -> list[list[str]]:
    """CPU-seconds per GB of each checksum on one thread, over ``nbytes`` random bytes."""
    from blake3 import blake3

    buf = memoryview(np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8))
    algs: dict[str, Callable[[memoryview], Any]] = {
        'BLAKE3 (1 thread; the name, `verify="full"`)': lambda b: blake3(b, max_threads=1)
    }
    try:
        import xxhash

        algs['xxh3-128 (recorded, `verify="fast"`)'] = xxhash.xxh3_128_digest
    except ImportError:
        pass
    try:
        from awscrt import checksums

        algs["CRC64NVME (awscrt)"] = checksums.crc64nvme
        algs["CRC32C (awscrt)"] = checksums.crc32c
    except ImportError:
        pass
    rows = []
    for name, fn in algs.items():
        samples = []
        for _ in range(5):
            c0 = cpu()
            for at in range(0, nbytes, 1 << 20):  # per 1 MiB segment, as the reader does
                fn(buf[at : at + (1 << 20)])
            samples.append(cpu() - c0)
        per_gb = median(samples) / (nbytes / 1e9)
        rows.append([name, f"{per_gb:.3f}", f"{1 / per_gb:.1f}" if per_gb else "-"])
    return rows


def drop_caches() -> bool:
    try:
        os.sync()
        DROP.write_text("3\n")
        return True
    except OSError:
        return False


def raw_parallel_read(files: list[Path], threads: int) -> float:
    """Read every file whole with ``threads`` readers (pread into one reused buffer each)."""
    todo = list(files)
    lock = threading.Lock()

    def reader() -> None:
        buf = bytearray(32 << 20)
        view = memoryview(buf)
        while True:
            with lock:
                if not todo:
                    return
                path = todo.pop()
            fd = os.open(path, os.O_RDONLY)
            try:
                off = 0
                while True:
                    n = os.preadv(fd, [view], off)
                    if n <= 0:
                        break
                    off += n
            finally:
                os.close(fd)

    t0 = time.perf_counter()
    workers = [threading.Thread(target=reader) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cold-repeats", type=int, default=2, help="0 skips the cold reads")
    ap.add_argument("--one-repeats", type=int, default=30)
    ap.add_argument("--s3-mb", type=int, default=128, help="state restored from S3 (0: skip)")
    ap.add_argument("--out", type=Path, default=None, help="BENCHMARKS.md to update")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from stepvault.format import hashing

    work = Path(tempfile.mkdtemp(prefix="bench-restore-", dir=args.workdir or None))
    state = make_state(args.size_mb << 20)
    total = sum(t.nbytes for t in state.values())
    print(f"state: {len(state)} tensors, {total / 1e9:.2f} GB fp32", flush=True)
    results: dict[str, Any] = {"bytes": total}

    # 1. What each checksum costs.
    costs = checksum_costs(256 << 20)
    results["checksums"] = costs
    for row in costs:
        print("  ", *row, flush=True)

    # 2. Saves with and without the recorded checksums (alternated, fresh stores).
    saves: dict[str, list[float]] = {"with sums": [], "without sums": []}
    save_cpu: dict[str, list[float]] = {"with sums": [], "without sums": []}
    xx = hashing._xxhash
    stepvault.save(work / "warm-up", state, run="bench", step=1)  # imports, pools, page cache
    shutil.rmtree(work / "warm-up")
    # Three times the repeats: one save varies by more than the checksums cost (0.25-0.47 s
    # for the same 0.54 GB in one run), and 3 alternations gave 1.01x-1.18x in runs a day
    # apart.
    for r in range(3 * args.repeats):
        for label in ("with sums", "without sums") if r % 2 == 0 else ("without sums", "with sums"):
            root = work / f"save-{label[:4]}-{r}"
            hashing._xxhash = xx if label == "with sums" else None
            t0, c0 = time.perf_counter(), cpu()
            stepvault.save(root, state, run="bench", step=1)
            saves[label].append(time.perf_counter() - t0)
            save_cpu[label].append(cpu() - c0)
            shutil.rmtree(root)
    hashing._xxhash = xx
    results["save"] = saves
    results["save_cpu"] = save_cpu
    print("  save:", {k: f"{median(v):.2f}" for k, v in saves.items()}, flush=True)

    sv = work / "store"
    stepvault.save(sv, state, run="bench", step=1)
    st = work / "model.safetensors"
    save_file(state, str(st))
    live = {k: torch.empty_like(v) for k, v in state.items()}
    for t in live.values():
        t.zero_()

    def via_safetensors() -> None:
        loaded = load_file(str(st))
        for k, t in live.items():
            t.copy_(loaded[k])

    def via(verify: str) -> Callable[[], None]:
        return lambda: stepvault.restore(sv, live, run="bench", step=1, verify=verify)  # type: ignore[arg-type]

    peers = {"safetensors load+copy": via_safetensors, "fast": via("fast"), "full": via("full")}

    def check() -> None:
        for k, t in live.items():
            if not torch.equal(t, state[k]):
                raise SystemExit(f"restored {k} wrong")

    # 3. Warm: every file in the page cache.
    warm: dict[str, list[float]] = {k: [] for k in peers}
    for fn in peers.values():
        fn()  # warm-up, untimed
    check()
    for r in range(args.repeats):
        order = list(peers.items())
        for label, fn in order[r % 3 :] + order[: r % 3]:
            t0 = time.perf_counter()
            fn()
            warm[label].append(time.perf_counter() - t0)
    check()
    results["warm"] = warm
    print("  warm:", {k: f"{median(v):.3f}" for k, v in warm.items()}, flush=True)
    results["phases"] = warm_phases(sv, live, via_safetensors, args.repeats)
    results["adam"] = warm_adam(work, args.size_mb, max(5, args.repeats))
    print("  adam:", {k: f"{median(v):.3f}" for k, v in results["adam"].items()}, flush=True)
    results["copy_speeds"] = copy_speeds()
    results["streaming"] = streaming_restores(sv, st, args.size_mb)
    print("  streaming:", {k: f"{median(v):.3f}" for k, v in results["streaming"].items()})
    print("  phases:", {k: f"{median(v):.3f}" for k, v in results["phases"].items()}, flush=True)

    # 4. Cold: the page cache dropped before each read.
    cold: dict[str, list[float]] = {}
    objects = sorted(p for p in (sv / "objects").rglob("*") if p.is_file())
    cold_peers: dict[str, Callable[[], Any]] = {
        "raw parallel read": lambda: raw_parallel_read(objects, 8),
        **peers,
    }
    if args.cold_repeats and drop_caches():
        cold = {k: [] for k in cold_peers}
        for r in range(args.cold_repeats):
            order = list(cold_peers.items())
            for label, fn in order[r % 4 :] + order[: r % 4]:
                drop_caches()
                t0 = time.perf_counter()
                fn()
                cold[label].append(time.perf_counter() - t0)
        check()
        print("  cold:", {k: f"{median(v):.3f}" for k, v in cold.items()}, flush=True)
    results["cold"] = cold

    # 5. One tensor, mmap=True, against safe_open (both warm).
    name = max(state, key=lambda k: state[k].nbytes if state[k].nbytes <= 32 << 20 else 0)
    one: dict[str, list[float]] = {"stepvault": [], "safe_open": []}

    def one_sv() -> torch.Tensor:
        return stepvault.open(sv).checkpoint("bench", 1).tensor(name, mmap=True)

    def one_st() -> torch.Tensor:
        with safe_open(str(st), framework="pt") as f:
            return f.get_tensor(name)

    for r in range(args.one_repeats + 1):
        for label, fn in (("stepvault", one_sv), ("safe_open", one_st))[:: 1 if r % 2 else -1]:
            t0 = time.perf_counter()
            t = fn()
            float(t.view(-1)[:: max(1, 4096 // t.element_size())].sum())  # touch every page
            dt = time.perf_counter() - t0
            if r:
                one[label].append(dt)
            elif not torch.equal(t, state[name]):
                raise SystemExit(f"{label} read {name} wrong")
    results["one"] = {"name": name, "bytes": state[name].nbytes, **one}
    results["one_parts"] = one_tensor_parts(sv, name, args.one_repeats)
    print("  one:", {k: f"{median(v) * 1e3:.2f} ms" for k, v in one.items()}, flush=True)

    # 6. From the S3 tier (moto on loopback) against one plain sequential GET per object.
    results["s3"] = bench_s3(args.s3_mb, args.repeats) if args.s3_mb else {}

    shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.out:
        write_section(args.out, "restore", report(results, args))
    return 0


def warm_phases(
    sv: Path, live: dict[str, torch.Tensor], safetensors_copy: Callable[[], None], repeats: int
) -> dict[str, list[float]]:
    """Where a warm ``fast`` restore's time goes, its two passes over the bytes timed apart
    (wall and CPU of the whole process, peers alternated): ``verify`` (open the checkpoint,
    fetch and check every object: ``OpenedCheckpoint.verify_all``) and ``place`` (the
    placement's copy of the verified bytes into the live tensors, ``parallel_copy``), next
    to ``safetensors`` (load + copy, whose copy is the same pass over the same bytes).
    The restore cannot place before the last object verified (invariant 4), so the two
    passes cannot overlap: verify + place is the floor of a verified restore."""
    from stepvault.core.opened import open_checkpoint
    from stepvault.engine.copying import parallel_copy
    from stepvault.format import decode_value
    from stepvault.store import Store

    store = Store.open(sv)

    def verify() -> None:
        opened = open_checkpoint(store, "bench", 1)
        opened.verify_all()
        opened.release()

    def place() -> Callable[[], None]:
        # Verified first (untimed), as the restore does; timed: only the copy.
        opened = open_checkpoint(store, "bench", 1)
        opened.verify_all()
        names = decode_value(opened.manifest.state, lambda kind, name: name)
        copies: list[Any] = []
        for key, t in live.items():
            if not opened.reader.read_into(names[key], t, copies=copies):
                raise SystemExit(f"{key} does not fit")
        return lambda: parallel_copy(copies)

    out: dict[str, list[float]] = {
        k: []
        for k in ("verify", "place", "safetensors", "verify cpu", "place cpu", "safetensors cpu")
    }
    for r in range(max(3, repeats)):
        order = ["verify", "place", "safetensors"]
        for label in order[r % 3 :] + order[: r % 3]:
            fn = place() if label == "place" else verify if label == "verify" else safetensors_copy
            t0, c0 = time.perf_counter(), cpu()
            fn()
            out[label].append(time.perf_counter() - t0)
            out[f"{label} cpu"].append(cpu() - c0)
    return out


ADAM_PEERS = {
    "safetensors": "safetensors load+copy",
    "in place": "stepvault, moments into the live optimizer's",
    "fresh": "stepvault, moments into fresh memory",
}


def warm_adam(work: Path, size_mb: int, repeats: int) -> dict[str, list[float]]:
    """A model + AdamW state (2/3 of its bytes are moments), warm, into a live model and an
    optimizer that has state (an in-process restore: a rollback): wall and CPU of the
    process, peers alternated. stepvault places the moments into the live optimizer's
    tensors, or builds them in fresh memory (what it did before, and what a new process
    gets: an optimizer without state; toggled here by placing nothing into the
    optimizer). safetensors: ``load_file`` (zero-copy: views of its private file mapping)
    + ``copy_`` into the live parameters and moments."""
    from safetensors.torch import load_file, save_file

    from stepvault.state import placement

    width = 2048
    layers = max(1, (size_mb << 20) // 3 // (width * width * 4))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    root, st = work / "adam-store", work / "adam.safetensors"
    stepvault.save(root, {"model": model, "optimizer": opt}, run="adam", step=1)
    params = dict(model.state_dict())
    flat = {f"model.{k}": v for k, v in params.items()}
    for i, p in enumerate(model.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            flat[f"opt.{i}.{k}"] = opt.state[p][k]
    save_file(flat, str(st))
    place = placement._place_optimizer

    def safetensors_copy() -> None:
        loaded = load_file(str(st))
        with torch.no_grad():
            for k, t in params.items():
                t.copy_(loaded[f"model.{k}"])
            for i, p in enumerate(model.parameters()):
                for k in ("exp_avg", "exp_avg_sq"):
                    opt.state[p][k].copy_(loaded[f"opt.{i}.{k}"])

    def restore(in_place: bool) -> Callable[[], None]:
        def fresh(opt: Any, saved: Any, reader: Any, copies: Any, into: Any) -> Any:
            return placement._materialize(saved, reader, into)

        def run() -> None:
            placement._place_optimizer = place if in_place else fresh  # type: ignore[assignment]
            try:
                stepvault.restore(root, {"model": model, "optimizer": opt}, run="adam", step=1)
            finally:
                placement._place_optimizer = place

        return run

    peers = {
        ADAM_PEERS["safetensors"]: safetensors_copy,
        ADAM_PEERS["in place"]: restore(True),
        ADAM_PEERS["fresh"]: restore(False),
    }
    out: dict[str, list[float]] = {}
    for fn in peers.values():
        fn()  # warm-up
    for r in range(repeats):
        order = list(peers.items())
        for label, fn in order[r % 3 :] + order[: r % 3]:
            t0, c0 = time.perf_counter(), cpu()
            fn()
            out.setdefault(label, []).append(time.perf_counter() - t0)
            out.setdefault(f"{label} cpu", []).append(cpu() - c0)
    out["bytes"] = [float(sum(t.nbytes for t in flat.values()))]
    shutil.rmtree(root, ignore_errors=True)
    st.unlink()
    return out


#: glibc's threshold above which one copy call uses streaming (non-temporal) stores, set
#: to 1 MiB so that placement's 16 MiB copies use them (read when the process starts).
STREAMING_TUNABLE = "glibc.cpu.x86_non_temporal_threshold=0x100000"

_CHILD = """
import json, resource, statistics, sys, time
sys.path.insert(0, sys.argv[2])
import torch
import stepvault
from bench_restore import make_state

state = make_state(int(sys.argv[3]) << 20)
live = {k: torch.zeros_like(v) for k, v in state.items()}
def cpu():
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime
from safetensors.torch import load_file

def restore():
    stepvault.restore(sys.argv[1], live, run="bench", step=1)
def safetensors_copy():
    loaded = load_file(sys.argv[4])
    for k, t in live.items():
        t.copy_(loaded[k])
peers = {"restore": restore, "safetensors": safetensors_copy}
for fn in peers.values():
    fn()  # warm-up
out = {k: [] for k in ("restore", "restore cpu", "safetensors", "safetensors cpu")}
for r in range(6):
    for label, fn in list(peers.items())[:: 1 if r % 2 else -1]:
        t0, c0 = time.perf_counter(), cpu()
        fn()
        out[label].append(time.perf_counter() - t0)
        out[label + " cpu"].append(cpu() - c0)
restore()
assert all(torch.equal(live[k], state[k]) for k in state)
print(json.dumps({k: statistics.median(v) for k, v in out.items()}))
"""


def streaming_restores(sv: Path, st: Path, size_mb: int, rounds: int = 3) -> dict[str, list[float]]:
    """The warm ``fast`` restore and safetensors' load + copy in child processes, with
    glibc's default copies and with :data:`STREAMING_TUNABLE` (``GLIBC_TUNABLES`` is read
    when a process starts), the children alternated: medians of 6 alternations per child,
    wall and CPU of the child."""
    import subprocess

    out: dict[str, list[float]] = {}
    here = str(Path(__file__).resolve().parent)
    for r in range(rounds):
        for mode in ("default", "streaming") if r % 2 == 0 else ("streaming", "default"):
            env = dict(os.environ)
            if mode == "streaming":
                env["GLIBC_TUNABLES"] = ":".join(
                    t for t in (env.get("GLIBC_TUNABLES"), STREAMING_TUNABLE) if t
                )
            done = subprocess.run(
                [sys.executable, "-c", _CHILD, str(sv), here, str(size_mb), str(st)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                timeout=600,
            )
            for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items():
                out.setdefault(f"{mode} {k}", []).append(v)
    return out


def copy_speeds(nbytes: int = 384 << 20) -> dict[str, list[float]]:
    """CPU-seconds per GB of one thread's host copy, the way placement copies (16 MiB
    ``memmove`` calls: glibc's ``rep movsb``) and as one call of ``nbytes`` (above glibc's
    non-temporal threshold, 190 MB on these machines, its copy uses streaming stores that
    skip reading the destination first). The difference is the lever placement would have
    with a native copy; pure Python gets streaming stores only from calls that large."""
    import ctypes

    src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    s, d = src.ctypes.data, dst.ctypes.data

    def pieces() -> None:
        for at in range(0, nbytes, 16 << 20):
            ctypes.memmove(d + at, s + at, min(16 << 20, nbytes - at))

    def whole() -> None:
        ctypes.memmove(d, s, nbytes)

    out: dict[str, list[float]] = {"16 MiB calls": [], "one call": []}
    for _ in range(5):
        for label, fn in (("16 MiB calls", pieces), ("one call", whole)):
            c0 = time.thread_time()
            fn()
            out[label].append((time.thread_time() - c0) / (nbytes / 1e9))
    return out


def one_tensor_parts(sv: Path, name: str, repeats: int) -> dict[str, list[float]]:
    """The one-tensor read's parts, each timed alone: opening the store and the checkpoint
    (manifest read, checksum, parse) and checking the tensor's segments on one thread (the
    bytes it must read: a verified read touches every byte, ``safe_open`` one per page)."""
    from stepvault.format.hashing import check_segments
    from stepvault.format.objects import parse_header
    from stepvault.store import Store

    ck = stepvault.open(sv).checkpoint("bench", 1)
    digest, off, length = ck.manifest.tensors[name].chunks[0]
    mapped = Store.open(sv).map_object(digest)
    assert mapped is not None
    header = parse_header(mapped)
    assert header.sums is not None
    raw = memoryview(mapped)[header.payload_offset :]
    segs = header.sums.segments(off, length)
    out: dict[str, list[float]] = {"open": [], "segment checks": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        stepvault.open(sv).checkpoint("bench", 1)
        t1 = time.perf_counter()
        check_segments(raw, header.sums.hex, header.sums.segment, segs[0], segs[-1])
        t2 = time.perf_counter()
        out["open"].append(t1 - t0)
        out["segment checks"].append(t2 - t1)
    return out


def bench_s3(size_mb: int, repeats: int) -> dict[str, list[float]]:
    """Restore from a store on a local S3 server vs a plain sequential GET of its objects."""
    try:
        import boto3
        from bench_tiers import S3Server
    except ImportError as exc:
        print(f"  s3: skipped ({exc})", flush=True)
        return {}
    server = S3Server()
    try:
        bucket = server.bucket()
        os.environ["AWS_ENDPOINT_URL"] = server.endpoint
        url = f"s3://{bucket}/store"
        state = make_state(size_mb << 20)
        stepvault.save(url, state, run="bench", step=1)
        client = boto3.client("s3", endpoint_url=server.endpoint)
        keys = [
            o["Key"]
            for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix="store/objects/"
            )
            for o in page.get("Contents", [])
        ]
        live = {k: torch.zeros_like(v) for k, v in state.items()}

        def plain_get() -> None:
            for key in keys:
                client.get_object(Bucket=bucket, Key=key)["Body"].read()

        peers: dict[str, Callable[[], Any]] = {
            "plain sequential GET": plain_get,
            "stepvault restore": lambda: stepvault.restore(
                url, live, run="bench", step=1, progress=False
            ),
        }
        times: dict[str, list[float]] = {k: [] for k in peers}
        for fn in peers.values():
            fn()  # warm-up
        for r in range(repeats):
            for label, fn in list(peers.items())[:: 1 if r % 2 else -1]:
                t0 = time.perf_counter()
                fn()
                times[label].append(time.perf_counter() - t0)
        if not all(torch.equal(live[k], state[k]) for k in state):
            raise SystemExit("restored from S3 wrong")
        times["bytes"] = [float(sum(t.nbytes for t in state.values()))]
        print("  s3:", {k: f"{median(v):.3f}" for k, v in times.items()}, flush=True)
        return times
    finally:
        server.stop()


def loaded_note() -> str:
    """A warning when other processes held the cores: torch's copy (safetensors' peer) then
    spins its OpenMP threads (its CPU measured 3x a quiet run's) and the warm ratios flatter
    stepvault, while the one-tensor read's shared checks wait for a core."""
    try:
        busy = os.getloadavg()[0] > (os.cpu_count() or 1)
    except OSError:
        return ""
    if not busy:
        return ""
    return (
        " **The machine was loaded: the verdicts below are not valid** (torch's OpenMP copy, "
        "safetensors' peer, spins on busy cores; measure on a quiet machine)."
    )


def verdict(ratio: float, target: float, applies: bool) -> str:
    """``"<= 1.3x: PASS"`` or ``MISS`` for a row the target applies to, else empty."""
    if not applies:
        return ""
    return f"<= {target:g}x: {'PASS' if ratio <= target else 'MISS'}"


def report(res: dict[str, Any], args: argparse.Namespace) -> str:
    st = "safetensors load+copy"
    warm, cold, one = res["warm"], res["cold"], res["one"]
    m = {k: median(v) for k, v in warm.items()}
    lines = [
        "## Restore at the storage limit (issue 31, `bench_restore.py`)",
        "",
        f"{res['bytes'] / 1e9:.2f} GB fp32 (GPT-2-like mix of tensor sizes), one local disk, "
        f"medians of {args.repeats} (cold: {args.cold_repeats}; one tensor: "
        f"{args.one_repeats}), all ratios from this one run. `fast`: the default read, "
        "xxh3-128 segment checksums recorded at save; `full`: BLAKE3 of every object "
        "(every read before issue 31, and now signed checkpoints). Load average at the "
        f"end of the run: {load_average()} on {os.cpu_count()} cores.{loaded_note()}",
        "",
        "Verification cost, one thread, per 1 MiB segment:",
        "",
        table(["checksum", "CPU-s per GB", "GB/s per core"], res["checksums"]),
        "",
        "Warm restore (files in the page cache) into existing tensors:",
        "",
        table(
            ["read", "seconds", "vs safetensors load+copy", "target"],
            [
                [k, f"{m[k]:.3f}", f"{m[k] / m[st]:.2f}x", verdict(m[k] / m[st], 1.3, k == "fast")]
                for k in m
            ],
        ),
    ]
    if res.get("phases"):
        ph = {k: median(v) for k, v in res["phases"].items()}
        floor = (ph["verify"] + ph["place"]) / ph["safetensors"]
        lines += [
            "",
            "Where the warm `fast` restore's time goes (each pass timed alone, same run; CPU of "
            "every thread): "
            f"verify (open, fetch, check every segment) {ph['verify'] * 1e3:.1f} ms "
            f"(CPU {ph['verify cpu'] * 1e3:.1f} ms), place (the copy into the live tensors) "
            f"{ph['place'] * 1e3:.1f} ms (CPU {ph['place cpu'] * 1e3:.1f} ms), safetensors "
            f"load + copy {ph['safetensors'] * 1e3:.1f} ms (CPU "
            f"{ph['safetensors cpu'] * 1e3:.1f} ms). Placement is the same pass over the same "
            "bytes as safetensors' copy; verification is one more read of every byte, and "
            "cannot overlap placement (nothing is placed before the last object verified). "
            f"Floor of a verified restore here: (verify + place) / safetensors = **{floor:.2f}x**.",
        ]
    if res.get("adam"):
        ad = {k: median(v) for k, v in res["adam"].items()}
        base, base_cpu = ad[ADAM_PEERS["safetensors"]], ad[ADAM_PEERS["safetensors"] + " cpu"]
        lines += [
            "",
            f"Warm restore of a model + AdamW state ({ad['bytes'] / 1e9:.2f} GB, 2/3 of it "
            "moments) into a live model and an optimizer that has state (an in-process "
            "restore, a rollback); a new process's optimizer has no state and gets fresh "
            "moments. safetensors: `load_file` (zero-copy, its private file mapping) + "
            "`copy_` into the live parameters and moments. CPU of every thread:",
            "",
            table(
                ["read", "seconds", "CPU-s", "vs safetensors (wall)", "vs safetensors (CPU)"],
                [
                    [
                        label,
                        f"{ad[label]:.3f}",
                        f"{ad[label + ' cpu']:.3f}",
                        f"{ad[label] / base:.2f}x",
                        f"{ad[label + ' cpu'] / base_cpu:.2f}x",
                    ]
                    for label in ADAM_PEERS.values()
                ],
            ),
        ]
    if res.get("copy_speeds"):
        cs = {k: median(v) for k, v in res["copy_speeds"].items()}
        lines += [
            "",
            "One thread's host copy, CPU-s per GB: "
            f"{cs['16 MiB calls']:.3f} in 16 MiB `memmove` calls (placement's, glibc's "
            f"`rep movsb`), {cs['one call']:.3f} in one 384 MiB call (above glibc's "
            "non-temporal threshold: streaming stores). A native placement copy with "
            "streaming stores is the lever left for the warm target; verification already "
            "reads each byte once at the memory's speed.",
        ]
    if res.get("streaming"):
        sm = {k: median(v) for k, v in res["streaming"].items()}
        rows = []
        for mode in ("default", "streaming"):
            r, s = sm[f"{mode} restore"], sm[f"{mode} safetensors"]
            rc, sc = sm[f"{mode} restore cpu"], sm[f"{mode} safetensors cpu"]
            ms = [f"{x * 1e3:.1f}" for x in (r, rc, s, sc)]
            rows.append([mode, *ms, f"{r / s:.2f}x", f"{rc / sc:.2f}x"])
        lines += [
            "",
            "The same warm restore in child processes started with and without "
            f"`GLIBC_TUNABLES={STREAMING_TUNABLE}` (glibc then copies every call of 1 MiB "
            "or more with streaming stores, placement's 16 MiB pieces included; torch's "
            "`copy_`, safetensors' copy, is its own loop), children alternated. A setting "
            "of the whole process (STORAGE.md, Measured), not a default:",
            "",
            table(
                [
                    "glibc copies",
                    "fast ms",
                    "fast CPU ms",
                    "safetensors ms",
                    "safetensors CPU ms",
                    "fast / safetensors (wall)",
                    "(CPU)",
                ],
                rows,
            ),
        ]
    if cold:
        c = {k: median(v) for k, v in cold.items()}
        raw = c["raw parallel read"]
        lines += [
            "",
            "Cold restore (page cache dropped before each read):",
            "",
            table(
                ["read", "seconds", "vs raw parallel read", "vs safetensors", "target"],
                [
                    [
                        k,
                        f"{c[k]:.3f}",
                        f"{c[k] / raw:.2f}x",
                        f"{c[k] / c[st]:.2f}x",
                        f"{verdict(c[k] / raw, 1.2, True)}, {verdict(c[k] / c[st], 1.0, True)}"
                        if k == "fast"
                        else "",
                    ]
                    for k in c
                ],
            ),
        ]
    s = {k: median(v) for k, v in res["save"].items()}
    o = {k: median(v) for k, v in one.items() if isinstance(v, list)}
    lines += [
        "",
        f"One tensor with `mmap=True` ({one['bytes'] / 1e6:.1f} MB, warm): stepvault "
        f"{o['stepvault'] * 1e3:.2f} ms, `safe_open` {o['safe_open'] * 1e3:.2f} ms: "
        f"**{o['stepvault'] / o['safe_open']:.2f}x** "
        f"({verdict(o['stepvault'] / o['safe_open'], 2.0, True)}).",
    ]
    if res.get("one_parts"):
        op = {k: median(v) for k, v in res["one_parts"].items()}
        cores = os.cpu_count() or 1
        checks = op["segment checks"]
        floor = (op["open"] + checks / cores) / o["safe_open"]
        lines += [
            "",
            f"Its parts, each alone: opening the store and the checkpoint "
            f"{op['open'] * 1e3:.2f} ms; checking the tensor's {one['bytes'] / 1e6:.1f} MB "
            f"of segments on one thread {checks * 1e3:.2f} ms "
            f"({one['bytes'] / checks / 1e9:.1f} GB/s: a verified read reads every byte, "
            "`safe_open` maps the file and the touch reads one cache line per page). Floor "
            f"with the {cores} cores sharing the checks: (open + checks / cores) / safe_open "
            f"= **{floor:.2f}x**.",
        ]
    lines += [
        "",
        f"Save of the same state into a fresh store (medians of {len(res['save']['with sums'])} "
        f"alternated saves, each {min(min(v) for v in res['save'].values()):.2f}-"
        f"{max(max(v) for v in res['save'].values()):.2f} s): {s['with sums']:.3f} s with the "
        f"segment checksums, {s['without sums']:.3f} s without "
        f"({s['with sums'] / s['without sums']:.2f}x); CPU of the whole save "
        f"{median(res['save_cpu']['with sums']):.2f} s vs "
        f"{median(res['save_cpu']['without sums']):.2f} s. The stall (the training "
        "thread's copy) does not compute checksums: the writer threads do.",
    ]
    if res.get("s3"):
        s3 = {k: median(v) for k, v in res["s3"].items()}
        lines += [
            "",
            f"From the S3 tier (moto's server on 127.0.0.1, {s3['bytes'] / 1e6:.0f} MB): "
            f"stepvault restore {s3['stepvault restore']:.2f} s (opening the store, the "
            "manifest, 16 objects fetched at once, verified, placed), one plain sequential "
            f"GET per object {s3['plain sequential GET']:.2f} s with a warm client "
            f"({s3['stepvault restore'] / s3['plain sequential GET']:.2f}x).",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
