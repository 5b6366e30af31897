#!/usr/bin/env python
"""Memory replication to a buddy node: the training thread's stall with replication on vs
off (through the manager, and through the replicator alone), and a restart's restore from
the buddy's memory vs from its own memory.

Two gloo ranks on one machine stand for two nodes (``STEPVAULT_NODE``, a memory root each
under ``--workdir``, by default /dev/shm). Each rank saves ``--size-mb`` of state to its
node's memory store ``--saves`` times; between saves it runs a fixed CPU "training" loop.
Saves alternate replication off / on (so drift of the shared machine hits both alike);
the stall is the training thread's time in ``save`` + ``replicate`` (which only queues),
and the step time is the training loop's time per iteration while replication runs in the
background. Then node n1's memory is wiped and both ranks restart: n1's rank restores from
its buddy's memory ("peer"), n0's from its own ("mem"). Last, the same A/B through
``CheckpointManager(tiers={"mem": MemOptions(replicate=True)})``: asynchronous memory-only saves,
replication off meaning both ranks on one node (no buddy).

Rewrites the section between ``<!-- replication:begin -->`` and ``<!-- replication:end -->``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import table

import stepvault
from stepvault.distributed.replication import Replicator, rank_run
from stepvault.manager.options import MemOptions
from stepvault.store import Store


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, task: str, mem: str, out: str, args: dict) -> None:
    # "manager-off": both ranks on one node (no buddy: nothing is replicated), else two
    node = "n0" if task == "manager-off" else f"n{rank}"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), STEPVAULT_NODE=node)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    if task.startswith("manager"):
        _manager(rank, task, Path(mem), Path(out), args)
    root = Path(mem) / f"n{rank}"
    own = Store.open(root / "own", create=True)
    rep = Replicator(own, root)
    torch.manual_seed(rank)
    n = args["size_mb"] * 2**20 // 4
    state = {"w": torch.randn(n)}
    result: dict = {}
    if task == "save":
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        stall: dict[str, list[float]] = {"off": [], "on": []}
        steps: dict[str, list[float]] = {"off": [], "on": []}
        for i in range(1, 2 * args["saves"] + 1):
            mode = "on" if i % 2 == 0 else "off"
            state["w"].add_(1.0)  # every chunk changes: every save replicates everything
            dist.barrier()
            t0 = time.perf_counter()
            stepvault.save(own, state, run=rank_run("r", rank), step=i, collective=False)
            if mode == "on":
                rep.replicate("r", i)
            stall[mode].append(time.perf_counter() - t0)
            t1, iters = time.perf_counter(), 0
            while iters < args["iters"]:
                a = torch.tanh(a @ b)
                iters += 1
            steps[mode].append((time.perf_counter() - t1) / iters)
            rep.wait()  # the next save starts from a quiet machine in both modes
            for s in own.list_steps(rank_run("r", rank))[:-2]:
                own.delete_manifest(rank_run("r", rank), s)
        result = {"stall": stall, "step": steps}
    else:
        from stepvault.core.peer_restore import restore_from_memory

        state["w"].zero_()
        t0 = time.perf_counter()
        info = restore_from_memory(rep, state, run="r")
        result = {
            "seconds": time.perf_counter() - t0,
            "tier": info.tier if info else None,
            "step": info.step if info else None,
        }
    Path(out, f"{task}{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # no close: the memory roots outlive the job, as after a crash


def _manager(rank: int, task: str, mem: Path, out: Path, args: dict) -> None:
    """``CheckpointManager(tiers={"mem": MemOptions(replicate=True)})`` as a training job uses it:
    asynchronous memory-only saves (disk every 10**6 steps), stall = ``handle.stall_seconds``
    (the copy into host memory), the training loop timed while the write and the
    replication run in the background; the first save (buffers allocated) is not counted."""
    from stepvault.tiers import CopyEvery

    torch.manual_seed(rank)
    state = {"w": torch.randn(args["size_mb"] * 2**20 // 4)}
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    stall: list[float] = []
    steps: list[float] = []
    bare: list[float] = []
    buf = torch.empty_like(state["w"])
    with stepvault.CheckpointManager(
        mem / "disk",
        "m",
        tiers={
            "mem": MemOptions(
                path=mem / os.environ["STEPVAULT_NODE"], budget="16GB", replicate=True
            )
        },
        tier_policy=CopyEvery("hot", steps=10**6),
        lineage=False,
    ) as mgr:
        replicator = mgr._p.rank_mem.replicator
        for i in range(1, args["saves"] + 2):
            state["w"].add_(1.0)  # every chunk changes: every save replicates everything
            dist.barrier()
            t0 = time.perf_counter()
            buf.copy_(state["w"])  # the floor: a bare copy of the same bytes
            bare.append(time.perf_counter() - t0)
            handle = mgr.save(i, state)
            t1, iters = time.perf_counter(), 0
            while iters < args["iters"]:
                a = torch.tanh(a @ b)
                iters += 1
            if i > 1:
                stall.append(handle.stall_seconds)
                steps.append((time.perf_counter() - t1) / iters)
            mgr.wait()
            replicator.wait()  # the next save starts from a quiet machine
        replicated = replicator.buddy is not None
    result = {"stall": stall, "step": steps, "bare": bare[1:], "replicated": replicated}
    Path(out, f"{task}{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def _run(task: str, mem: Path, out: Path, args: dict) -> list[dict]:
    mp.start_processes(
        _worker,
        args=(_port(), task, str(mem), str(out), args),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    return [json.loads((out / f"{task}{r}.json").read_text()) for r in range(2)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=int, default=256, help="state per rank")
    p.add_argument("--saves", type=int, default=5, help="saves per mode (off, on)")
    p.add_argument("--iters", type=int, default=200, help="training iterations after a save")
    p.add_argument("--workdir", type=Path, default=Path("/dev/shm"))
    p.add_argument("--out", type=Path, default=_common.REPO / "BENCHMARKS.md")
    args = p.parse_args()
    facts = _common.machine_facts(args.workdir)
    t0 = time.perf_counter()
    opts = {"size_mb": args.size_mb, "saves": args.saves, "iters": args.iters}
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="stepvault-repl-") as tmp:
        mem, out = Path(tmp) / "mem", Path(tmp) / "out"
        out.mkdir()
        saved = _run("save", mem, out, opts)
        shutil.rmtree(mem / "n1")  # node n1 replaced
        restored = _run("restore", mem, out, opts)
        managed = {}
        for mode in ("manager-off", "manager-on"):  # one node (no buddy) vs two nodes
            shutil.rmtree(mem, ignore_errors=True)
            managed[mode] = _run(mode, mem, out, opts)
        assert not any(r["replicated"] for r in managed["manager-off"])
        assert all(r["replicated"] for r in managed["manager-on"])

    def med(key: str, mode: str) -> float:
        return statistics.median(x for r in saved for x in r[key][mode])

    rows = [
        [
            "training-thread stall per save (save to mem + replicate call)",
            _common.fmt_s(med("stall", "off")),
            _common.fmt_s(med("stall", "on")),
        ],
        [
            "training step while the replica is sent (256² matmul + tanh)",
            f"{med('step', 'off') * 1e3:.3f} ms",
            f"{med('step', 'on') * 1e3:.3f} ms",
        ],
    ]

    def mgr_med(mode: str, key: str) -> float:
        return statistics.median(x for r in managed[mode] for x in r[key])

    off, on = "manager-off", "manager-on"
    manager_rows = [
        [
            "stall per save (`handle.stall_seconds`: the copy into host memory)",
            _common.fmt_s(mgr_med(off, "stall")),
            _common.fmt_s(mgr_med(on, "stall")),
        ],
        [
            "a bare copy of the same bytes (the floor), just before each save",
            _common.fmt_s(mgr_med(off, "bare")),
            _common.fmt_s(mgr_med(on, "bare")),
        ],
        [
            "training step while the save (and the replica) is written",
            f"{mgr_med(off, 'step') * 1e3:.3f} ms",
            f"{mgr_med(on, 'step') * 1e3:.3f} ms",
        ],
    ]
    stall_ratio = mgr_med(on, "stall") / mgr_med(off, "stall")
    restore_rows = [
        [f"rank {r} (node n{r})", str(x["tier"]), str(x["step"]), _common.fmt_s(x["seconds"])]
        for r, x in enumerate(restored)
    ]
    minutes = (time.perf_counter() - t0) / 60
    section = "\n".join(
        [
            "## Memory replication to a buddy node",
            "",
            f"Generated by `python benchmarks/bench_replication.py --size-mb {args.size_mb} "
            f"--saves {args.saves}` in {minutes:.1f} min on {facts['date']}. "
            f"{_common.facts_line(facts)}; load average at start "
            f"{facts['load average at start']}.",
            "",
            f"Two gloo ranks on one machine as two nodes, {args.size_mb} MiB of state per rank, "
            f"{args.saves} saves per mode alternating off/on, medians over both ranks. Every "
            "save changes every chunk, so every replicated save sends the whole state.",
            "",
            "**Through the manager** "
            "(`CheckpointManager(tiers={'mem': MemOptions(replicate=True)})`, "
            "asynchronous memory-only saves, medians over both ranks of the saves after the "
            "first; replication off = both ranks on one node, so no rank has a buddy):",
            "",
            table(["measure", "replication off", "replication on"], manager_rows),
            "",
            f"Stall with replication / without: {stall_ratio:.2f}x (target: unchanged). The "
            "training thread only copies the state into host memory and queues the "
            "replica; the commit into memory and the sending run on background threads.",
            "",
            "**Through the replicator alone** (the caller saves synchronously into its memory "
            "store, then queues the replica with `rep.replicate`):",
            "",
            table(["measure", "replication off", "replication on"], rows),
            "",
            "Restart after node n1's memory was wiped (all ranks agree on the newest step, "
            "the wiped node's rank fetches it from its buddy, every object hash-verified, "
            "then both verify and load):",
            "",
            table(["rank", "tier", "step", "restore time"], restore_rows),
            "",
            "Both ranks and the replication threads share this machine's cores, so the step "
            "time with replication on includes the CPU the sender and receiver use (on real "
            "nodes the receiver is another machine).",
        ]
    )
    _common.write_section(args.out, "replication", section)
    print(section)


if __name__ == "__main__":
    main()
