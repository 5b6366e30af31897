"""Lineage of checkpoints and models, and evaluation records attached after the fact."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from helpers import cli, linear_state

import stepvault
from stepvault import CheckpointManager, KeepBest, KeepLast
from stepvault.registry import Lineage, Registry, lineage_report
from stepvault.store import Store


def test_lineage_of_a_fine_tune_reaches_back_to_its_base(tmp_path):
    root = tmp_path / "s"
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "shard-0.txt").write_text("hello")
    repo = tmp_path / "code"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "train.py").write_text("print('hi')\n")
    git = ["git", "-C", str(repo), "-c", "user.email=a@b", "-c", "user.name=a"]
    subprocess.run([*git, "add", "train.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "init"], check=True)

    base_cfg = {"lr": 3e-4, "layers": 2, "schedule": ("cosine", 1000)}
    base = Lineage.capture(base_cfg, data="pile-v1", code_dir=repo)
    with CheckpointManager(root, "base", lineage=base, async_save=False) as mgr:
        mgr.save(100, linear_state(1))
    (repo / "train.py").write_text("print('changed')\n")  # uncommitted change: dirty
    ft = Lineage.capture(
        {"lr": 1e-5},
        data=stepvault.registry.fingerprint_files([data_dir]),
        parent="base@100",
        code_dir=repo,
    )
    with CheckpointManager(root, "ft", lineage=ft) as mgr:
        mgr.save(10, linear_state(2))
        mgr.save(20, linear_state(3))
    Registry(root).promote("chat", "ft@20", "stable")

    report = lineage_report(Store.open(root), "chat@stable")
    assert report["model"] == "chat" and report["version"]["version"] == 1
    assert report["aliases"] == ["stable"]
    node = report["checkpoint"]
    assert (node["run"], node["step"]) == ("ft", 20)
    lin = node["lineage"]
    assert lin["config"] == {"lr": 1e-5}
    assert lin["code"]["dirty"] is True and len(lin["code"]["git_commit"]) == 40
    assert lin["data"]["files"] == 1 and len(lin["data"]["fingerprint"]) == 64
    assert lin["environment"]["torch"] == torch.__version__
    assert lin["environment"]["world_size"] == 1
    parent = node["parent"]
    assert (parent["run"], parent["step"]) == ("base", 100)
    assert parent["lineage"]["config"] == {"lr": 3e-4, "layers": 2, "schedule": ["cosine", 1000]}
    assert parent["lineage"]["code"]["dirty"] is False
    assert parent["lineage"]["data"] == "pile-v1"
    assert "warning" not in parent

    res = cli(root, "lineage", "chat@stable")
    assert res.exit_code == 0, res.output
    for text in (
        "model chat v1 (stable)",
        "ft@20",
        "base@100",
        "lr = 1e-05",
        "(dirty)",
        "pile-v1",
        "fine-tuned from",
    ):
        assert text in res.output, (text, res.output)
    as_json = json.loads(cli(root, "lineage", "ft@10", "--json").output)
    assert as_json["checkpoint"]["parent"]["step"] == 100


def test_each_session_links_its_own_lineage(tmp_path):
    root = tmp_path / "s"
    with CheckpointManager(root, "r", lineage=Lineage.capture({"lr": 1})) as mgr:
        mgr.save(1, linear_state(1))
    with CheckpointManager(root, "r", lineage=Lineage.capture({"lr": 2})) as mgr:
        mgr.save(2, linear_state(2))
    with CheckpointManager(root, "r", lineage=False) as mgr:
        mgr.save(3, linear_state(3))
    store = Store.open(root)
    configs = [
        (lineage_report(store, f"r@{s}")["checkpoint"]["lineage"] or {}).get("config")
        for s in (1, 2, 3)
    ]
    assert configs == [{"lr": 1}, {"lr": 2}, None]
    # A damaged lineage record is reported, not trusted.
    (record,) = [p for p in (root / "runs/r/lineage").iterdir() if b'"lr":1' in p.read_bytes()]
    record.write_bytes(record.read_bytes().replace(b'"lr":1', b'"lr":9'))
    node = lineage_report(store, "r@1")["checkpoint"]
    assert node["lineage"] is None and "does not match its hash" in node["lineage_error"]


def test_parent_must_exist(tmp_path):
    with pytest.raises(stepvault.errors.CheckpointNotFoundError):
        stepvault.save(
            tmp_path / "s", linear_state(1), run="r", step=1, lineage=Lineage(parent="nope@5")
        )
    with pytest.raises(stepvault.errors.StepvaultError, match="exact checkpoint"):
        stepvault.save(
            tmp_path / "s", linear_state(1), run="r", step=1, lineage=Lineage(parent="nope")
        )


def test_annotations_drive_best_k_and_restore_best(tmp_path):
    root = tmp_path / "s"
    keep = KeepLast(1) | KeepBest(1, metric="val_loss", mode="min")
    with CheckpointManager(root, "r", keep=keep, async_save=False) as mgr:
        mgr.save(1, linear_state(1), metrics={"val_loss": 3.0})
        mgr.save(2, linear_state(2), metrics={"val_loss": 4.0})
        assert mgr.best_step == 1
        # An evaluation job scores step 2 better than anything measured at save time.
        stepvault.ops.annotate(root, "r", 2, {"val_loss": 0.5}, note="full eval")
        assert mgr.best_step == 2
        mgr.save(3, linear_state(3), metrics={"val_loss": 1.0})
        assert Store.open(root).list_steps("r") == [2, 3]  # step 1 went, the annotated best stayed
        restored = linear_state(9)
        info = mgr.restore(restored, step="best")
        assert info.step == 2
    assert torch.equal(restored["model"].weight, linear_state(2)["model"].weight)
    res = cli(root, "annotate", "r@3", "val_loss=0.25", "acc=0.9", "--note", "rerun")
    assert res.exit_code == 0 and "val_loss=0.25" in res.output, res.output
    with CheckpointManager(root, "r", keep=keep) as mgr:
        assert mgr.best_step == 3
    events = [
        e for e in stepvault.CheckpointManager(root, "r").events() if e["event"] == "annotate"
    ]
    assert [e["metrics"]["val_loss"] for e in events] == [0.5, 0.25]
    assert all(e["user"] and e["host"] for e in events)


def test_annotations_do_not_carry_over_to_a_replaced_checkpoint(tmp_path):
    root = tmp_path / "s"
    stepvault.save(root, linear_state(1), run="r", step=1, metrics={"val_loss": 3.0})
    stepvault.ops.annotate(root, "r", 1, {"val_loss": 0.1})
    stepvault.save(
        root, linear_state(2), run="r", step=1, metrics={"val_loss": 3.0}, overwrite=True
    )
    from stepvault.manager.checkpoint_manager import checkpoint_records

    (rec,) = checkpoint_records(Store.open(root), "r")
    assert rec.metrics == {"val_loss": 3.0}


def test_bad_annotations_are_refused(tmp_path):
    root = tmp_path / "s"
    stepvault.save(root, linear_state(1), run="r", step=1)
    for bad in (["val_loss"], ["val_loss=abc"], ["=1"]):
        res = cli(root, "annotate", "r@1", *bad)
        assert res.exit_code == 2
        assert "NAME=VALUE" in res.output or "not a number" in res.output
    with pytest.raises(stepvault.errors.StepvaultError, match="finite"):
        stepvault.ops.annotate(root, "r", 1, {"loss": float("nan")})
    with pytest.raises(stepvault.errors.CheckpointNotFoundError):
        stepvault.ops.annotate(root, "r", 7, {"loss": 1.0})
    assert not (root / "runs/r/annotations").exists()


def test_listings_show_annotated_metrics(tmp_path):
    root = tmp_path / "s"
    stepvault.save(root, linear_state(1), run="r", step=1, metrics={"loss": 2.0})
    assert stepvault.open(root).checkpoints("r")[0].metrics == {"loss": 2.0}
    stepvault.ops.annotate(root, "r", 1, {"val_loss": 1.25})
    (summary,) = stepvault.open(root).checkpoints("r")
    assert summary.metrics == {"loss": 2.0, "val_loss": 1.25}
    res = cli(root, "ls", "r")
    assert res.exit_code == 0 and "val_loss" in res.output, res.output


def test_plain_save_takes_lineage_false_like_the_manager_and_names_a_wrong_type(tmp_path):
    stepvault.save(tmp_path, linear_state(1), run="r", step=1, lineage=False)
    m = stepvault.open(tmp_path).checkpoint("r", 1).manifest
    assert m.lineage is None
    with pytest.raises(TypeError, match=r"lineage must be a stepvault\.registry\.Lineage"):
        stepvault.save(tmp_path, linear_state(2), run="r", step=2, lineage={"lr": 1e-3})
    assert Store.open(tmp_path).list_steps("r") == [1]  # nothing written by the refused save
