"""Reliability and security: no pickle, hostile stores, corruption campaigns, disk full."""

from __future__ import annotations

import json
import os
import pickle
import random
import sys
import tracemalloc
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from typer.testing import CliRunner

import stepvault
from stepvault.catalog.events import read_events
from stepvault.cli.main import app
from stepvault.format.objects import encode_object
from stepvault.manager.options import ManagerOptions

# -- no pickle, proven -----------------------------------------------------------------

_AUDIT: list[str] = []
_AUDIT_ON = [False]


def _audit(event: str, args) -> None:
    if _AUDIT_ON[0] and event in ("pickle.find_class", "marshal.loads", "marshal.load"):
        _AUDIT.append(event)


sys.addaudithook(_audit)  # cannot be removed; records only while _AUDIT_ON is set


def _rich_state():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10),
        "scaler": torch.amp.GradScaler("cpu"),
        "rng": stepvault.RNGState(generators=[np.random.default_rng(1)]),
        "values": {"a": (1, 2.0, b"x", float("nan")), 7: [None, True], "np": np.float32(3)},
        "arr": np.arange(10),
        "dtype": torch.bfloat16,
    }


def test_restore_never_unpickles(tmp_path, monkeypatch):
    stepvault.save(tmp_path, _rich_state(), run="r", step=1, codec="auto")

    def forbidden(*a, **k):
        raise AssertionError("pickle used on the load path")

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    _AUDIT.clear()
    _AUDIT_ON[0] = True
    try:
        live = _rich_state()
        stepvault.restore(tmp_path, live, run="r")
        stepvault.open(tmp_path).checkpoint("r").load()
        stepvault.ops.verify(tmp_path, deep=True)
        with stepvault.CheckpointManager(tmp_path, "r") as mgr:
            mgr.restore(_rich_state())
    finally:
        _AUDIT_ON[0] = False
    assert _AUDIT == []


def test_store_files_contain_no_pickle(tmp_path):
    stepvault.save(tmp_path, _rich_state(), run="r", step=1)
    for path in tmp_path.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            # pickle streams start with PROTO (0x80) + version; none of our files do
            assert not (data[:1] == b"\x80" and data[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"))
            assert b"torch._utils" not in data and b"collections\nOrderedDict" not in data


# -- hostile stores ----------------------------------------------------------------------


def _two(tmp_path):
    torch.manual_seed(0)
    stepvault.save(tmp_path, {"w": torch.randn(300_000)}, run="r", step=1)
    stepvault.save(tmp_path, {"w": torch.randn(300_000)}, run="r", step=2)
    m1 = set(stepvault.open(tmp_path).manifest("r", 1).objects)
    only2 = set(stepvault.open(tmp_path).manifest("r", 2).objects) - m1
    return next(iter(only2))


def test_symlinked_object_is_never_followed(tmp_path):
    store = tmp_path / "store"
    victim = _two(store)
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read me")
    obj = store / "objects" / victim[:2] / victim
    obj.unlink()
    obj.symlink_to(secret)
    report = stepvault.ops.verify(store, deep=True)
    assert [c.step for c in report.damaged] == [2]
    info = stepvault.restore(store, {"w": torch.zeros(300_000)}, run="r")
    assert info.step == 1 and "cannot be read safely" in info.skipped[0].reason
    assert secret.read_text() == "do not read me" and not obj.is_symlink()


def test_symlinked_manifest_is_skipped(tmp_path):
    store = tmp_path / "store"
    _two(store)
    manifest = store / "runs" / "r" / "checkpoints" / "2.json"
    outside = tmp_path / "outside.json"
    outside.write_bytes(manifest.read_bytes())
    manifest.unlink()
    manifest.symlink_to(outside)
    info = stepvault.restore(store, {"w": torch.zeros(300_000)}, run="r")
    assert info.step == 1 and "cannot be read safely" in info.skipped[0].reason


def test_decompression_bomb_is_refused_with_bounded_memory(tmp_path):
    _two(tmp_path)
    m = stepvault.open(tmp_path).manifest("r", 2)
    digest, entry = next(iter(m.objects.items()))
    # A zstd frame that inflates to 1 GiB of zeros, planted where a 1.2 MB object belongs.
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(1 << 30))
    assert len(bomb) < 100_000
    header = encode_object(memoryview(bytes(entry.raw_size)), "raw", None, digest).parts[0]
    hdr = json.loads(header[12:].decode().strip())
    hdr["codec"] = "zstd"
    text = json.dumps(hdr).encode()
    text += b" " * ((-(12 + len(text))) % 64)
    prefix = header[:8] + len(text).to_bytes(4, "little")
    (tmp_path / "objects" / digest[:2] / digest).write_bytes(prefix + text + bomb)
    tracemalloc.start()
    try:
        info = stepvault.restore(tmp_path, {"w": torch.zeros(300_000)}, run="r")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.step == 1 and "declares" in info.skipped[0].reason
    assert peak < 64 << 20  # never inflated


def test_absurd_shape_is_refused_before_allocation(tmp_path):
    stepvault.save(tmp_path, {"w": torch.zeros(10)}, run="r", step=1)
    path = tmp_path / "runs" / "r" / "checkpoints" / "1.json"
    head, body = path.read_bytes().split(b"\n", 1)
    doc = json.loads(body)
    doc["tensors"]["w"]["shape"] = [10**12, 10**12]
    from stepvault.format.hashing import content_hash

    new_body = json.dumps(doc).encode()
    env = json.loads(head)
    env.update(body_blake3=content_hash(new_body), body_size=len(new_body))
    path.write_bytes(json.dumps(env).encode() + b"\n" + new_body)
    with pytest.raises(stepvault.errors.ManifestError, match="needs"):
        stepvault.restore(tmp_path, {"w": torch.zeros(10)}, run="r", step=1)


# -- corruption campaigns ----------------------------------------------------------------


def _campaign(root: Path, seed: int, checkpoints: int = 6, faults: int = 3):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    shared = torch.randn(200_000)
    for step in range(1, checkpoints + 1):
        state = {"shared": shared, "own": torch.randn(100_000), "small": torch.randn(10)}
        stepvault.save(root, state, run="r", step=step)
    vault = stepvault.open(root)
    manifests = {s: set(vault.manifest("r", s).objects) for s in vault.steps("r")}
    objects = sorted(set().union(*manifests.values()))
    expected_damaged: set[int] = set()
    for _ in range(faults):
        kind = rng.choice(["flip", "truncate", "delete", "manifest"])
        if kind == "manifest":
            step = rng.choice(sorted(manifests))
            path = root / "runs" / "r" / "checkpoints" / f"{step}.json"
            data = bytearray(path.read_bytes())
            if not data:
                continue
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            path.write_bytes(bytes(data))
            expected_damaged.add(step)
            continue
        digest = rng.choice(objects)
        path = root / "objects" / digest[:2] / digest
        if not path.exists():
            continue
        if kind == "flip":
            data = bytearray(path.read_bytes())
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            path.write_bytes(bytes(data))
        elif kind == "truncate":
            with open(path, "r+b") as f:
                f.truncate(rng.randrange(path.stat().st_size))
        else:
            path.unlink()
        expected_damaged |= {s for s, objs in manifests.items() if digest in objs}
    return sorted(manifests), expected_damaged


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_corruption_campaign(tmp_path, seed):
    steps, damaged = _campaign(tmp_path, seed)
    report = stepvault.ops.verify(tmp_path, deep=True)
    assert {c.step for c in report.damaged} == damaged  # every fault found, nothing else
    good = [s for s in steps if s not in damaged]
    live = {"shared": torch.zeros(200_000), "own": torch.zeros(100_000), "small": torch.zeros(10)}
    if good:
        info = stepvault.restore(tmp_path, live, run="r")
        assert info.step == good[-1]
        assert {s.step for s in info.skipped} == {s for s in damaged if s > good[-1]}
    else:
        with pytest.raises(stepvault.errors.NoValidCheckpointError):
            stepvault.restore(tmp_path, live, run="r")


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 150))
def test_corruption_campaign_many(tmp_path, seed):
    test_corruption_campaign(tmp_path, seed)


def test_repair_quarantines_damaged_checkpoints(tmp_path):
    steps, damaged = _campaign(tmp_path, seed=7, faults=2)
    assert damaged
    runner = CliRunner()
    dry = runner.invoke(app, ["--root", str(tmp_path), "repair", "--dry-run", "--json"])
    assert sorted(json.loads(dry.output)["removed"]) == sorted(f"r@{s}" for s in damaged)
    assert stepvault.open(tmp_path).steps("r") == steps
    out = runner.invoke(app, ["--root", str(tmp_path), "repair"])
    assert out.exit_code == 0, out.output
    assert stepvault.open(tmp_path).steps("r") == [s for s in steps if s not in damaged]
    assert stepvault.ops.verify(tmp_path, deep=True).ok
    for s in damaged:
        assert (tmp_path / "quarantine" / "manifests" / "r" / f"{s}.json").exists()


# -- disk full -----------------------------------------------------------------------------


@pytest.fixture
def small_fs(make_tmpfs):
    """A 3 MiB tmpfs (needs root); skipped cleanly where it cannot be mounted."""
    return make_tmpfs("3m")


@pytest.mark.parametrize("async_save", [False, True])
def test_disk_full_training_continues(small_fs, async_save):
    filler = small_fs / "filler"
    state = {"w": torch.zeros(100_000)}  # 400 KB per checkpoint
    with stepvault.CheckpointManager(
        small_fs, "r", options=ManagerOptions(on_save_error="warn"), async_save=async_save
    ) as mgr:
        mgr.save(1, state)
        mgr.wait()
        filler.write_bytes(bytes(2_500_000))  # leaves less than one checkpoint of space
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in (2, 3):
                state["w"] += 1
                mgr.save(step, state)  # fails for lack of space: a warning, not a crash
                mgr.wait()
        assert any("no space left" in str(w.message) for w in caught)
        assert stepvault.open(small_fs).steps("r") == [1]
        assert os.listdir(small_fs / "tmp") == []
        filler.unlink()  # space is back: the next save works
        state["w"] += 1
        mgr.save(4, state)
        mgr.wait()
        stats = mgr.stats()
    assert stats["failures"] == 2 and stats["saves"] == 2
    assert stepvault.open(small_fs).steps("r") == [1, 4]
    assert stepvault.ops.verify(small_fs, deep=True).ok
    events = [e["event"] for e in read_events(stepvault.open(small_fs).store, "r")]
    assert events.count("save_failed") == 2


def test_symlinked_directories_inside_the_store_are_never_followed(tmp_path):
    store = tmp_path / "store"
    _two(store)
    outside = tmp_path / "outside"
    stepvault.save(outside, {"w": torch.randn(10)}, run="evil", step=1)
    before = sorted(p.relative_to(outside) for p in outside.rglob("*"))
    # A run directory and an object fan-out directory that point outside the store.
    (store / "runs" / "evil").symlink_to(outside / "runs" / "evil", target_is_directory=True)
    fan = next((store / "objects").iterdir())
    hidden = tmp_path / "fan"
    fan.rename(hidden)
    fan.symlink_to(hidden, target_is_directory=True)
    vault = stepvault.open(store)
    assert vault.steps("evil") == []  # nothing under the symlink is listed or read
    with pytest.raises(stepvault.errors.StepvaultError):
        stepvault.restore(store, {"w": torch.zeros(10)}, run="evil", step=1)
    report = stepvault.ops.verify(store, deep=True)
    assert not report.ok  # the objects behind the symlinked fan-out dir count as missing
    with pytest.raises(OSError, match="symlink inside the store"):
        stepvault.save(store, {"w": torch.randn(10)}, run="evil", step=2)
    assert sorted(p.relative_to(outside) for p in outside.rglob("*")) == before
