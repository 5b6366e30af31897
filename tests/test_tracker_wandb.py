"""Weights & Biases points at stepvault checkpoints (issue 32): the real ``wandb`` client
in offline mode (no network) logs a reference-artifact version per committed checkpoint;
the test reads back what it wrote to the offline run directory (the ``.wandb`` record
log) and restores from the recorded reference bitwise.
"""

from __future__ import annotations

import os
import struct
import warnings
from pathlib import Path

import pytest
import torch

wandb = pytest.importorskip("wandb")

import stepvault  # noqa: E402
from stepvault.catalog.events import read_events  # noqa: E402
from stepvault.integrations.wandb import WandbTracker, checkpoint_uri, sync_registry  # noqa: E402
from stepvault.manager.options import ManagerOptions  # noqa: E402
from stepvault.registry import Registry  # noqa: E402
from stepvault.store import Store  # noqa: E402


def offline_artifacts(run_dir: Path) -> list:
    """The artifact records of an offline run's ``.wandb`` file.

    The file is W&B's record log (LevelDB's log format: a 7-byte header, then 32 KiB
    blocks of chunks, each ``crc32 | length | type`` then bytes; types FULL, FIRST,
    MIDDLE, LAST), each record a ``wandb_internal_pb2.Record`` protobuf.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, records, partial = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += block - pos % block
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            partial = chunk
        elif kind == 3:
            partial += chunk
        elif kind == 4:
            records.append(partial + chunk)
    out = []
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "artifact":
            out.append(record.artifact)
    return out


def finish(run) -> Path:
    """Finish ``run`` and wait until its ``.wandb`` log is on disk; returns its directory.

    ``run.finish()`` returns once the exit record is handled, but it only *informs* the
    wandb-core service that the run is done (a message, no reply): the service then
    closes the run's stream, and its log writer, which buffers 32 KiB blocks, writes the
    records to the file only then. Read right after ``finish()`` the file can still be
    its 7-byte header. ``wandb.teardown()`` sends the teardown on the same connection
    (handled after the finish, in order) and waits for the service process to exit, so
    the stream is closed and the file complete when it returns.
    """
    run_dir = Path(run.dir).parent
    run.finish()
    wandb.teardown()
    return run_dir


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "step": 0}


def test_each_checkpoint_is_a_reference_artifact_version(offline, tmp_path):
    root = tmp_path / "ckpts"
    state = _state(0)
    run = wandb.init(project="stepvault-test", name="exp1", dir=str(offline))
    tracker = WandbTracker(best_metric="val_loss")
    mgr = stepvault.CheckpointManager(root, run="exp1", options=ManagerOptions(hooks=(tracker,)))
    val = {1: 0.9, 2: 0.5, 3: 0.7, 4: 0.4}  # best at 2, then at 4
    for step in range(1, 5):
        x = torch.randn(8, 16)
        loss = state["model"](x).square().mean()
        state["optimizer"].zero_grad()
        loss.backward()
        state["optimizer"].step()
        state["step"] = step
        mgr.save(step, state, metrics={"val_loss": val[step]})
    mgr.close()
    run_dir = finish(run)
    assert [s for s, _, _ in tracker.recorded] == [1, 2, 3, 4], tracker.failed

    store = Store.open(root)
    records = {r.step: r for r in stepvault.open(root).checkpoints("exp1")}
    arts = offline_artifacts(run_dir)
    assert [a.name for a in arts] == ["stepvault-exp1"] * 4
    by_step = {}
    for a in arts:
        (entry,) = a.manifest.contents
        step = int(entry.ref.rpartition("@")[2])
        by_step[step] = (a, entry)
    for step, (a, entry) in by_step.items():
        assert a.type == "model"
        assert entry.path == "checkpoint"
        assert entry.ref == f"stepvault:{store.backend.url}#exp1@{step}"
        assert entry.digest == records[step].manifest_id  # the manifest's BLAKE3
        assert entry.size == records[step].stored_bytes
        assert f"step-{step}" in a.aliases and "latest" in a.aliases
    assert "best" in by_step[2][0].aliases and "best" in by_step[4][0].aliases
    assert "best" not in by_step[3][0].aliases and "best" in by_step[1][0].aliases

    # What W&B recorded restores the checkpoint, bitwise.
    fresh, reference = _state(1), _state(2)
    assert stepvault.restore(by_step[2][1].ref, fresh).step == 2
    stepvault.restore(root, reference, run="exp1", step=2)
    for k, v in reference["model"].state_dict().items():
        assert torch.equal(fresh["model"].state_dict()[k], v)

    events = [e for e in read_events(store, "exp1") if e["event"] == "tracker_ref"]
    assert [(e["step"], e["tracker"]) for e in events] == [(s, "wandb") for s in (1, 2, 3, 4)]
    assert events[0]["ref"] == "wandb-artifact:///stepvault-test/stepvault-exp1:step-1"

    # The dashboard's checkpoint page says where W&B references the checkpoint.
    testclient = pytest.importorskip("starlette.testclient")
    from stepvault.ui import create_app

    client = testclient.TestClient(create_app(str(root)), base_url="http://127.0.0.1")
    doc = client.get("/api/runs/exp1/checkpoints/2").json()
    assert [(r["tracker"], r["name"]) for r in doc["referenced_by"]] == [
        ("wandb", "stepvault-exp1:step-2")
    ]
    html = client.get("/runs/exp1/checkpoints/2").text
    assert "Referenced by" in html and "stepvault-exp1:step-2" in html

    # The tracker_ref names a W&B artifact: restore refuses it, naming the way through
    # W&B, and changes nothing.
    before = {k: v.clone() for k, v in fresh["model"].state_dict().items()}
    with pytest.raises(stepvault.errors.InvalidNameError, match=r"W&B artifact.*checkpoint_uri"):
        stepvault.restore(events[0]["ref"], fresh)
    for k, v in before.items():
        assert torch.equal(fresh["model"].state_dict()[k], v)


def test_checkpoint_uri_of_a_logged_artifact_and_a_foreign_one(offline, tmp_path):
    root = tmp_path / "ckpts"
    stepvault.save(root, _state(0), run="r", step=7)
    uri = f"stepvault:{Store.open(root).backend.url}#r@7"
    art = wandb.Artifact("stepvault-r", type="model")
    art.add_reference(uri, name="checkpoint", checksum=False)
    assert checkpoint_uri(art) == uri
    foreign = wandb.Artifact("weights", type="model")
    foreign.add_reference("https://example.invalid/w.bin", name="w.bin", checksum=False)
    with pytest.raises(stepvault.errors.StepvaultError, match="not logged by stepvault"):
        checkpoint_uri(foreign)


def test_a_failing_wandb_run_records_tracker_failed_and_training_goes_on(offline, tmp_path):
    """The run was finished under the hook (its service gone): every record fails after
    its retries, each is a tracker_failed event, and every save commits."""
    run = wandb.init(project="stepvault-test", dir=str(offline))
    run.finish()
    tracker = WandbTracker(run=run, retries=1, backoff=0.01)
    root = tmp_path / "ckpts"
    state = _state(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mgr = stepvault.CheckpointManager(root, run="r", options=ManagerOptions(hooks=(tracker,)))
        for step in (1, 2):
            state["step"] = step
            mgr.save(step, state)
        mgr.close()
    events = read_events(Store.open(root), "r")
    assert [e["step"] for e in events if e["event"] == "save"] == [1, 2]
    failed = [e for e in events if e["event"] == "tracker_failed"]
    assert [(e["step"], e["tracker"]) for e in failed] == [(1, "wandb"), (2, "wandb")]
    assert stepvault.restore(root, _state(3), run="r").step == 2


def test_the_registry_is_mirrored_to_an_artifact_with_its_aliases(offline, tmp_path):
    """sync_registry logs each registered version of a model as its checkpoint's
    reference, oldest first, with the aliases it holds: replayed in order (as W&B applies
    them on sync: an alias is on one version of an artifact, the last one logged with it)
    the W&B aliases are stepvault's, after a promote too, and latest is the newest
    version. A version whose checkpoint is gone logs nothing."""
    root = tmp_path / "ckpts"
    state = _state(0)
    run = wandb.init(project="stepvault-test", name="exp1", dir=str(offline))
    mgr = stepvault.CheckpointManager(
        root, run="exp1", options=ManagerOptions(hooks=(WandbTracker(),))
    )
    for step in (1, 2, 3):
        state["step"] = step
        mgr.save(step, state)
    mgr.close()
    reg = Registry(root)
    reg.promote("clf", "exp1@1", "champion")
    reg.promote("clf", "exp1@2", "candidate")
    assert sync_registry(root, "clf") == {"candidate": "exp1@2", "champion": "exp1@1"}
    reg.promote("clf", "exp1@3", "champion")  # a new version takes the alias
    assert sync_registry(root, "clf") == {"candidate": "exp1@2", "champion": "exp1@3"}

    stepvault.save(root, state, run="exp2", step=5)
    reg.promote("other", "exp2@5", "champion")
    os.remove(root / Store.manifest_key("exp2", 5))  # deleted behind the registry's back
    with pytest.raises(stepvault.errors.RegistryError, match=r"other v1 .*exp2@5"):
        sync_registry(root, "other")
    run_dir = finish(run)

    url = Store.open(root).backend.url
    records = {r.step: r for r in stepvault.open(root).checkpoints("exp1")}
    arts = offline_artifacts(run_dir)
    assert "other" not in {a.name for a in arts}  # nothing logged for the broken model
    logged = [a for a in arts if a.name == "clf"]
    steps = []
    holder: dict[str, int] = {}
    for a in logged:
        (entry,) = a.manifest.contents
        step = int(entry.ref.rpartition("@")[2])
        assert entry.ref == f"stepvault:{url}#exp1@{step}"
        assert entry.digest == records[step].manifest_id and a.type == "model"
        steps.append(step)
        holder.update({alias: step for alias in a.aliases})
    assert steps == [1, 2, 1, 2, 3]  # each sync: every version, oldest first
    assert holder == {"champion": 3, "candidate": 2, "latest": 3}
    # The tracker's own artifact is untouched: latest stays on the run's newest checkpoint.
    run_art = [a for a in arts if a.name == "stepvault-exp1"]
    assert [("latest" in a.aliases, a.manifest.contents[0].ref[-1]) for a in run_art] == [
        (True, "1"),
        (True, "2"),
        (True, "3"),
    ]
    champion = next(a for a in reversed(logged) if "champion" in a.aliases)
    assert stepvault.restore(champion.manifest.contents[0].ref, _state(4)).step == 3
