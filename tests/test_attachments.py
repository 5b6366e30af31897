"""Attachments (issue 19): small files stored with a checkpoint, verified, deduplicated,
listed, diffed, attached after the fact without rewriting a manifest, exported."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import cli
from safetensors.torch import load_file

import stepvault
from stepvault import CheckpointManager
from stepvault.catalog.annotations import manifest_id
from stepvault.catalog.attachments import checkpoint_attachments
from stepvault.format.attachments import AttachmentError
from stepvault.store import Store

CONFIG = json.dumps({"hidden": 8}).encode()


def said(res) -> str:
    """The command's output with rich's line wrapping undone."""
    return " ".join(res.output.split())


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def test_saved_attachments_are_verified_objects_deduplicated_across_saves(tmp_path):
    root = tmp_path / "s"
    tok = tmp_path / "tokenizer.json"
    tok.write_bytes(b'{"vocab": [1, 2, 3]}')
    model = _model()
    first = stepvault.save(
        root, {"model": model}, run="r", step=1, attachments={"config.json": CONFIG}
    )
    second = stepvault.save(
        root,
        {"model": model},
        run="r",
        step=2,
        attachments={"config.json": CONFIG, "tokenizer.json": tok},
    )
    assert first.new_objects >= 1 and second.new_objects == 0  # tensors and config reused
    store = Store.open(str(root))
    one = checkpoint_attachments(store, "r", 1)
    two = checkpoint_attachments(store, "r", 2)
    assert set(one) == {"config.json"} and set(two) == {"config.json", "tokenizer.json"}
    assert one["config.json"].digest == two["config.json"].digest
    assert two["tokenizer.json"].read() == tok.read_bytes()
    # Older readers keep the objects alive: the manifest's objects table lists them.
    m = stepvault.open(str(root)).manifest("r", 2)
    assert two["tokenizer.json"].digest in m.objects
    from stepvault.ops import collect_garbage

    assert collect_garbage(store, grace_seconds=0).sweep.deleted == []
    assert two["tokenizer.json"].read() == tok.read_bytes()
    # A changed byte in the stored object is caught (by verify and by reading it).
    digest = two["tokenizer.json"].digest
    path = root / "objects" / digest[:2] / digest
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    with pytest.raises(stepvault.errors.CorruptObjectError):
        checkpoint_attachments(store, "r", 2)["tokenizer.json"].read()
    assert cli(root, "verify", "r@2", "--deep").exit_code == 1


def test_manager_save_with_attachments_and_bad_input(tmp_path):
    with CheckpointManager(tmp_path / "s", run="m", async_save=True) as mgr:
        mgr.save(3, {"model": _model()}, force=True, attachments={"hparams.json": b"{}"})
        mgr.wait()
        with pytest.raises(AttachmentError, match="invalid attachment name"):
            mgr.save(4, {"model": _model()}, force=True, attachments={"../x": b"1"})
        with pytest.raises(AttachmentError, match="cannot read"):
            mgr.save(5, {"model": _model()}, force=True, attachments={"a.json": "/nope"})
    store = Store.open(str(tmp_path / "s"))
    assert set(checkpoint_attachments(store, "m", 3)) == {"hparams.json"}
    assert store.list_steps("m") == [3]  # refused saves wrote no checkpoint


def test_show_and_diff_list_attachments(tmp_path):
    root = tmp_path / "s"
    stepvault.save(root, {"model": _model()}, run="r", step=1, attachments={"config.json": CONFIG})
    new = json.dumps({"hidden": 16}).encode()
    stepvault.save(
        root, {"model": _model()}, run="r", step=2, attachments={"config.json": new, "x.txt": b"x"}
    )
    shown = cli(root, "show", "r@2")
    assert shown.exit_code == 0 and "config.json" in shown.output and "x.txt" in shown.output
    doc = json.loads(cli(root, "show", "r@1", "--json").output)
    assert [a["name"] for a in doc["attachments"]] == ["config.json"]
    diff = json.loads(cli(root, "diff", "r@1", "r@2", "--json").output)
    status = {row["name"]: row["status"] for row in diff["attachments"]}
    assert status == {"config.json": "changed", "x.txt": "added"}
    assert {t["status"] for t in diff["tensors"]} == {"same"}


def test_attach_after_the_fact_keeps_the_manifest_and_enables_hf_export(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config).eval()
    root = tmp_path / "s"
    stepvault.save(root, {"model": model}, run="plain", step=7)
    store = Store.open(str(root))
    before = store.read_manifest("plain", 7)
    out = tmp_path / "out"
    res = cli(root, "export", "plain@7", "-o", str(out), "--format", "hf")
    assert res.exit_code == 2  # a usage error, like every refused command
    assert "no 'config.json' attachment" in said(res)
    assert "stepvault attach plain@7" in said(res)
    assert not out.exists()  # nothing half-written
    model.config.architectures = ["GPT2LMHeadModel"]
    model.config.save_pretrained(tmp_path / "cfg")
    res = cli(root, "attach", "plain@7", str(tmp_path / "cfg" / "config.json"))
    assert res.exit_code == 0, res.output
    assert store.read_manifest("plain", 7) == before  # history not rewritten
    assert os.listdir(root / "runs" / "plain" / "attachments") == ["7.1.json"]
    assert cli(root, "export", "plain@7", "-o", str(out)).exit_code == 0  # hf by default now
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    shown = cli(root, "show", "plain@7")
    assert "attached later" in shown.output
    # A re-save of the step (another manifest) does not inherit the old record.
    stepvault.save(root, {"model": model}, run="plain", step=7, overwrite=True)
    assert manifest_id(store.read_manifest("plain", 7)) != manifest_id(before)
    assert checkpoint_attachments(store, "plain", 7) == {}


def test_export_refuses_a_folder_it_did_not_write(tmp_path):
    root = tmp_path / "s"
    stepvault.save(root, {"model": _model()}, run="r", step=1, attachments={"x.json": b"{}"})
    out = tmp_path / "busy"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    res = cli(root, "export", "r@1", "-o", str(out))
    assert res.exit_code == 2 and "not empty" in said(res)
    assert os.listdir(out) == ["mine.txt"]
    # A folder export (attachments but no model config): weights + files + card.
    fresh = tmp_path / "fresh"
    assert cli(root, "export", "r@1", "-o", str(fresh)).exit_code == 0
    assert {"model.safetensors", "x.json", "README.md", "stepvault-export.json"} == set(
        os.listdir(fresh)
    )
    assert cli(root, "export", "r@1", "-o", str(fresh)).exit_code == 0  # replaced whole
    assert set(load_file(fresh / "model.safetensors")) == {"weight", "bias"}


def test_int8_hf_export_is_marked_lossy(tmp_path):
    root = tmp_path / "s"
    cfg = json.dumps({"architectures": ["Nothing"], "model_type": "x"}).encode()
    stepvault.save(root, {"model": _model()}, run="r", step=1, attachments={"config.json": cfg})
    out = tmp_path / "q"
    assert cli(root, "export", "r@1", "-o", str(out), "--quantize", "int8").exit_code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["stepvault_quantization"]["lossy"] is True
    assert "LOSSY" in (out / "README.md").read_text()
    assert load_file(out / "model.safetensors")["weight"].dtype == torch.int8


def test_a_damaged_attachment_record_is_an_error_not_a_fallback(tmp_path):
    root = tmp_path / "s"
    stepvault.save(root, {"model": _model()}, run="r", step=1, attachments={"a.json": b"{}"})
    (tmp_path / "a.json").write_bytes(b'{"newer": true}')
    assert cli(root, "attach", "r@1", str(tmp_path / "a.json")).exit_code == 0
    store = Store.open(str(root))
    assert checkpoint_attachments(store, "r", 1)["a.json"].read() == b'{"newer": true}'
    key = root / "runs" / "r" / "attachments" / "1.1.json"
    record = json.loads(key.read_text())
    record["files"]["a.json"]["data"] = "eyJvbGRlciI6IHRydWV9"  # other bytes, same hash
    key.write_text(json.dumps(record))
    with pytest.raises(AttachmentError, match="does not match its hash"):
        checkpoint_attachments(store, "r", 1)
    res = cli(root, "export", "r@1", "-o", str(tmp_path / "out"), "--format", "folder")
    assert res.exit_code == 2 and "does not match its hash" in said(res)
    assert "does not match its hash" in said(cli(root, "show", "r@1"))


def test_listing_and_show_agree_on_the_stored_size_of_a_checkpoint_with_attachments(tmp_path):
    """The listing cached at commit left the attachments' objects out of the stored size
    (the manifest being written keeps them apart); ``show`` and the dashboard's checkpoint
    page counted them: two sizes for one checkpoint."""
    stepvault.save(
        tmp_path, {"model": _model()}, run="r", step=1, attachments={"config.json": CONFIG}
    )
    listed = stepvault.open(tmp_path).checkpoints("r")[0].stored_bytes
    shown = stepvault.open(tmp_path).manifest("r", 1).stored_bytes
    assert listed == shown
    for cache in (tmp_path / "runs" / "r").glob("summaries*"):
        cache.unlink()  # rebuilt from the manifests
    assert stepvault.open(tmp_path).checkpoints("r")[0].stored_bytes == shown
