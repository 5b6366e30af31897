"""Memory checkpoints replicated to a buddy node over gloo, and restored from it.

Two simulated nodes on one machine (``STEPVAULT_NODE`` and a memory root per node); every
job ends with all ranks SIGKILLed, like a crashed job.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest
import replication_workers
import torch.multiprocessing as mp
from helpers import free_port, spawn_ranks

import stepvault
from stepvault.catalog.events import read_events
from stepvault.distributed.nodes import NodeLayout
from stepvault.distributed.replication import rank_run
from stepvault.errors import StepvaultError
from stepvault.format import parse_manifest
from stepvault.store import Store


def _spawn(world: int, task: str, mem: Path, out: Path, arg: str = "") -> None:
    """Run ``task`` on ``world`` ranks; each rank reports, then SIGKILLs itself."""
    spawn_ranks(replication_workers.run, world, task, mem, out, arg, killed=True)


def _peer(mem: Path, holder_node: str, source_node: str, local: int) -> Store:
    return Store.open(mem / holder_node / "peers" / source_node / f"rank{local}")


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_wiped_node_resumes_bitwise_from_its_buddys_memory(tmp_path, world):
    mem, out = tmp_path / "mem", tmp_path / "out"
    _spawn(world, "train_save", mem, out)
    per_node = world // 2
    for rank in range(world):
        node = replication_workers.node_of(rank, world)
        other = "n1" if node == "n0" else "n0"
        peer = _peer(mem, other, node, rank % per_node)
        # committed objects-then-manifest, verified; step 1 left with the owner's copy
        assert peer.list_steps(rank_run("r", rank)) == [2, 3]
        assert stepvault.ops.verify(peer.backend.url, deep=True).ok
    shutil.rmtree(mem / "n1")  # node n1 was replaced: its memory is gone
    _spawn(world, "resume", mem, out)
    for rank in range(world):
        info = json.loads((out / f"info{rank}.json").read_text())
        wiped = replication_workers.node_of(rank, world) == "n1"
        assert info == {"step": 3, "tier": "peer" if wiped else "mem"}, (rank, info)
        own = Store.open(mem / replication_workers.node_of(rank, world) / "own")
        restores = [e for e in read_events(own, rank_run("r", rank)) if e["event"] == "restore"]
        assert restores[-1]["tier"] == ("peer" if wiped else "mem")
        assert restores[-1]["step"] == 3 and restores[-1]["seconds"] > 0
        if wiped:  # the fetched copy now lives in the new node's memory again
            assert own.list_steps(rank_run("r", rank)) == [3]


def test_a_damaged_own_copy_is_fetched_again_from_the_buddy(tmp_path):
    """A flipped byte in node n0's own memory copy of step 3: rank 0 fetches step 3 again
    from n1's replica instead of every rank falling back to step 2 (bitwise, tier peer)."""
    mem, out = tmp_path / "mem", tmp_path / "out"
    _spawn(2, "train_save", mem, out)
    own = Store.open(mem / "n0" / "own")
    step3 = parse_manifest(own.read_manifest(rank_run("r", 0), 3), "r@3").objects
    files = {p.name: p for p in (mem / "n0" / "own" / "objects").rglob("*") if p.is_file()}
    victim = max((files[d] for d in step3 if d in files), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    _spawn(2, "resume", mem, out)  # checks the state bitwise against step 3's
    infos = [json.loads((out / f"info{rank}.json").read_text()) for rank in (0, 1)]
    assert infos == [{"step": 3, "tier": "peer"}, {"step": 3, "tier": "mem"}]
    assert stepvault.ops.verify(own.backend.url, deep=True).ok  # repaired in place


def test_a_replica_over_the_memory_budget_is_skipped_and_says_so(tmp_path):
    mem, out = tmp_path / "mem", tmp_path / "out"
    _spawn(2, "budget", mem, out)
    for rank, (holder, source) in enumerate([("n1", "n0"), ("n0", "n1")]):
        peer = _peer(mem, holder, source, 0)
        assert peer.list_steps(rank_run("r", rank)) == [1]
        usage = json.loads((out / f"usage{1 - rank}.json").read_text())
        assert usage["peers_after"] == usage["peers_before"]  # not a byte of the replica
        events = read_events(Store.open(mem / holder / "own"), rank_run("r", rank))
        skipped = [e for e in events if e["event"] == "replica_skipped"]
        assert [e["step"] for e in skipped] == [2]
        assert "budget" in skipped[0]["reason"]
    # Both nodes lose their memory of step 2 only on one side: node n1 is wiped, so the
    # newest step every rank can get is 1 (n0 has 1 and 2; n1's ranks only 1, at n0).
    shutil.rmtree(mem / "n1")
    _spawn(2, "resume_any", mem, out, "")
    assert json.loads((out / "info1.json").read_text()) == {"step": 1, "tier": "peer"}
    assert json.loads((out / "info0.json").read_text()) == {"step": 1, "tier": "mem"}


def test_ring_and_buddy_map():
    layout = NodeLayout.of(["a", "a", "b", "b", "c", "c"])
    assert layout.buddies() == {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}
    assert layout.buddies({"a": "c", "c": "b", "b": "a"}) == {0: 4, 1: 5, 4: 2, 5: 3, 2: 0, 3: 1}
    assert NodeLayout.of(["solo", "solo"]).buddies() == {}
    with pytest.raises(StepvaultError, match="same buddy"):
        layout.buddies({"a": "b", "c": "b", "b": "a"})
    with pytest.raises(StepvaultError, match="not in the group"):
        layout.buddies({"a": "z"})
    with pytest.raises(StepvaultError, match="same local rank"):
        NodeLayout.of(["a", "a"], [0, 0])


@pytest.mark.slow
def test_killed_during_replication_leaves_no_partial_replica(tmp_path):
    """Random SIGKILLs while 2 ranks save and replicate 8 MB states (30-80 s here)."""
    rng = random.Random(16)
    for attempt in range(3):
        mem, out = tmp_path / f"mem{attempt}", tmp_path / f"out{attempt}"
        out.mkdir()
        ctx = mp.start_processes(
            replication_workers.run,
            args=(2, free_port(), "replicate_loop", str(mem), str(out), str(8 << 20)),
            nprocs=2,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + 30
        while not (out / "progress1").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))
        for p in ctx.processes:
            p.kill()
        for p in ctx.processes:
            p.join()
        for holder, source in [("n1", "n0"), ("n0", "n1")]:
            root = mem / holder / "peers" / source / "rank0"
            if not root.exists():
                continue
            report = stepvault.ops.verify(str(root), deep=True)
            assert report.ok, report
        # What survived restores on a restart, from the buddy for the wiped node.
        shutil.rmtree(mem / "n1")
        _spawn(2, "resume_any", mem, out, str(8 << 20))
        info = [json.loads((out / f"info{r}.json").read_text()) for r in (0, 1)]
        if info[1] is not None:
            assert info[1]["tier"] == "peer" and info[0]["step"] == info[1]["step"]
