"""Store layer: layout, format version, names, atomic commit, out-of-space."""

from __future__ import annotations

import json
import os

import pytest
import torch
from typer.testing import CliRunner

import stepvault
from stepvault.cli.main import app
from stepvault.store import Store


def test_layout_and_settings(tmp_path):
    stepvault.save(tmp_path, {"t": torch.ones(3)}, run="exp1", step=7)
    settings = json.loads((tmp_path / "stepvault.json").read_text())
    assert settings["format"] == "stepvault-store" and settings["version"] == 1
    assert (tmp_path / "runs" / "exp1" / "checkpoints" / "7.json").is_file()
    assert (tmp_path / "runs" / "exp1" / "run.json").is_file()
    objects = list((tmp_path / "objects").glob("*/*"))
    assert objects and all(p.parent.name == p.name[:2] for p in objects)
    assert os.listdir(tmp_path / "tmp") == []


def test_newer_store_version_is_refused(tmp_path):
    stepvault.save(tmp_path, {"t": torch.ones(3)}, run="r", step=1)
    path = tmp_path / "stepvault.json"
    settings = json.loads(path.read_text())
    settings["version"] = 2
    path.write_text(json.dumps(settings))
    for call in (
        lambda: stepvault.open(tmp_path),
        lambda: stepvault.restore(tmp_path, {"t": torch.zeros(3)}, run="r"),
        lambda: stepvault.save(tmp_path, {"t": torch.ones(3)}, run="r", step=2),
    ):
        with pytest.raises(stepvault.errors.StoreVersionError, match="upgrade stepvault"):
            call()


def test_not_a_store(tmp_path):
    with pytest.raises(stepvault.errors.StoreNotFoundError, match="no stepvault store"):
        stepvault.open(tmp_path)


@pytest.mark.parametrize("run", ["../escape", "a/b", "..", "", "a\\b", "x" * 200, ".hidden"])
def test_unsafe_run_names_are_refused(tmp_path, run):
    with pytest.raises(stepvault.errors.InvalidNameError, match="run name"):
        stepvault.save(tmp_path / "s", {"t": torch.ones(1)}, run=run, step=1)
    assert not (tmp_path / "s").exists()
    assert not (tmp_path / "escape").exists()


def test_bad_steps_are_refused(tmp_path):
    for step in (-1, 1.5, "3", True):
        with pytest.raises(stepvault.errors.InvalidNameError, match="step"):
            stepvault.save(tmp_path, {"t": torch.ones(1)}, run="r", step=step)


def test_tensor_names_with_separators_are_escaped_not_paths(tmp_path):
    state = {
        "x": {"../../etc/passwd": torch.ones(2), "a/b": torch.zeros(2), "a%2Fb": torch.ones(1)}
    }
    stepvault.save(tmp_path, state, run="r", step=1)
    names = stepvault.open(tmp_path).checkpoint("r").tensor_names()
    assert names == ["x/..%2F..%2Fetc%2Fpasswd", "x/a%2Fb", "x/a%252Fb"]
    live = {"x": None}
    stepvault.restore(tmp_path, live, run="r")
    assert set(live["x"]) == set(state["x"])
    assert not (tmp_path.parent / "etc").exists()


def test_failure_before_commit_leaves_no_checkpoint(tmp_path, monkeypatch):
    stepvault.save(tmp_path, {"t": torch.ones(100)}, run="r", step=1)

    def crash(self, *a, **k):
        raise OSError("simulated crash between objects and manifest")

    monkeypatch.setattr(Store, "commit_manifest", crash)
    with pytest.raises(OSError, match="simulated"):
        stepvault.save(tmp_path, {"t": torch.full((100,), 2.0)}, run="r", step=2)
    monkeypatch.undo()
    assert stepvault.open(tmp_path).steps("r") == [1]
    live = {"t": torch.zeros(100)}
    assert stepvault.restore(tmp_path, live, run="r").step == 1
    assert float(live["t"].sum()) == 100.0
    # the orphaned object is visible to du, and never to restore
    assert stepvault.ops.usage(tmp_path).unreferenced_objects == 1


def test_failure_while_writing_objects_leaves_nothing_staged_or_visible(tmp_path, monkeypatch):
    """Objects are staged and published together: a save failing midway publishes none."""
    from stepvault.engine import writer

    stepvault.save(tmp_path, {"t": torch.ones(100)}, run="r", step=1)
    before = sorted(p.name for p in (tmp_path / "objects").glob("*/*"))
    real_encode, calls = writer.encode_object, []

    def encode_then_fail(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("simulated device error on the third object")
        return real_encode(*a, **k)

    monkeypatch.setattr(writer, "encode_object", encode_then_fail)
    state = {f"t{i}": torch.randn(300_000) for i in range(6)}  # six 1.2 MB objects
    with pytest.raises(OSError, match="third object"):
        stepvault.save(tmp_path, state, run="r", step=2, workers=1)
    assert len(calls) >= 3
    assert os.listdir(tmp_path / "tmp") == []  # the staged objects were removed
    assert sorted(p.name for p in (tmp_path / "objects").glob("*/*")) == before
    assert stepvault.open(tmp_path).steps("r") == [1]
    monkeypatch.undo()
    info = stepvault.save(tmp_path, state, run="r", step=2)  # and a retry just works
    assert info.new_bytes > 0 and stepvault.ops.verify(tmp_path, deep=True).ok


@pytest.fixture
def tiny_fs(make_tmpfs):
    """A 2 MiB tmpfs (needs root); skipped cleanly where it cannot be mounted."""
    return make_tmpfs("2m")


def test_out_of_space_keeps_earlier_checkpoints(tiny_fs):
    small = {"t": torch.arange(1000, dtype=torch.float32)}
    stepvault.save(tiny_fs, small, run="r", step=1)
    big = {"t": torch.randn(1_000_000)}  # 4 MB: cannot fit
    with pytest.raises(stepvault.errors.OutOfSpaceError, match="earlier checkpoints are intact"):
        stepvault.save(tiny_fs, big, run="r", step=2)
    assert os.listdir(tiny_fs / "tmp") == []
    assert stepvault.open(tiny_fs).steps("r") == [1]
    live = {"t": torch.zeros(1000)}
    assert stepvault.restore(tiny_fs, live, run="r").step == 1
    assert torch.equal(live["t"], small["t"])
    assert stepvault.ops.verify(tiny_fs, deep=True).ok


def test_cli_ls_show_du(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    for step in (10, 20):
        stepvault.save(
            tmp_path,
            {"model": model},
            run="exp1",
            step=step,
            metrics={"loss": 1.0 / step},
            codec="auto",
        )
    runner = CliRunner()
    out = runner.invoke(app, ["-r", str(tmp_path), "ls"])
    assert out.exit_code == 0 and "exp1" in out.output
    out = runner.invoke(app, ["-r", str(tmp_path), "ls", "exp1", "--json"])
    rows = json.loads(out.output)
    assert [r["step"] for r in rows] == [10, 20]
    assert rows[0]["metrics"] == {"loss": 0.1} and rows[1]["new_bytes"] == 0
    assert rows[0]["stored_bytes"] < rows[0]["logical_bytes"]  # float codec
    out = runner.invoke(app, ["-r", str(tmp_path), "show", "exp1@20", "--tensors"])
    assert out.exit_code == 0 and "model/weight" in out.output and "loss=0.05" in out.output
    out = runner.invoke(app, ["-r", str(tmp_path), "du", "--json"])
    du = json.loads(out.output)
    assert du["checkpoints"] == 2 and du["dedup_savings_bytes"] >= rows[0]["logical_bytes"] - 64
    assert du["compression_savings_bytes"] > 0
    out = runner.invoke(app, ["-r", str(tmp_path), "show", "exp1@99"])
    assert out.exit_code == 2 and "no committed checkpoint exp1@99" in out.output
    out = runner.invoke(app, ["-r", str(tmp_path / "nope"), "ls"])
    assert out.exit_code == 2 and "no stepvault store" in out.output


def test_commit_protocol_order(tmp_path, monkeypatch):
    """Each object is fsynced before its name appears; names are durable before the manifest."""
    from stepvault.store import local

    log = []
    real_fsync_dir, real_fsync_path = local._fsync_dir, local._fsync_path
    real_put, real_replace = local.LocalBackend.put_atomic, os.replace

    def fsync_dir(path):
        log.append(("fsync_dir", os.path.relpath(path, tmp_path)))
        real_fsync_dir(path)

    def fsync_path(path):
        log.append(("fsync_file", os.path.relpath(path, tmp_path)))
        real_fsync_path(path)

    def replace(src, dst):
        log.append(("replace", os.path.relpath(src, tmp_path), os.path.relpath(dst, tmp_path)))
        real_replace(src, dst)

    def put(self, key, parts, **kw):
        log.append(("put", key))
        return real_put(self, key, parts, **kw)

    monkeypatch.setattr(local, "_fsync_dir", fsync_dir)
    monkeypatch.setattr(local, "_fsync_path", fsync_path)
    monkeypatch.setattr(local.os, "replace", replace)
    monkeypatch.setattr(local.LocalBackend, "put_atomic", put)
    stepvault.save(tmp_path, {"a": torch.randn(300_000), "b": torch.ones(3)}, run="r", step=1)
    manifest_at = log.index(("put", "runs/r/checkpoints/1.json"))
    visible = [
        (i, e[1]) for i, e in enumerate(log) if e[0] == "replace" and e[2].startswith("objects/")
    ]
    assert len(visible) == 2  # two new objects (a; the bundle holding b)
    for i, tmp in visible:
        assert tmp.startswith("tmp/") and ("fsync_file", tmp) in log[:i]  # durable, then named
        assert i < manifest_at
    synced_before = {p for kind, p, *_ in log[:manifest_at] if kind == "fsync_dir"}
    for i, _ in visible:
        assert os.path.dirname(log[i][2]) in synced_before  # objects/xx
    assert "objects" in synced_before  # the new objects/xx directories themselves
    assert ("fsync_dir", "runs/r/checkpoints") in log[manifest_at:]


def test_read_many_reads_in_order_and_refuses_symlinks(tmp_path):
    """The listing's batch read: one result per name, in order; symlinks never followed."""
    import errno

    from stepvault.store.local import LocalBackend

    root = tmp_path / "store"
    backend = LocalBackend(root)
    backend.put_atomic("a/1", [b"one"])
    backend.put_atomic("a/2", [b"two"])
    (tmp_path / "secret").write_bytes(b"outside the store")
    os.symlink(tmp_path / "secret", root / "a" / "3")
    os.symlink(root / "a", root / "b")  # a symlinked directory
    got = list(backend.read_many("a", ["1", "missing", "3", "2"]))
    assert got[0] == b"one" and got[3] == b"two"
    assert isinstance(got[1], FileNotFoundError)
    assert isinstance(got[2], OSError) and got[2].errno == errno.ELOOP
    assert all(isinstance(r, OSError) for r in backend.read_many("b", ["1", "2"]))
    with pytest.raises(ValueError):
        list(backend.read_many("a", ["../escape"]))


def test_a_symlinked_manifest_is_listed_as_damaged_not_followed(tmp_path):
    stepvault.save(tmp_path, {"t": torch.ones(3)}, run="r", step=1)
    outside = tmp_path.parent / f"{tmp_path.name}-outside.json"
    outside.write_bytes((tmp_path / "runs/r/checkpoints/1.json").read_bytes())
    os.symlink(outside, tmp_path / "runs/r/checkpoints/2.json")
    listed = stepvault.open(tmp_path).checkpoints("r")
    assert [s.step for s in listed] == [1, 2]
    assert listed[0].error is None and "cannot be read safely" in listed[1].error
