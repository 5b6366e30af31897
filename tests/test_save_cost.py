"""A save costs the same at checkpoint 10,000 as at checkpoint 1.

The parent of a new checkpoint is the writer's own last commit (no listing of the run per
save), retention deletes manifests only and the sweep of their objects runs off the commit
path, and GC's mark reads the object lists recorded at commit instead of parsing every
manifest. Each test checks a behaviour a user sees: the listing or manifest reads a save
does, the parent chain, the space a long job gets back, and that nothing live is swept.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

import stepvault
from stepvault.engine import parent as parent_module
from stepvault.engine.gc import referenced_objects, sweep
from stepvault.format import manifest as manifest_format
from stepvault.format import parse_manifest
from stepvault.manager import sweeping
from stepvault.manager.options import GCOptions, ManagerOptions
from stepvault.ops import usage, verify
from stepvault.store import Store


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(32, 8), "step": 0}


def _parent_steps(root: Path, run: str) -> dict[int, int | None]:
    store = Store.open(root)
    return {
        s: parse_manifest(store.read_manifest(run, s)).parent_step for s in store.list_steps(run)
    }


@pytest.fixture
def count_listings(monkeypatch):
    calls: Counter[str] = Counter()
    original = Store.list_steps

    def list_steps(self, run):
        calls[run] += 1
        return original(self, run)

    monkeypatch.setattr(Store, "list_steps", list_steps)
    return calls


@pytest.fixture
def count_manifest_reads(monkeypatch):
    reads: Counter[str] = Counter()
    one, many = Store.read_manifest, Store.read_manifests

    def read_manifest(self, run, step):
        reads[run] += 1
        return one(self, run, step)

    def read_manifests(self, run, steps):
        steps = list(steps)
        reads[run] += len(steps)
        return many(self, run, steps)

    monkeypatch.setattr(Store, "read_manifest", read_manifest)
    monkeypatch.setattr(Store, "read_manifests", read_manifests)
    return reads


@pytest.fixture
def count_parses(monkeypatch):
    parses: Counter[str] = Counter()
    original = manifest_format._from_json

    def counted(doc):
        parses[str(doc.get("run"))] += 1
        return original(doc)

    monkeypatch.setattr(manifest_format, "_from_json", counted)
    return parses


def test_saves_into_a_run_do_not_list_it_and_chain_their_parents(tmp_path, count_listings):
    state = _state()
    for step in range(1, 31):
        state["step"] = step
        stepvault.save(tmp_path, state, run="r", step=step)
    # The first save of this process into the run lists it once; the other 29 take the
    # parent from the last commit.
    assert count_listings["r"] <= 1
    parents = _parent_steps(tmp_path, "r")
    assert parents == {s: (s - 1 if s > 1 else None) for s in range(1, 31)}


def test_a_deleted_parent_or_a_rewind_falls_back_to_the_run_listing(tmp_path):
    state = _state()
    for step in (1, 2, 3):
        stepvault.save(tmp_path, state, run="r", step=step)
    # Another process (stepvault gc, a tier mover) deleted the newest checkpoint.
    Store.open(tmp_path).delete_manifest("r", 3)
    stepvault.save(tmp_path, state, run="r", step=4)
    stepvault.save(tmp_path, state, run="r", step=10)
    stepvault.save(tmp_path, state, run="r", step=7)  # below the last commit: listed
    assert _parent_steps(tmp_path, "r") == {1: None, 2: 1, 4: 2, 7: 4, 10: 4}


def test_a_new_process_finds_the_parent_its_predecessor_committed(tmp_path):
    state = _state()
    for step in (1, 2):
        stepvault.save(tmp_path, state, run="r", step=step)
    code = (
        "import sys, torch, stepvault\n"
        "torch.manual_seed(0)\n"
        "stepvault.save(sys.argv[1], {'model': torch.nn.Linear(32, 8), 'step': 5},"
        " run='r', step=5)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=120)
    assert _parent_steps(tmp_path, "r")[5] == 2
    # The manifest's object table was reused from that parent: nothing new was written.
    assert parse_manifest(Store.open(tmp_path).read_manifest("r", 5)).stats["new_bytes"] == 0


def test_requests_per_unchanged_save_do_not_grow_with_the_run():
    per_save = {}
    for length in (5, 60):
        store = Store.open(f"memory://save-cost-{length}-{time.time_ns()}", create=True)
        state = _state()
        for step in range(length):
            stepvault.save(store, state, run="r", step=step)
        calls: Counter[str] = Counter()
        backend = store.backend
        for name in ("read_bytes", "read_range", "read_many", "put_atomic", "exists", "list"):
            method = getattr(backend, name)

            def wrapped(*a, _m=method, _n=name, _calls=calls, **k):
                _calls[_n] += 1
                return _m(*a, **k)

            setattr(backend, name, wrapped)
        for i in range(3):
            stepvault.save(store, state, run="r", step=length + i)
        per_save[length] = dict(calls)
    assert per_save[5] == per_save[60]
    assert per_save[60].get("list", 0) == 0  # the run is not listed once it was written


def test_retention_reads_no_other_run_and_the_sweep_comes_later(
    tmp_path, count_manifest_reads, count_parses
):
    state = _state()
    for run in ("other-a", "other-b"):
        for step in range(20):
            stepvault.save(tmp_path, _state(step), run=run, step=step)
    count_manifest_reads.clear()
    count_parses.clear()
    swept_on: list[str] = []
    real_sweep = sweeping.sweep

    def recording_sweep(store, **kw):
        swept_on.append(threading.current_thread().name)
        return real_sweep(store, **kw)

    sweeping.sweep = recording_sweep
    try:
        with stepvault.CheckpointManager(
            tmp_path,
            "r",
            keep=stepvault.KeepLast(2),
            async_save=False,
            options=ManagerOptions(gc=GCOptions(grace_seconds=0)),
        ) as mgr:
            for step in range(1, 6):
                with torch.no_grad():
                    state["model"].weight.add_(1.0)  # new bytes each save
                mgr.save(step, state)
            reads_during_saves = dict(count_manifest_reads)
            assert [c.step for c in mgr.checkpoints()] == [4, 5]
            assert swept_on == []  # 3 deletions: fewer than a sweep waits for
    finally:
        sweeping.sweep = real_sweep
    assert reads_during_saves.get("other-a", 0) == 0
    assert reads_during_saves.get("other-b", 0) == 0
    assert reads_during_saves.get("r", 0) <= 5  # the new manifest's record, once per save
    assert swept_on == ["MainThread"]  # close() swept, with every save done
    assert usage(tmp_path).unreferenced_objects == 0
    events = [e["event"] for e in mgr.events()]
    assert events.count("delete") == 3 and events[-1] == "gc"


def test_enough_deletions_are_swept_in_the_background(tmp_path, monkeypatch):
    monkeypatch.setattr(sweeping, "CONCURRENT_GRACE_FLOOR", 0.0)
    state = _state()
    swept_on: list[str] = []
    real_sweep = sweeping.sweep

    def recording_sweep(store, **kw):
        swept_on.append(threading.current_thread().name)
        return real_sweep(store, **kw)

    monkeypatch.setattr(sweeping, "sweep", recording_sweep)
    with stepvault.CheckpointManager(
        tmp_path,
        "r",
        keep=stepvault.KeepLast(1),
        async_save=True,
        options=ManagerOptions(gc=GCOptions(grace_seconds=0, sweep_after_deletions=2)),
    ) as mgr:
        for step in range(1, 4):
            with torch.no_grad():
                state["model"].weight.add_(1.0)
            mgr.save(step, state)
            mgr.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and usage(tmp_path).unreferenced_objects:
            time.sleep(0.05)
        # Freed while the manager is still open, by the sweeper's thread.
        assert usage(tmp_path).unreferenced_objects == 0
        assert swept_on and swept_on[0] == "stepvault-sweep"
        assert mgr.stats()["freed_bytes"] > 0
    info = stepvault.restore(tmp_path, _state(9), run="r")
    assert info.step == 3


def test_the_mark_reads_recorded_object_lists_and_never_loses_a_live_object(tmp_path, count_parses):
    for step in range(1, 6):
        stepvault.save(tmp_path, _state(step), run="r", step=step)
    store = Store.open(tmp_path)
    _, unreadable = referenced_objects(store)
    assert not unreadable and sum(count_parses.values()) == 0  # every list was recorded
    # Step 3 rewritten with other tensors (overwrite=True): its new manifest is not in the
    # recorded lists under its old checksum, so it is parsed, and its objects are live.
    new_state = _state(99)
    stepvault.save(tmp_path, new_state, run="r", step=3, overwrite=True)
    # A damaged log line and a damaged compacted file are ignored, never trusted.
    runs = tmp_path / "runs" / "r"
    with open(runs / "objects.log", "ab") as f:
        f.write(b'0000 ["deadbeef", []]\n')
    count_parses.clear()
    report = sweep(store, grace_seconds=0)
    assert not report.unreadable_manifests
    assert sum(count_parses.values()) <= 1  # at most the rewritten one (recorded: 0)
    restored = _state(0)
    stepvault.restore(tmp_path, restored, run="r", step=3)
    assert torch.equal(restored["model"].weight, new_state["model"].weight)
    assert verify(tmp_path, deep=True).ok
    # Lists that are gone (an older store): the mark parses, and finds the same objects.
    (runs / "objects.json").unlink(missing_ok=True)
    (runs / "objects.log").unlink(missing_ok=True)
    count_parses.clear()
    live_again, _ = referenced_objects(store)
    assert sum(count_parses.values()) == 5
    assert live_again == referenced_objects(store)[0]
    compacted = json.loads((runs / "objects.json").read_bytes().partition(b"\n")[2])
    assert len(compacted) == 5


def test_parent_memory_is_per_store_and_run():
    a = Store.open(f"memory://parent-a-{time.time_ns()}", create=True)
    b = Store.open(f"memory://parent-b-{time.time_ns()}", create=True)
    stepvault.save(a, _state(), run="r", step=10)
    stepvault.save(b, _state(), run="r", step=1)
    stepvault.save(b, _state(), run="r", step=2)
    assert parse_manifest(b.read_manifest("r", 2)).parent_step == 1
    parent_module.forget_commits(a, "r")
    stepvault.save(a, _state(), run="r", step=11)  # lists once: still right
    assert parse_manifest(a.read_manifest("r", 11)).parent_step == 10


def test_recorded_object_lists_equal_the_committed_tables(tmp_path):
    """Every kind of save records exactly the ``objects`` table a parse of its manifest
    gives (attachments merged in, a light save's base chunks adopted), so GC's mark from
    the lists keeps what a mark from parsed manifests keeps."""
    from stepvault.engine.object_lists import load_object_lists

    m = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 64)).sum().backward()
    opt.step()
    state = {"model": m, "optimizer": opt}
    stepvault.save(tmp_path, state, run="r", step=1, attachments={"config.json": b"{}"})
    with torch.no_grad():
        m.weight.add_(1e-3)
    stepvault.save(tmp_path, state, run="r", step=2, kind="light")
    stepvault.save(tmp_path, state, run="r", step=3, kind="weights")
    store = Store.open(tmp_path)
    lists, had_log = load_object_lists(store, "r")
    assert had_log and len(lists) == 3
    for step in (1, 2, 3):
        data = store.read_manifest("r", step)
        digest = json.loads(data.partition(b"\n")[0])["body_blake3"]
        assert sorted(lists[digest]) == sorted(parse_manifest(data).objects), step
