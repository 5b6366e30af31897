"""Tiered storage: policies and plans, the mover behind a CheckpointManager, dedup per tier,
restore from any tier (hot first), the CLI, an S3 cold tier behind a faulty network, and a
SIGKILL in the middle of a tier move."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from s3_server import ENV, FaultProxy
from typer.testing import CliRunner

import stepvault
from stepvault import CheckpointManager, ops
from stepvault.catalog.events import read_events
from stepvault.cli.main import app
from stepvault.errors import CheckpointNotFoundError
from stepvault.manager.options import GCOptions, ManagerOptions
from stepvault.ops.usage import usage_by_tier
from stepvault.policy import CheckpointRecord, KeepLast
from stepvault.store import Store
from stepvault.tiers import (
    ArchiveProtected,
    CopyEvery,
    HotLast,
    MoveAfter,
    TieredView,
    TierError,
    Tiers,
    TierSpec,
    add_tier,
    apply_tier_policy,
    catalog,
    copy_checkpoint,
    plan_tiers,
)

SCRIPT = Path(__file__).parent / "scripts" / "tier_move.py"


def model(seed: int = 0, width: int = 64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 4))


def state_of(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def records(n: int, pinned=(), gap: float = 60.0) -> list[CheckpointRecord]:
    return [CheckpointRecord(s, 1000.0 + s * gap, pinned=s in pinned) for s in range(1, n + 1)]


# ---------------------------------------------------------------------------- policies


def test_policies_print_compose_and_plan():
    policy = HotLast(2) | CopyEvery("archive", steps=5) | ArchiveProtected("archive")
    assert repr(policy) == (
        "HotLast(2) | CopyEvery('archive', steps=5) | ArchiveProtected('archive')"
    )
    assert repr((HotLast(2) | CopyEvery("a", steps=5)) | HotLast(2)) == (
        "HotLast(2) | CopyEvery('a', steps=5)"
    )
    plan = plan_tiers(records(12, pinned={3}), policy, now=5000.0, holdings={"archive": {5}})
    assert plan.copies == [(3, "archive"), (10, "archive")]
    by_step = {e.step: e for e in plan.entries}
    assert plan.evictions == [1, 2, 4, 5, 6, 7, 8, 9, 10]
    assert by_step[5].hot_action == "evict" and by_step[10].hot_action == "evict"
    assert by_step[1].hot_action == "drop"  # no tier wants it: deleted, as a keep policy would
    assert by_step[3].hot_action == "" and "pinned: stays in hot" in by_step[3].reasons
    assert by_step[12].hot_action == "" and "last 2 in hot" in by_step[12].reasons
    assert "copy->archive" in str(plan)
    with pytest.raises(ValueError):
        HotLast(0)
    with pytest.raises(ValueError):
        CopyEvery("a", steps=2, minutes=3)


def test_time_based_copy_and_age_based_move():
    recs = records(10, gap=60.0)  # one checkpoint a minute
    every2 = plan_tiers(recs, CopyEvery("a", minutes=2), now=2000.0, holdings={"a": set()})
    assert [s for s, _ in every2.copies] == [1, 3, 5, 7, 9]
    # What the tier already holds anchors the spacing: no re-copy, no drift.
    held = plan_tiers(recs, CopyEvery("a", minutes=2), now=2000.0, holdings={"a": {2}})
    assert [s for s, _ in held.copies] == [4, 6, 8, 10]
    # Older than 5 minutes at now=1000+10*60: steps 1..5 move; the newest never leaves hot.
    moved = plan_tiers(recs, MoveAfter("a", minutes=5), now=1600.0, holdings={"a": {1}})
    assert [s for s, _ in moved.copies] == [2, 3, 4, 5]
    assert moved.evictions == [1, 2, 3, 4, 5]
    assert plan_tiers(recs, MoveAfter("a", 0), now=1e9, holdings={"a": set()}).evictions == list(
        range(1, 10)
    )


# ------------------------------------------------------------------- manager + mover


def test_manager_moves_in_background_and_restores_from_any_tier(tmp_path):
    hot, cold = tmp_path / "hot", tmp_path / "cold"
    m = model(1)
    saved = {}
    policy = HotLast(2) | CopyEvery("archive", steps=5) | ArchiveProtected("archive")
    with CheckpointManager(
        hot,
        "r",
        tiers={"archive": cold},
        tier_policy=policy,
        options=ManagerOptions(gc=GCOptions(grace_seconds=0)),
    ) as mgr:
        for step in range(1, 13):
            with torch.no_grad():
                m[0].weight.add_(1.0)
            mgr.save(step, {"model": m})
            saved[step] = state_of(m)
            if step == 3:
                mgr.wait()
                mgr.pin(3)
    where = {(e.step): e.tiers for e in catalog(Tiers.of(Store.open(hot)), "r")}
    assert where == {
        3: ["hot", "archive"],
        5: ["archive"],
        10: ["archive"],
        11: ["hot"],
        12: ["hot"],
    }
    # Pins travel with the checkpoint: the archive's own retention keeps it.
    assert Store.open(cold).pinned_steps("r") == [3]
    # Restore from whichever tier holds it; the functional API and open() see every tier.
    for step in (5, 10, 11):
        m2 = model(2)
        info = stepvault.restore(hot, {"model": m2}, run="r", step=step)
        assert info.step == step and equal(state_of(m2), saved[step])
    assert stepvault.open(hot).steps("r") == [3, 5, 10, 11, 12]
    with pytest.raises(CheckpointNotFoundError):
        stepvault.restore(hot, {"model": model(3)}, run="r", step=4)
    # A new manager on the same store resumes from the newest; events tell the story.
    with CheckpointManager(hot, "r") as mgr:
        assert mgr.restore({"model": model(4)}).step == 12
        m3 = model(4)
        assert mgr.restore({"model": m3}, step=5).step == 5
        assert equal(state_of(m3), saved[5])
    events = [e["event"] for e in read_events(Store.open(hot), "r")]
    assert events.count("tier_copy") == 3 and "tier_evict" in events
    for store in (Store.open(hot), Store.open(cold)):
        assert ops.verify_store(store, deep=True).ok


def test_unknown_tier_in_a_policy_is_refused_up_front(tmp_path):
    with pytest.raises(TierError, match=r"no tier named 'archve'.*tiers: hot, archive"):
        CheckpointManager(
            tmp_path / "hot",
            "r",
            tiers={"archive": tmp_path / "cold"},
            tier_policy=CopyEvery("archve", steps=5),
        )
    with CheckpointManager(tmp_path / "hot", "r") as mgr:  # no lease was left behind
        mgr.save(1, {"model": model(0)})
    # Reading never creates a tier store: an archive that does not exist yet is skipped.
    assert not (tmp_path / "cold" / "stepvault.json").exists()
    assert stepvault.open(tmp_path / "hot").steps("r") == [1]


def test_keep_policy_waits_for_the_mover(tmp_path):
    """A keep policy deleting from hot must not lose a checkpoint still owed to a cold tier."""
    hot, cold = tmp_path / "hot", tmp_path / "cold"
    m = model(5)
    with CheckpointManager(
        hot,
        "r",
        keep=KeepLast(1),
        tiers={"archive": cold},
        tier_policy=CopyEvery("archive", steps=3),
    ) as mgr:
        for step in range(1, 11):
            with torch.no_grad():
                m[1].bias.add_(1.0)
            mgr.save(step, {"model": m})
    assert Store.open(cold).list_steps("r") == [3, 6, 9]
    assert Store.open(hot).list_steps("r") == [10]


def test_objects_are_deduplicated_within_each_tier(tmp_path):
    hot = Store.open(tmp_path / "hot", create=True)
    cold = Store.open(tmp_path / "cold", create=True)
    big = model(6, width=512)
    for step in (1, 2):
        with torch.no_grad():
            big[1].bias.add_(1.0)  # only the small layer changes
        stepvault.save(hot, {"model": big}, run="r", step=step)
    first = copy_checkpoint(hot, cold, "r", 1)
    second = copy_checkpoint(hot, cold, "r", 2)
    assert first.copied_objects >= 1 and second.reused_objects >= 1
    assert second.bytes_written < first.bytes_written / 10
    assert copy_checkpoint(hot, cold, "r", 2).already_there
    add_tier(hot, TierSpec("archive", str(tmp_path / "cold")))
    usage = usage_by_tier(hot)
    assert usage["archive"].checkpoints == 2
    assert usage["archive"].stored_bytes == usage["hot"].stored_bytes
    assert usage["archive"].logical_bytes > 1.9 * usage["archive"].stored_bytes


def test_damage_never_spreads_to_the_archive(tmp_path):
    hot = Store.open(tmp_path / "hot", create=True)
    stepvault.save(hot, {"model": model(7)}, run="r", step=1)
    stepvault.save(hot, {"model": model(8)}, run="r", step=2)
    digest = next(iter(stepvault.open(tmp_path / "hot").manifest("r", 1).objects))
    path = tmp_path / "hot" / Store.object_key(digest)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    tiers = Tiers(hot, [TierSpec("archive", str(tmp_path / "cold"))])
    report = apply_tier_policy(tiers, "r", MoveAfter("archive", 0), grace_seconds=0)
    assert len(report.failed) == 1 and "r@1" in report.failed[0]
    # Step 1 was not committed in the archive (step 2, intact, was copied; as the newest
    # it also stays hot), and the damaged hot copy of step 1 was not evicted.
    assert tiers["archive"].list_steps("r") == [2]
    assert hot.list_steps("r") == [1, 2]
    assert "tier_copy_failed" in [e["event"] for e in read_events(hot, "r")]


def test_restore_prefers_hot_and_reads_cold_only_when_needed(tmp_path):
    hot = Store.open(tmp_path / "hot", create=True)
    m = model(9)
    stepvault.save(hot, {"model": m}, run="r", step=1)
    tiers = Tiers(hot, [TierSpec("archive", str(tmp_path / "cold"))])
    add_tier(hot, tiers.spec("archive"))
    copy_checkpoint(hot, tiers["archive"], "r", 1)
    view = TieredView(tiers)
    assert view.where("r", 1) == ["hot", "archive"]
    # Empty the archive's objects: a restore that works now read only hot.
    for digest in list(tiers["archive"].iter_objects()):
        tiers["archive"].delete_object(digest)
    m2 = model(10)
    stepvault.restore(tmp_path / "hot", {"model": m2}, run="r", step=1)
    assert equal(state_of(m2), state_of(m))
    # Only in the archive: read from there (hashes verified on the way).
    copy_checkpoint(hot, tiers["archive"], "r", 1)  # already there: manifest kept
    for digest in stepvault.open(tmp_path / "hot").manifest("r", 1).objects:
        tiers["archive"].put_object(digest, [hot.read_object(digest)])
    hot.delete_manifest("r", 1)
    for digest in list(hot.iter_objects()):
        hot.delete_object(digest)
    m3 = model(11)
    assert stepvault.restore(tmp_path / "hot", {"model": m3}, run="r").step == 1
    assert equal(state_of(m3), state_of(m))


def test_a_damaged_hot_copy_is_restored_from_the_archive(tmp_path):
    hot_root = tmp_path / "hot"
    m = model(18)
    with CheckpointManager(
        hot_root,
        "r",
        tiers={"archive": tmp_path / "cold"},
        tier_policy=CopyEvery("archive", steps=1),
    ) as mgr:
        mgr.save(1, {"model": m})
        m2 = model(19)
        mgr.save(2, {"model": m2})

    def rot(step: int) -> Path:  # bit rot in the hot copy only
        digest = next(iter(stepvault.open(hot_root).manifest("r", step).objects))
        path = hot_root / Store.object_key(digest)
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
        return path

    bad = rot(1)
    target = model(20)
    info = stepvault.restore(hot_root, {"model": target}, run="r", step=1)
    assert info.step == 1 and equal(state_of(target), state_of(m))
    assert "quarantine" in info.skipped[0].reason  # the damage is reported, not hidden
    assert not bad.exists()  # the bad hot object is out of the way of future dedup
    # The manager takes the same way: newest step, damaged in hot, good in the archive.
    rot(2)
    with CheckpointManager(hot_root, "r") as mgr:
        target = model(21)
        info = mgr.restore({"model": target})
        assert info.step == 2 and equal(state_of(target), state_of(m2))
        assert len(info.skipped) == 1


def test_cold_tier_codec_reencodes_for_size(tmp_path):
    hot = Store.open(tmp_path / "hot", create=True)
    m = model(12, width=256)
    with torch.no_grad():
        m[0].weight.mul_(0).add_(0.25)  # very compressible
    stepvault.save(hot, {"model": m}, run="r", step=1)
    tiers = Tiers(hot, [TierSpec("archive", str(tmp_path / "cold"), codec="zstd")])
    stats = copy_checkpoint(hot, tiers["archive"], "r", 1, codec="zstd")
    cold_manifest = stepvault.open(tmp_path / "cold").manifest("r", 1)
    assert "zstd" in {o.codec for o in cold_manifest.objects.values()}
    hot_manifest = stepvault.open(tmp_path / "hot").manifest("r", 1)
    assert cold_manifest.stored_bytes < hot_manifest.stored_bytes / 2
    assert stats.bytes_written < stats.bytes_read
    assert ops.verify(tmp_path / "cold", deep=True).ok
    m2 = model(13, width=256)
    stepvault.restore(tmp_path / "cold", {"model": m2}, run="r")
    assert equal(state_of(m2), state_of(m))


def test_cli_tier_views_and_usage(tmp_path):
    hot = tmp_path / "hot"
    for step in (1, 2, 3):
        stepvault.save(hot, {"model": model(step)}, run="r", step=step)
    runner = CliRunner()
    res = runner.invoke(app, ["--root", str(hot), "tiers", "add", "archive", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["--root", str(hot), "tier", "r@2", "--to", "archive", "--evict"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["--root", str(hot), "tier", "r@latest", "--to", "archive"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["--root", str(hot), "tiers", "ls", "r", "--json"])
    assert res.exit_code == 0, res.output
    listing = json.loads(res.output)
    assert [t["name"] for t in listing["tiers"]] == ["hot", "archive"]
    assert {c["step"]: c["tiers"] for c in listing["checkpoints"]} == {
        1: ["hot"],
        2: ["archive"],
        3: ["hot", "archive"],
    }
    res = runner.invoke(app, ["--root", str(hot), "tiers", "du", "--json"])
    usage = json.loads(res.output)
    assert usage["hot"]["checkpoints"] == 2 and usage["archive"]["checkpoints"] == 2
    res = runner.invoke(app, ["--root", str(hot), "du", "--by-tier", "--json"])
    assert res.exit_code == 0 and json.loads(res.output) == usage
    res = runner.invoke(app, ["--root", str(hot), "du", "--by-tier"])
    assert res.exit_code == 0 and "archive" in res.output
    res = runner.invoke(app, ["--root", str(hot), "tier", "r@9", "--to", "archive"])
    assert res.exit_code == 2 and "no committed checkpoint" in res.output
    res = runner.invoke(app, ["--root", str(hot), "tier", "r@1", "--to", "nowhere"])
    assert res.exit_code == 2 and "no tier named 'nowhere'" in res.output
    res = runner.invoke(app, ["--root", str(hot), "tiers", "ls"])
    assert res.exit_code == 0 and "archive" in res.output


def test_cli_tier_older_than_moves_only_aged_checkpoints(tmp_path, monkeypatch):
    hot, cold = tmp_path / "hot", tmp_path / "c"
    for step in (1, 2):
        stepvault.save(hot, {"model": model(step)}, run="r", step=step)
    time.sleep(1.2)
    before_3 = time.time()
    stepvault.save(hot, {"model": model(3)}, run="r", step=3)
    # The CLI's clock reads 0.6 s after step 3 began, however long the commands below take
    # on a loaded machine: "older than 1s" then means saved before before_3 - 0.4.
    import stepvault.cli.tiers as cli_tiers

    monkeypatch.setattr(cli_tiers, "time", types.SimpleNamespace(time=lambda: before_3 + 0.6))
    runner = CliRunner()
    res = runner.invoke(app, ["--root", str(hot), "tiers", "add", "archive", str(cold)])
    assert res.exit_code == 0, res.output
    args = ["--root", str(hot), "tier", "r", "--to", "archive", "--evict", "--json"]
    res = runner.invoke(app, [*args, "--older-than", "1s"])
    assert res.exit_code == 0, res.output
    assert [r["step"] for r in json.loads(res.output)] == [1, 2]
    assert Store.open(hot).list_steps("r") == [3] and Store.open(cold).list_steps("r") == [1, 2]
    res = runner.invoke(app, [*args, "--older-than", "1d"])
    assert res.exit_code == 2 and "no checkpoint in the hot store older than 1d" in res.output
    res = runner.invoke(app, [*args, "--older-than", "soon"])
    assert res.exit_code == 2 and "bad duration" in res.output


def test_cli_evict_leaves_pinned_held_registered_and_newest_in_hot(tmp_path):
    """``tier RUN --to T --evict`` obeys the rules the mover's plan obeys: a pinned, a
    reader-held and a registry-held checkpoint, and the newest, are copied but stay in hot
    (each row says why); the rest leave hot. It used to evict all five."""
    from stepvault.registry import Registry
    from stepvault.store.reader_holds import live_holds

    hot, cold = tmp_path / "hot", tmp_path / "c"
    for step in (10, 20, 30, 40, 50):
        stepvault.save(hot, {"model": model(step)}, run="r", step=step)
    runner = CliRunner()
    base = ["--root", str(hot)]
    assert runner.invoke(app, [*base, "tiers", "add", "archive", str(cold)]).exit_code == 0
    assert runner.invoke(app, [*base, "pin", "r@10"]).exit_code == 0
    res = runner.invoke(app, [*base, "hold", "r@20", "--owner", "evaljob"])
    assert res.exit_code == 0, res.output
    Registry(Store.open(hot)).register("m", "r", 30)
    res = runner.invoke(app, [*base, "tier", "r", "--to", "archive", "--evict", "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["step"]: r for r in json.loads(res.output)}
    assert [s for s, r in rows.items() if r["evicted"]] == [40]
    assert "pinned" in rows[10]["kept"] and "evaljob" in rows[20]["kept"]
    assert "registry" in rows[30]["kept"] and "newest" in rows[50]["kept"]
    assert Store.open(hot).list_steps("r") == [10, 20, 30, 50]
    assert Store.open(cold).list_steps("r") == [10, 20, 30, 40, 50]
    assert 20 in live_holds(Store.open(hot), "r")
    res = runner.invoke(app, [*base, "tier", "r@50", "--to", "archive", "--evict"])
    assert res.exit_code == 0 and "kept: newest valid checkpoint" in res.output


def test_verify_and_repair_check_every_copy_against_its_own_tier(tmp_path):
    """Through the hot root, ``verify`` checks each tier's copy against that tier's own
    manifest: a re-encoding archive (other stored sizes) sharing an object with a hot
    checkpoint is not "truncated or replaced" (it was, for both checkpoints), and damage in
    the archive copy of a checkpoint hot also holds is found and named by tier (it was
    reported ok). ``repair`` then quarantines it in the archive (it checked hot only)."""
    hot, cold = tmp_path / "hot", tmp_path / "c"
    frozen = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))  # 1 MiB, shared
    m = model(1)
    for step in (1, 2, 3):
        with torch.no_grad():
            m[0].weight.add_(1.0)
        stepvault.save(hot, {"frozen": frozen, "model": m}, run="r", step=step)
    runner = CliRunner()
    base = ["--root", str(hot)]
    res = runner.invoke(app, [*base, "tiers", "add", "archive", str(cold), "--codec", "zstd"])
    assert res.exit_code == 0, res.output
    for ref, evict in (("r@1", ["--evict"]), ("r@3", [])):
        assert runner.invoke(app, [*base, "tier", ref, "--to", "archive", *evict]).exit_code == 0
    assert runner.invoke(app, [*base, "gc", "--grace", "0s"]).exit_code == 0
    sizes = {
        root: stepvault.open(root).manifest("r", 1 if root == cold else 2).stored_bytes
        for root in (hot, cold)
    }
    assert sizes[cold] < sizes[hot]  # the archive re-encoded the shared object
    report = ops.verify(hot, deep=True)
    assert report.ok, [c.problems for c in report.damaged]
    assert {c.step: c.tiers for c in report.checkpoints} == {
        1: ["archive"],
        2: ["hot"],
        3: ["hot", "archive"],
    }
    # Damage the archive's copy of r@3's own object (hot still has a good one).
    digest = next(
        d
        for d in stepvault.open(cold).manifest("r", 3).objects
        if d not in stepvault.open(cold).manifest("r", 1).objects
    )
    path = cold / "objects" / digest[:2] / digest
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    res = runner.invoke(app, [*base, "verify", "--deep"])
    assert res.exit_code == 1 and "DAMAGED  r@3  (in hot, archive)" in res.output, res.output
    assert "in archive: object" in res.output and res.output.count("DAMAGED") == 1
    assert "stepvault repair" in res.output
    res = runner.invoke(app, [*base, "repair"])
    assert res.exit_code == 0 and "quarantined r@3 in archive" in res.output, res.output
    assert Store.open(cold).list_steps("r") == [1] and Store.open(hot).list_steps("r") == [2, 3]
    assert ops.verify(hot, deep=True).ok
    # The hot copy was never touched: a new copy heals the archive.
    assert runner.invoke(app, [*base, "tier", "r@3", "--to", "archive"]).exit_code == 0
    assert ops.verify(cold, deep=True).ok and Store.open(cold).list_steps("r") == [1, 3]


def test_cli_pin_hold_annotate_attach_an_archived_checkpoint(tmp_path):
    """A checkpoint moved off hot (``tier --evict``) is listed, shown, verified and
    exported through the hot root; pin, hold, annotate and attach said "no committed
    checkpoint" for it. Pins and holds now go to the tier that holds it (where its copy
    lives), annotations and attachments to hot (where listings and exports read them)."""
    hot, cold = tmp_path / "hot", tmp_path / "c"
    for step in (1, 2, 3):
        stepvault.save(hot, {"model": model(step)}, run="r", step=step)
    runner = CliRunner()
    base = ["--root", str(hot)]
    assert runner.invoke(app, [*base, "tiers", "add", "archive", str(cold)]).exit_code == 0
    assert runner.invoke(app, [*base, "tier", "r@1", "--to", "archive", "--evict"]).exit_code == 0
    assert Store.open(hot).list_steps("r") == [2, 3]
    res = runner.invoke(app, [*base, "pin", "r@1", "--note", "paper"])
    assert res.exit_code == 0 and "pinned r@1 (in archive)" in res.output, res.output
    assert Store.open(cold).pinned_steps("r") == [1]
    res = runner.invoke(app, [*base, "hold", "r@1", "--owner", "evaljob", "--json"])
    assert res.exit_code == 0, res.output
    token = json.loads(res.output)["token"]
    res = runner.invoke(app, [*base, "annotate", "r@1", "acc=0.5"])
    assert res.exit_code == 0, res.output
    cfg = tmp_path / "config.json"
    cfg.write_text("{}")
    res = runner.invoke(app, [*base, "attach", "r@1", str(cfg)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, [*base, "ls", "r", "--json"])
    row = next(r for r in json.loads(res.output) if r["step"] == 1)
    assert row["metrics"].get("acc") == 0.5, row
    res = runner.invoke(app, [*base, "show", "r@1"])
    assert "config.json" in res.output, res.output
    res = runner.invoke(app, [*base, "release", "r@1", "--token", token])
    assert res.exit_code == 0, res.output
    assert runner.invoke(app, [*base, "unpin", "r@1"]).exit_code == 0
    assert Store.open(cold).pinned_steps("r") == []
    res = runner.invoke(app, [*base, "pin", "r@9"])
    assert res.exit_code == 2 and "(r has 1, 2, 3)" in res.output, res.output


def test_cli_tier_to_hot_brings_an_archived_checkpoint_back(tmp_path):
    """``tier RUN@STEP --to hot`` said "no tier named 'hot' (tiers: hot, archive)": it now
    copies the archived checkpoint back into hot (verified), and never deletes from cold."""
    hot, cold = tmp_path / "hot", tmp_path / "c"
    for step in (1, 2, 3):
        stepvault.save(hot, {"model": model(step)}, run="r", step=step)
    runner = CliRunner()
    base = ["--root", str(hot)]
    res = runner.invoke(app, [*base, "tiers", "add", "archive", str(cold), "--codec", "zstd"])
    assert res.exit_code == 0
    assert runner.invoke(app, [*base, "tier", "r", "--to", "archive", "--evict"]).exit_code == 0
    assert Store.open(hot).list_steps("r") == [3]
    assert runner.invoke(app, [*base, "gc", "--grace", "0s"]).exit_code == 0
    # stepvault.restore says where the bytes came from, as mgr.restore does (it said None).
    info = stepvault.restore(hot, {"model": model(0)}, run="r", step=1)
    assert info.tier == "archive" and info.tier_bytes.get("archive", 0) > 0, info
    res = runner.invoke(app, [*base, "tier", "r@1", "--to", "hot", "--evict"])
    assert res.exit_code == 2 and "nothing is deleted from a cold tier" in res.output
    res = runner.invoke(app, [*base, "tier", "r", "--to", "hot", "--json"])
    assert res.exit_code == 0, res.output
    assert [r["step"] for r in json.loads(res.output)] == [1, 2]
    assert Store.open(hot).list_steps("r") == [1, 2, 3]
    assert Store.open(cold).list_steps("r") == [1, 2, 3]
    assert ops.verify(hot, deep=True).ok
    m = model(0)
    assert stepvault.restore(Store.open(hot), {"model": m}, run="r", step=1).tier == "hot"
    assert equal(state_of(m), state_of(model(1)))
    res = runner.invoke(app, [*base, "tier", "r@3", "--to", "hot"])
    assert res.exit_code == 2 and "in hot already" in res.output


def test_usage_by_tier_shows_the_tiers_that_answer_and_names_the_one_that_does_not(tmp_path):
    """One unreachable tier made ``tiers du`` / ``du --by-tier`` fail outright, with a
    message that named no tier."""
    hot, cold = tmp_path / "hot", tmp_path / "c"
    stepvault.save(hot, {"model": model(1)}, run="r", step=1)
    runner = CliRunner()
    assert (
        runner.invoke(app, ["--root", str(hot), "tiers", "add", "archive", str(cold)]).exit_code
        == 0
    )
    assert runner.invoke(app, ["--root", str(hot), "tier", "r@1", "--to", "archive"]).exit_code == 0
    import shutil

    shutil.rmtree(cold)
    cold.write_text("not a store any more")
    for args in (["tiers", "du"], ["du", "--by-tier"]):
        res = runner.invoke(app, ["--root", str(hot), *args])
        assert res.exit_code == 1, res.output
        assert "hot" in res.output and "tier archive unreachable" in res.output
    res = runner.invoke(app, ["--root", str(hot), "tiers", "du", "--json"])
    doc = json.loads(res.output)
    assert doc["hot"]["checkpoints"] == 1 and "unreachable" in doc["archive"]


def test_verify_with_a_tier_nothing_was_copied_to_yet_is_ok_and_a_broken_one_is_not(tmp_path):
    """A tier added before any copy has no store yet: it holds nothing, it is not
    unreachable (verify exited 1 for it, CI's crash campaign caught it); a tier whose
    location is a file cannot be read: NOT CHECKED, exit 1."""
    hot = tmp_path / "hot"
    stepvault.save(hot, {"model": model(1)}, run="r", step=1)
    runner = CliRunner()
    base = ["--root", str(hot)]
    assert (
        runner.invoke(app, [*base, "tiers", "add", "archive", str(tmp_path / "c")]).exit_code == 0
    )
    assert ops.verify(hot).ok
    res = runner.invoke(app, [*base, "verify"])
    assert res.exit_code == 0 and "NOT CHECKED" not in res.output, res.output
    import shutil

    shutil.rmtree(tmp_path / "c", ignore_errors=True)
    (tmp_path / "c").write_text("not a store")
    report = ops.verify(hot)
    assert not report.ok and "archive" in report.unreachable
    res = runner.invoke(app, [*base, "verify"])
    assert res.exit_code == 1 and "NOT CHECKED  tier archive" in res.output, res.output


# ------------------------------------------------------------------------ S3 cold tier
@pytest.mark.slow  # ~10 s of botocore backoff; the fast suite covers faults in test_s3_backend
def test_s3_archive_behind_a_faulty_network(tmp_path, s3):
    """10% of requests to the archive fail (5xx, throttling, resets, lost responses):
    every copy still lands, and every checkpoint restores from the tier that holds it."""
    bucket = s3.new_bucket()
    proxy = FaultProxy(s3.endpoint, rate=0.10, seed=11).start()
    try:
        spec = TierSpec("archive", f"s3://{bucket}/cold", options={"endpoint_url": proxy.endpoint})
        hot = tmp_path / "hot"
        m = model(14)
        saved = {}
        with CheckpointManager(
            hot,
            "r",
            tiers={"archive": spec},
            tier_policy=HotLast(1) | CopyEvery("archive", steps=2),
        ) as mgr:
            for step in range(1, 7):
                with torch.no_grad():
                    m[0].weight.add_(1.0)
                mgr.save(step, {"model": m})
                saved[step] = state_of(m)
            assert mgr.tier_mover is not None
        assert mgr.tier_mover.last_error is None
        tiers = Tiers.of(Store.open(hot))
        assert tiers["archive"].list_steps("r") == [2, 4, 6]
        assert Store.open(hot).list_steps("r") == [6]
        for step in (2, 4, 6):
            m2 = model(15)
            stepvault.restore(hot, {"model": m2}, run="r", step=step)
            assert equal(state_of(m2), saved[step])
        assert ops.verify_store(tiers["archive"], deep=True).ok
        assert sum(proxy.counts.get(k, 0) for k in proxy.FAULTS) > 0
    finally:
        proxy.stop()


@pytest.mark.slow
@pytest.mark.parametrize(
    # The whole move takes ~1.6 s here: timed kills land while copying, committing,
    # evicting or sweeping.
    "kill_at",
    ["before-commit-2", "after-0.2s", "after-0.6s", "after-1.0s", "after-1.4s"],
)
def test_sigkill_in_the_middle_of_a_tier_move_leaves_both_tiers_consistent(tmp_path, s3, kill_at):
    bucket = s3.new_bucket()
    hot = tmp_path / "hot"
    m = model(16, width=384)
    saved = {}
    for step in range(1, 7):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)  # every object changes: each copy moves real bytes
        stepvault.save(hot, {"model": m}, run="r", step=step)
        saved[step] = state_of(m)
    env = {**os.environ, **ENV}
    cold_url = f"s3://{bucket}/cold"
    cmd = [sys.executable, str(SCRIPT), "--hot", str(hot), "--cold", cold_url]
    cmd += ["--endpoint", s3.endpoint]
    if kill_at.startswith("before-commit-"):
        cmd += ["--pause-at", kill_at.rsplit("-", 1)[1]]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        if kill_at.startswith("before-commit-"):
            target = f"COMMIT {kill_at.rsplit('-', 1)[1]}"
            for line in child.stdout:  # type: ignore[union-attr]
                if line.strip() == target:
                    break
        else:  # a moment into the move (measured from the child's START line)
            for line in child.stdout:  # type: ignore[union-attr]
                if line.strip() == "START":
                    break
            time.sleep(float(kill_at.split("-")[1].rstrip("s")))
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(30)
    tiers = Tiers(
        Store.open(hot), [TierSpec("archive", cold_url, options={"endpoint_url": s3.endpoint})]
    )
    hot_steps, cold_steps = tiers.hot.list_steps("r"), tiers["archive"].list_steps("r")
    if kill_at == "before-commit-2":  # killed mid-move: step 2's objects, no manifest
        assert cold_steps == [1] and hot_steps == [1, 2, 3, 4, 5, 6]
        referenced = set(stepvault.open(tiers["archive"]).manifest("r", 1).objects)
        assert set(tiers["archive"].iter_objects()) - referenced
    # Nothing lost, and each tier holds only complete checkpoints that deep-verify.
    assert set(hot_steps) | set(cold_steps) == set(saved)
    for name in ("hot", "archive"):
        assert ops.verify_store(tiers[name], deep=True).ok, name
        for step in tiers[name].list_steps("r"):
            m2 = model(17, width=384)
            stepvault.restore(tiers[name], {"model": m2}, run="r", step=step)
            assert equal(state_of(m2), saved[step])
    # Running the mover again finishes the job.
    report = apply_tier_policy(tiers, "r", HotLast(1) | CopyEvery("archive", steps=1))
    assert not report.failed
    assert tiers["archive"].list_steps("r") == [1, 2, 3, 4, 5, 6]
    assert tiers.hot.list_steps("r") == [6]
    assert ops.verify_store(tiers["archive"], deep=True).ok


def test_an_unreachable_archive_never_stops_training_or_restore(tmp_path, s3_env):
    dead = {"endpoint_url": "http://127.0.0.1:9", "config_kwargs": {"retries": {"max_attempts": 1}}}
    spec = TierSpec("archive", "s3://nowhere/cold", options=dead)
    hot = tmp_path / "hot"
    m = model(22)
    with CheckpointManager(
        hot, "r", tiers={"archive": spec}, tier_policy=HotLast(1) | CopyEvery("archive", steps=1)
    ) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"model": m})
    assert mgr.tier_mover is not None
    error = mgr.tier_mover.last_error  # a clear error, kept and logged
    assert isinstance(error, OSError) and "127.0.0.1:9" in str(error)
    assert Store.open(hot).list_steps("r") == [1, 2, 3]  # nothing left hot uncopied
    assert "tier_failed" in [e["event"] for e in read_events(Store.open(hot), "r")]
    m2 = model(23)
    assert stepvault.restore(hot, {"model": m2}, run="r").step == 3  # hot still serves
    assert equal(state_of(m2), state_of(m))


def test_a_session_without_saves_still_pays_what_a_crashed_one_owed(tmp_path):
    """A run killed after its last commit but before the mover copied it: the next session
    restores and closes without saving, and its close() makes the owed copy."""
    hot, cold = tmp_path / "hot", tmp_path / "cold"
    for step in (5, 10):  # committed by a process that died before its mover ran
        stepvault.save(hot, {"model": model(step)}, run="r", step=step)
    policy = CopyEvery("archive", steps=5)
    with CheckpointManager(hot, "r", tiers={"archive": str(cold)}, tier_policy=policy) as mgr:
        assert mgr.restore({"model": model(0)}).step == 10
    assert Store.open(cold).list_steps("r") == [5, 10]


def test_age_rules_move_checkpoints_on_a_timer_without_new_saves(tmp_path):
    """MoveAfter acts on age: once a checkpoint comes of age the mover moves it even though
    training saves nothing more (a finished or rarely saving run)."""
    from stepvault.tiers.mover import TierMover

    hot, cold = tmp_path / "hot", tmp_path / "cold"
    for step in (1, 2, 3):
        stepvault.save(hot, {"model": model(step)}, run="r", step=step)
    add_tier(Store.open(hot), TierSpec("archive", str(cold)))
    tiers = Tiers.of(Store.open(hot))
    policy = HotLast(10) | MoveAfter("archive", age=2.0)
    assert policy.ages() == [2.0] and HotLast(3).ages() == []
    assert TierMover(tiers, "r", HotLast(3)).recheck_seconds is None
    assert TierMover(tiers, "r", MoveAfter("archive", days=1)).recheck_seconds == 600.0
    mover = TierMover(tiers, "r", policy, recheck_seconds=0.2)
    assert mover.drain(30)  # one pass now: nothing is 2 s old yet, nothing moves
    assert Store.open(hot).list_steps("r") == [1, 2, 3]
    deadline = time.time() + 20
    while time.time() < deadline and Store.open(hot).list_steps("r") != [3]:
        time.sleep(0.1)
    mover.close(wait=False)
    # 1 and 2 moved by timer passes alone; 3, the newest, stays hot for a fast restart
    assert Store.open(hot).list_steps("r") == [3]
    assert Store.open(cold).list_steps("r") == [1, 2, 3]
    assert len(mover.reports) >= 2 and mover.last_error is None
