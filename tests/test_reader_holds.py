"""Reader holds: a checkpoint an evaluator reads survives the trainer's keep policy, GC and
the tier mover's eviction until it is released or expires; across processes, by the CLI."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from helpers import linear
from typer.testing import CliRunner

import stepvault
from stepvault import CheckpointManager, KeepLast
from stepvault.catalog import apply_retention, checkpoint_records
from stepvault.cli.main import app
from stepvault.errors import CheckpointNotFoundError
from stepvault.manager.options import GCOptions, ManagerOptions
from stepvault.store import Store
from stepvault.store.reader_holds import PREFIX, acquire_hold, live_holds
from stepvault.tiers import MoveAfter, Tiers, TierSpec, apply_tier_policy


def save(root, step: int, seed: int = 0) -> None:
    stepvault.save(root, {"model": linear(seed + step)}, run="r", step=step)


def hold_files(root) -> list[str]:
    folder = os.path.join(root, PREFIX, "r")
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


READER = """
import sys, stepvault
with stepvault.ops.hold(sys.argv[1], "r@1", ttl=600, owner="eval"):
    print("held", flush=True)
    sys.stdin.readline()  # the test says when the evaluation is over
print("released", flush=True)
"""


def test_a_reader_process_holds_a_checkpoint_against_the_trainers_keep_policy(tmp_path):
    m = linear()
    with CheckpointManager(
        tmp_path, "r", keep=KeepLast(1), options=ManagerOptions(gc=GCOptions(grace_seconds=0))
    ) as mgr:
        mgr.save(1, {"model": m}, force=True)
        mgr.wait()
        reader = subprocess.Popen(
            [sys.executable, "-c", READER, str(tmp_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline().strip() == "held"
        with torch.no_grad():
            m.weight.add_(1.0)
        mgr.save(2, {"model": m}, force=True)
        mgr.wait()
        assert [c.step for c in mgr.checkpoints()] == [1, 2]  # 1 survives: held
        plan = mgr.retention_plan()
        (entry,) = [e for e in plan.entries if e.step == 1]
        assert entry.keep and entry.reasons[0].startswith("held by reader eval (pid ")
        reader.stdin.write("done\n")
        reader.stdin.flush()
        assert reader.stdout.readline().strip() == "released"
        assert reader.wait(timeout=30) == 0
        with torch.no_grad():
            m.weight.add_(1.0)
        mgr.save(3, {"model": m}, force=True)
        mgr.wait()
        assert [c.step for c in mgr.checkpoints()] == [3]  # released: gone at the next save
    assert hold_files(tmp_path) == []


def test_expired_and_orphaned_holds_are_ignored_and_cleaned(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step)
    store = Store.open(tmp_path)
    short = acquire_hold(store, "r", 1, ttl=30, owner="short")
    # A hold of a process that is gone (this host): it counts as expired at once.
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = {
        "run": "r",
        "step": 2,
        "token": "ab" * 16,
        "owner": "crashed",
        "host": socket.gethostname(),
        "pid": int(gone.stdout),
        "created": time.time(),
        "expires": time.time() + 3600,
    }
    store.backend.put_atomic(f"{PREFIX}/r/2@{'ab' * 16}.json", [json.dumps(dead).encode()])
    assert sorted(live_holds(store, "r", clean=False)) == [1]
    assert sorted(live_holds(store, "r", now=time.time() + 31, clean=False)) == []
    assert len(hold_files(tmp_path)) == 2  # clean=False: nothing deleted
    result = apply_retention(store, "r", KeepLast(1), checkpoint_records(store, "r"))
    assert result.reader_held == [1] and result.deleted == [2]
    assert hold_files(tmp_path) == [f"1@{short.record.token}.json"]  # the orphan is cleaned
    assert sorted(live_holds(store, "r", now=time.time() + 31)) == []
    assert hold_files(tmp_path) == []  # expired: cleaned by the next listing
    with pytest.raises(ValueError, match="positive number of seconds"):
        acquire_hold(store, "r", 1, ttl=0)


def test_a_hold_on_a_deleted_checkpoint_fails_and_leaves_nothing(tmp_path):
    save(tmp_path, 1)
    with pytest.raises(CheckpointNotFoundError):
        stepvault.ops.hold(tmp_path, "r@7", ttl=60)
    assert hold_files(tmp_path) == []
    with stepvault.ops.hold(tmp_path, "r@latest", ttl=60, owner="x") as held:
        assert held.record.step == 1 and len(hold_files(tmp_path)) == 1
    assert hold_files(tmp_path) == []


def test_cli_hold_holds_release_with_gc(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step)
    root = ["--root", str(tmp_path)]
    cli = CliRunner()
    held = cli.invoke(app, ["hold", "r@1", "--ttl", "2h", "--owner", "nightly-eval", *root])
    assert held.exit_code == 0, held.output
    listed = cli.invoke(app, ["holds", "--json", *root])
    (record,) = json.loads(listed.output)
    assert record["step"] == 1 and record["owner"] == "nightly-eval" and record["pid"] is None
    assert 7100 < record["expires"] - record["created"] <= 7200
    gc = cli.invoke(app, ["gc", "r", "--keep-last", "1", "--grace", "0s", *root])
    assert gc.exit_code == 0, gc.output
    assert "held by reader nightly-eval" in gc.output
    assert Store.open(tmp_path).list_steps("r") == [1, 3]
    missing = cli.invoke(app, ["release", "r@1", "--owner", "someone-else", *root])
    assert missing.exit_code != 0 and "no reader hold on r@1 matches" in missing.output
    released = cli.invoke(app, ["release", "r@1", "--token", record["token"][:12], *root])
    assert released.exit_code == 0 and "released 1 hold" in released.output
    gc = cli.invoke(app, ["gc", "r", "--keep-last", "1", "--grace", "0s", *root])
    assert gc.exit_code == 0 and Store.open(tmp_path).list_steps("r") == [3]
    assert cli.invoke(app, ["holds", *root]).output.strip() == "no live reader holds"


def test_a_held_checkpoint_is_not_evicted_from_hot(tmp_path):
    hot = Store.open(tmp_path / "hot", create=True)
    for step in (1, 2):
        save(hot, step)
    tiers = Tiers(hot, [TierSpec("archive", str(tmp_path / "cold"))])
    with stepvault.ops.hold(hot, "r@1", ttl=60, owner="export"):
        report = apply_tier_policy(tiers, "r", MoveAfter("archive", 0), grace_seconds=0)
        assert 1 not in report.evicted and 1 in hot.list_steps("r")
        assert 1 in tiers["archive"].list_steps("r")  # copied all the same
    report = apply_tier_policy(tiers, "r", MoveAfter("archive", 0), grace_seconds=0)
    assert 1 in report.evicted and 1 not in hot.list_steps("r")


def test_load_and_export_hold_what_they_read(tmp_path, monkeypatch):
    save(tmp_path, 1)
    store = Store.open(tmp_path)
    seen: list[list[int]] = []
    from stepvault.engine import CheckpointReader

    real = CheckpointReader.read_all

    def spy(self, *args, **kwargs):
        seen.append(sorted(live_holds(store, "r", clean=False)))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointReader, "read_all", spy)
    loaded = stepvault.Vault(store).checkpoint("r", 1).load()
    assert seen == [[1]] and torch.equal(loaded["model"]["weight"], linear(1).weight)
    assert hold_files(tmp_path) == []  # released after the read

    pytest.importorskip("safetensors")
    from stepvault.ops import export as export_mod

    real_export = export_mod._export
    during: list[list[int]] = []

    def spy_export(*args, **kwargs):
        during.append(sorted(live_holds(store, "r", clean=False)))
        return real_export(*args, **kwargs)

    monkeypatch.setattr(export_mod, "_export", spy_export)
    stepvault.ops.export_weights(store, "r", 1, tmp_path / "w.safetensors")
    assert during == [[1]] and hold_files(tmp_path) == []
