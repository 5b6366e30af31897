"""The mem tier (issue 16, part A): node-memory checkpoints that survive a killed process,
a budget never exceeded, restore order mem -> disk -> object storage, clean-up."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import final_digest, linear, run_train_loop, start_train_loop, wait_for_line
from typer.testing import CliRunner

import stepvault
from stepvault import CheckpointManager
from stepvault.catalog.events import read_events
from stepvault.format import parse_manifest
from stepvault.manager.options import MemOptions
from stepvault.store import Store
from stepvault.tiers import CopyEvery, MemLast
from stepvault.tiers.mem import list_mem_tiers, mem_dir, reclaim_stale


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _events(mgr_or_store, run="r") -> list[dict]:
    store = mgr_or_store.store if hasattr(mgr_or_store, "store") else mgr_or_store
    return read_events(store, run)


# ------------------------------------------------------------ one process, SIGKILL, resume
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Digest of an uninterrupted run without a mem tier."""
    return final_digest(run_train_loop(tmp_path_factory.mktemp("ref"), "--steps", "30"))


@pytest.mark.slow  # two training processes: ~10 s on an idle machine, a minute on a busy one
def test_sigkill_resumes_from_memory_bitwise(tmp_path, reference):
    """Saves go to memory only (disk every 1000th step): after SIGKILL the restart resumes
    from the mem tier, and the continued run ends bitwise equal to an uninterrupted one."""
    store, mem = tmp_path / "ck", tmp_path / "shm"
    args = ["--steps", "30", "--mem", str(mem), "--disk-every", "1000"]
    proc = start_train_loop(store, *args, "--step-sleep", "0.05")
    wait_for_line(proc, "STEP 23")  # the saves of steps 5..20 are committed (tiny model)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert Store.open(store).list_steps("job") == []  # nothing reached the disk
    (held,) = list_mem_tiers(str(mem))
    assert held.steps and held.steps[-1] >= 15 and not held.stale  # owner gone, not on disk
    stdout = run_train_loop(store, *args)
    assert f"RESUMED {held.steps[-1]}" in stdout
    assert "FROM mem " in stdout
    assert final_digest(stdout) == reference
    # Closed normally: the newest mem checkpoint was flushed to disk, the mem tier removed.
    assert Store.open(store).list_steps("job") == [30]
    assert list_mem_tiers(str(mem)) == []
    assert stepvault.ops.verify(store, deep=True).ok


# ------------------------------------------------------------------------------- budget
def test_copy_every_minutes_sends_one_save_per_interval_to_disk(tmp_path):
    """CopyEvery("hot", minutes=10): every save goes to memory; the first goes to disk, then
    the first at least 10 minutes after the last one on disk (a fake wall clock); a
    restarted manager counts from the newest checkpoint on disk."""
    mem, clock = tmp_path / "shm", [1_000_000.0]
    opts = dict(
        tiers={"mem": MemOptions(path=mem, cleanup=False)},
        tier_policy=CopyEvery("hot", minutes=10),
    )
    m = linear(0, 32, 32)
    with CheckpointManager(tmp_path / "ck", "r", **opts) as mgr:
        mgr._p.mem.clock = lambda: clock[0]
        for step in range(1, 9):  # one save per 4 minutes
            mgr.save(step, {"model": m}, force=True)
            mgr.wait()
            clock[0] += 240
        assert mgr.store.list_steps("r") == [1, 4, 7]  # at 0, 12 and 24 minutes
        assert mgr.mem_tier.steps() == list(range(1, 9))
        assert mgr.latest_step == 8  # only in memory, and what a restore would take
        tiers = {e["step"]: e["tier"] for e in _events(mgr) if e["event"] == "save"}
        assert tiers[2] == "mem" and tiers[4] == "mem+hot"
    assert Store.open(tmp_path / "ck").list_steps("r") == [1, 4, 7, 8]  # close flushed 8
    with CheckpointManager(tmp_path / "ck", "r", **opts) as again:
        newest = again.store.list_steps("r")[-1]
        created = next(r.created for r in again._p.session.records() if r.step == newest)
        again._p.mem.clock = lambda: created + 300  # 5 minutes after it: memory only
        again.save(10, {"model": m}, force=True)
        again.wait()
        assert again.store.list_steps("r") == [1, 4, 7, 8]
        again._p.mem.clock = lambda: created + 601
        again.save(11, {"model": m}, force=True)
        again.wait()
        assert again.store.list_steps("r")[-1] == 11


def test_plain_restore_reads_this_nodes_mem_tier_first(tmp_path):
    """After a crash the newest step may be only in memory: ``stepvault.restore`` finds the
    run's mem tier on this node (as the manager does), verified; ``mem=False`` reads disk;
    ``latest_step`` of a manager counts the step in memory."""
    mem, hot = tmp_path / "shm", tmp_path / "ck"
    m = linear(0, 64, 64)
    mgr = CheckpointManager(
        hot, "r", tiers={"mem": str(mem)}, tier_policy=CopyEvery("hot", steps=3), lineage=False
    )
    expected = {}
    for step in range(1, 5):
        with torch.no_grad():
            m.weight.add_(1.0)
        mgr.save(step, {"model": m}, force=True)
        mgr.wait()
        expected[step] = m.weight.detach().clone()
    assert mgr.store.list_steps("r") == [3] and mgr.latest_step == 4
    got = linear(1, 64, 64)  # (the manager stays open: its process could have died)
    info = stepvault.restore(hot, {"model": got}, run="r", mem=str(mem))
    assert info.step == 4 and torch.equal(got.weight, expected[4])
    info = stepvault.restore(hot, {"model": got}, run="r", mem=False)
    assert info.step == 3 and torch.equal(got.weight, expected[3])
    mem_store = mgr.mem_tier.store  # a damaged memory copy of step 4: step 3 instead
    digests = parse_manifest(mem_store.read_manifest("r", 4), "r@4").objects
    victim = max(
        (p for p in Path(mgr.mem_tier.path, "objects").rglob("*") if p.name in digests),
        key=lambda p: p.stat().st_size,
    )
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    info = stepvault.restore(hot, {"model": got}, run="r", mem=str(mem))
    assert info.step == 3 and torch.equal(got.weight, expected[3])
    assert [k.step for k in info.skipped] == [4]
    mgr.close()


def test_budget_is_never_exceeded_and_a_too_big_save_goes_to_disk(tmp_path):
    mem = tmp_path / "shm"
    budget = 700_000  # room for two or three 256x256 float32 states (~260 KB each)
    with CheckpointManager(
        tmp_path / "ck",
        "r",
        tiers={"mem": MemOptions(path=mem, budget=budget, cleanup=False)},
        tier_policy=CopyEvery("hot", steps=3),  # disk every 3rd: the rest only in memory
        async_save=False,
    ) as mgr:
        m = linear(0, 256, 256)
        assert mgr.mem_tier is not None
        path = Path(mgr.mem_tier.path)
        for step in range(1, 10):
            with torch.no_grad():
                m.weight.add_(1.0)
            mgr.save(step, {"model": m})
            assert _tree_bytes(path) <= budget, step
            assert mgr.mem_tier.steps()[-1] == step  # the newest always fits
        events = _events(mgr)
        evicted = [e for e in events if e["event"] == "mem_evicted"]
        assert evicted and all(e["reason"] == "memory budget" for e in evicted)
        # Copies already on disk go first: an on-disk step leaves before an older one
        # that is only in memory (step 6 before step 5).
        assert any(
            a["on_disk"] and not b["on_disk"] and b["step"] < a["step"]
            for i, a in enumerate(evicted)
            for b in evicted[i + 1 :]
        )
        big = linear(0, 600, 600)  # ~1.4 MB: more than the whole budget
        mgr.save(10, {"model": big})
        assert _tree_bytes(path) <= budget
        assert 10 not in mgr.mem_tier.steps()
        assert 10 in mgr.store.list_steps("r")  # too big for memory: written to disk
        over = [e for e in _events(mgr) if e["event"] == "mem_over_budget"]
        assert over and over[-1]["step"] == 10 and over[-1]["budget"] == budget
    restored = linear(1, 600, 600)
    with CheckpointManager(tmp_path / "ck", "r", tiers={"mem": str(mem)}) as mgr:
        info = mgr.restore({"model": restored})
        assert info is not None and info.step == 10 and info.tier == "hot"
    assert torch.equal(restored.weight, big.weight)


def test_budget_option_is_checked():
    with pytest.raises(ValueError, match="mem budget must be a number of bytes"):
        CheckpointManager("unused", "r", tiers={"mem": MemOptions(budget="lots")})


# --------------------------------------------------------- restore order mem -> disk -> S3
def _flip_a_byte(store_path: Path) -> None:
    obj = max((p for p in (store_path / "objects").rglob("*") if p.is_file()), key=os.path.getsize)
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0xFF
    obj.write_bytes(bytes(data))


def test_restore_falls_back_from_memory_to_disk_to_s3(tmp_path, s3):
    from stepvault.tiers import TierSpec

    bucket = s3.new_bucket()
    archive = TierSpec("archive", f"s3://{bucket}/cold", options={"endpoint_url": s3.endpoint})
    hot, mem = tmp_path / "ck", tmp_path / "shm"
    tiers = {"mem": MemOptions(path=mem, cleanup=False), "archive": archive}
    m = linear(0, 64, 64)
    with CheckpointManager(hot, "r", tiers=tiers, tier_policy=CopyEvery("archive", steps=1)) as mgr:
        mgr.save(1, {"model": m})
        mgr.wait()
        mem_path = Path(mgr.mem_tier.path)
    expected = m.weight.detach().clone()

    def restore():
        out = linear(5, 64, 64)
        with CheckpointManager(hot, "r", tiers=tiers) as mgr:
            info = mgr.restore({"model": out})
        assert torch.equal(out.weight, expected)
        return info

    info = restore()
    assert info.step == 1 and info.tier == "mem"
    event = [e for e in _events(Store.open(hot)) if e["event"] == "restore"][-1]
    assert event["tier"] == "mem" and event["seconds"] > 0
    _flip_a_byte(mem_path)  # damaged in memory: detected by its hash, read from disk
    info = restore()
    assert info.step == 1 and info.tier == "hot" and info.skipped
    assert "hash" in info.skipped[0].reason or "corrupt" in info.skipped[0].reason.lower()
    for path in mem_path.iterdir():  # wiped memory, and the disk copy gone too: from S3
        if path.name != "owner.json":
            subprocess.run(["rm", "-rf", str(path)], check=True)
    Store.open(hot).delete_manifest("r", 1)
    subprocess.run(["rm", "-rf", str(hot / "objects")], check=True)
    info = restore()
    assert info.step == 1 and info.tier == "archive"


# ------------------------------------------------------------------------------ clean-up
def test_close_flushes_the_newest_to_disk_and_removes_the_mem_tier(tmp_path):
    mem = tmp_path / "shm"
    m = linear(0, 32, 32)
    with CheckpointManager(
        tmp_path / "ck",
        "r",
        tiers={"mem": str(mem)},
        tier_policy=MemLast(2) | CopyEvery("hot", steps=4),
    ) as mgr:
        for step in range(1, 7):
            mgr.save(step, {"model": m})
        mgr.wait()
        assert mgr.mem_tier.steps() == [5, 6]  # MemLast(2)
        assert mgr.store.list_steps("r") == [4]
        path = Path(mgr.mem_tier.path)
        assert path.is_dir()
    assert not path.exists()
    assert Store.open(tmp_path / "ck").list_steps("r") == [4, 6]
    names = [e["event"] for e in _events(Store.open(tmp_path / "ck"))]
    assert "mem_flushed" in names and "mem_removed" in names


def test_tiers_ls_shows_what_memory_holds(tmp_path):
    from stepvault.cli.main import app

    mem = tmp_path / "shm"
    with CheckpointManager(
        tmp_path / "ck", "r", tiers={"mem": MemOptions(path=mem, budget="5MB", cleanup=False)}
    ) as mgr:
        mgr.save(1, {"model": linear(0, 64, 64)})
        mgr.save(2, {"model": linear(2, 64, 64)})
    runner = CliRunner()
    res = runner.invoke(
        app, ["--root", str(tmp_path / "ck"), "tiers", "ls", "--mem-root", str(mem), "--json"]
    )
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.output)["mem"]
    assert row["run"] == "r" and row["checkpoints"] == 2 and row["budget"] == 5_000_000
    assert row["bytes"] == _tree_bytes(Path(row["path"])) > 2 * 64 * 64 * 4
    res = runner.invoke(
        app, ["--root", str(tmp_path / "ck"), "tiers", "ls", "--mem-root", str(mem)]
    )
    assert res.exit_code == 0 and "mem tier" in res.output, res.output
    assert "4.8 MiB" in res.output, res.output


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _plant_owner(path: Path, pid: int) -> None:
    record = json.loads((path / "owner.json").read_text())
    record["pid"] = pid
    (path / "owner.json").write_text(json.dumps(record))


def test_stale_mem_tier_of_a_dead_job_is_reclaimed(tmp_path):
    from stepvault.cli.main import app

    mem = tmp_path / "shm"
    # Job A finished normally but kept its mem tier (MemOptions(cleanup=False)), then its process
    # ended: reclaimable.
    with CheckpointManager(
        tmp_path / "a", "r", tiers={"mem": MemOptions(path=mem, cleanup=False)}
    ) as a:
        a.save(1, {"model": linear(0, 16, 16)})
    a_dir = Path(a.mem_tier.path)
    _plant_owner(a_dir, _dead_pid())
    (found,) = list_mem_tiers(str(mem))
    assert found.stale and "finished" in found.reason
    res = CliRunner().invoke(
        app, ["tiers", "mem-gc", "--mem-root", str(mem), "--dry-run", "--json"]
    )
    assert res.exit_code == 0, res.output
    assert [t["path"] for t in json.loads(res.output)["reclaimed"]] == [str(a_dir)]
    assert a_dir.exists()
    # Job B starts on the same node: its manager reclaims A's stale mem tier.
    b = CheckpointManager(
        tmp_path / "b", "r", tiers={"mem": str(mem)}, tier_policy=CopyEvery("hot", steps=100)
    )
    assert not a_dir.exists()
    assert any(e["event"] == "mem_reclaimed" for e in _events(b))
    # B dies holding a checkpoint only in memory (its lease is still there): never reclaimed.
    b.save(1, {"model": linear(0, 16, 16)})
    b.wait()
    b_dir = Path(b.mem_tier.path)
    _plant_owner(b_dir, _dead_pid())
    (found,) = list_mem_tiers(str(mem))
    assert not found.stale and "not on disk" in found.reason
    assert reclaim_stale(str(mem)) == [] and b_dir.exists()
    # The restart resumes and ends normally, keeping the mem tier: its newest checkpoint is
    # flushed to disk and the lease released, so the tier is stale once the process is gone.
    # B "died": no more heartbeats; its lease handed over (a dead pid's lease is taken over
    # at once, as test_crash_resume shows)
    b._p.lease.release()
    b._closed = True
    b2 = CheckpointManager(tmp_path / "b", "r", tiers={"mem": MemOptions(path=mem, cleanup=False)})
    assert b2.restore({"model": linear(3, 16, 16)}).tier == "mem"
    b2.close()
    _plant_owner(b_dir, _dead_pid())
    assert [Path(t.path) for t in reclaim_stale(str(mem))] == [b_dir]
    assert not b_dir.exists()


def test_mem_dir_is_unique_per_store_and_run(tmp_path):
    one = Store.open(tmp_path / "one", create=True)
    two = Store.open(tmp_path / "two", create=True)
    root = str(tmp_path / "shm")
    dirs = {mem_dir(root, s, r) for s in (one, two) for r in ("a", "b")}
    assert len(dirs) == 4


# ------------------------------------------------------------------------- crash campaign
@pytest.mark.slow  # ~20 s: four killed training processes
def test_random_kills_during_mem_saves_leave_only_complete_checkpoints(tmp_path, reference):
    store, mem = tmp_path / "ck", tmp_path / "shm"
    args = ["--steps", "30", "--mem", str(mem), "--disk-every", "10"]
    rng = random.Random(16)
    for _ in range(4):
        proc = start_train_loop(store, *args, "--slow-writes", "0.02")
        wait_for_line(proc, "")  # FRESH or RESUMED: training starts (it may already be done)
        time.sleep(rng.uniform(0.2, 1.5))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        for t in list_mem_tiers(str(mem)):
            # every checkpoint the mem tier lists is complete and verifies, byte for byte
            assert stepvault.ops.verify(t.path, deep=True).ok
    stdout = run_train_loop(store, *args)
    assert final_digest(stdout) == reference


_SLOW_CLOSE = """
import os, shutil, sys, time, torch
from stepvault import CheckpointManager
from stepvault.tiers import MemLast
_unlink, _rmtree = os.unlink, shutil.rmtree
def slow_unlink(*a, **k):  # a slow tmpfs: the kill lands mid-deletion
    time.sleep(0.05)
    return _unlink(*a, **k)
def announced_rmtree(*a, **k):
    print("DELETING", flush=True)
    os.unlink = slow_unlink
    return _rmtree(*a, **k)
shutil.rmtree = announced_rmtree
mgr = CheckpointManager(sys.argv[1], "r", tiers={"mem": sys.argv[2]}, tier_policy=MemLast(3),
                        async_save=False)
m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
for step in range(1, 4):
    with torch.no_grad():
        m[0].weight.add_(1)
    mgr.save(step, {"model": m})
mgr.close()  # the newest is on disk already; then the mem tier is removed
"""


def test_a_kill_during_close_leaves_no_half_removed_mem_tier(tmp_path):
    """SIGKILL while close() deletes the mem tier (file by file) used to leave a tier that
    still listed checkpoints whose objects were gone (a slow-campaign failure: "object ...
    missing" for a listed step). The tier vanishes by one rename first now."""
    mem = tmp_path / "shm"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CLOSE, str(tmp_path / "ck"), str(mem)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert wait_for_line(proc, "DELETING") == "DELETING"
    time.sleep(0.2)  # a few files into the deletion (0.05 s each)
    proc.kill()
    proc.wait(timeout=30)
    for t in list_mem_tiers(str(mem)):  # whatever is listed is whole
        assert stepvault.ops.verify(t.path, deep=True).ok, t
    leftovers = [p for p in mem.iterdir() if p.name.startswith(".removing-")]
    assert leftovers, "the kill should land mid-deletion (a tombstone left)"
    reclaim_stale(str(mem))  # the next job's start clears what the kill left
    assert not list(mem.iterdir())
    # the run itself resumes from disk, untouched
    restored = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    assert stepvault.restore(tmp_path / "ck", {"model": restored}, run="r").step == 3
