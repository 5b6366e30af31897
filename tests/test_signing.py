"""Signed manifests and registry records: tampering is detected, honest stores verify."""

from __future__ import annotations

import json

import pytest
from blake3 import blake3
from helpers import cli, linear_state

import stepvault
from stepvault import CheckpointManager, KeepLast
from stepvault.format.hashing import content_hash
from stepvault.registry import Registry
from stepvault.signing import Signer, Verifier
from stepvault.store import Store

HMAC = "hmac:" + "ab" * 32


def _signed_store(tmp_path, signer):
    root = tmp_path / "s"
    for step in (1, 2):
        stepvault.save(root, linear_state(step), run="r", step=step, signer=signer)
    reg = Registry(root, signer=signer)
    reg.promote("m", "r@1", "stable")
    reg.promote("m", "r@2", "stable")
    stepvault.ops.annotate(root, "r", 2, {"val_loss": 1.5}, signer=signer)
    return root


def _recompute_envelope(body: bytes) -> bytes:
    env = {
        "format": "stepvault-manifest",
        "version": 1,
        "body_blake3": content_hash(body),
        "body_size": len(body),
    }
    return json.dumps(env, separators=(",", ":")).encode() + b"\n" + body


@pytest.mark.parametrize("kind", ["ed25519", "hmac"])
def test_honest_store_verifies_and_every_tampering_is_found(tmp_path, kind):
    signer = Signer.generate() if kind == "ed25519" else Signer.from_spec(HMAC)
    root = _signed_store(tmp_path, signer)
    verifier = signer.verifier()
    store = Store.open(root)
    report = stepvault.ops.verify_signatures(store, verifier, require=True)
    assert report.ok, report.problems
    # manifests, annotation, versions, moves, the head of the model's history
    assert report.count("valid") == 2 + 1 + 2 + 2 + 1

    # 1. A manifest edited with a recomputed checksum: plain verify passes, signatures don't.
    path = root / "runs/r/checkpoints/1.json"
    _, body = path.read_bytes().split(b"\n", 1)
    doc = json.loads(body)
    doc["metrics"] = {"val_loss": 0.01}  # a forged metric
    path.write_bytes(_recompute_envelope(json.dumps(doc, separators=(",", ":")).encode()))
    assert stepvault.ops.verify(root, "r", 1).ok
    # 2. A registry version re-pointed at another checkpoint.
    vpath = root / "refs/registry/m/versions/1.json"
    v = json.loads(vpath.read_text())
    v["step"] = 2
    vpath.write_text(json.dumps(v))
    # 3. An annotation with a better number.
    (apath,) = (root / "runs/r/annotations").iterdir()
    a = json.loads(apath.read_text())
    a["metrics"]["val_loss"] = 0.5
    apath.write_text(json.dumps(a))
    report = stepvault.ops.verify_signatures(store, verifier)
    bad = {(e["kind"], e.get("ref") or e.get("key"), e["status"]) for e in report.problems}
    assert ("manifest", "r@1", "invalid") in bad
    assert ("annotation", "r@2", "invalid") in bad
    assert any(k == "version" and s == "invalid" for k, _, s in bad)
    assert len(report.problems) == 3  # the untouched records still verify

    # 4. A deleted alias move breaks the hash chain even without a key check.
    (root / "refs/registry/m/moves/1.json").unlink()
    chain = [e for e in Registry(root).check() if e["kind"] == "move"]
    assert chain[0]["status"] == "broken-chain"


def test_cutting_off_the_newest_alias_moves_is_detected(tmp_path):
    """The hash chain cannot see a deleted *tail*; the signed head record can."""
    signer = Signer.from_spec(HMAC)
    root = _signed_store(tmp_path, signer)
    store = Store.open(root)
    reg = Registry(store, signer=signer)
    reg.rollback("m", "stable")  # a third move, after the store's two promotions
    moves = root / "refs/registry/m/moves"
    assert sorted(p.name for p in moves.iterdir()) == ["1.json", "2.json", "3.json"]
    assert all(e["status"] == "ok" for e in reg.check())
    assert stepvault.ops.verify_signatures(store, signer.verifier()).ok
    # An attacker hides the last promotion: the remaining chain is intact ...
    (moves / "3.json").unlink()
    assert all(e["status"] == "ok" for e in reg.check() if e["kind"] == "move")
    # ... but the head still names move 3.
    head = [e for e in reg.check() if e["kind"] == "head"]
    assert head[0]["status"] == "truncated" and "move 3" in head[0]["detail"]
    report = stepvault.ops.verify_signatures(store, signer.verifier())
    assert [e["kind"] for e in report.problems] == ["head"]
    # Deleting the head too: the history is no longer anchored, also reported.
    (root / "refs/registry/m/head.json").unlink()
    report = stepvault.ops.verify_signatures(store, signer.verifier())
    assert [e["status"] for e in report.problems] == ["no-head"]
    # A forged head (pointing at move 2 without the key) is an invalid signature.
    data = (moves / "2.json").read_bytes()
    forged = {"model": "m", "seq": 2, "blake3": blake3(data).hexdigest()}
    (root / "refs/registry/m/head.json").write_text(json.dumps(forged))
    report = stepvault.ops.verify_signatures(store, signer.verifier())
    assert report.ok  # unsigned records are problems only when signatures are required
    strict = stepvault.ops.verify_signatures(store, signer.verifier(), require=True)
    assert [(e["kind"], e["status"]) for e in strict.problems] == [("head", "unsigned")]
    # The next legitimate move re-anchors the history.
    reg.promote("m", "r@1", "stable")
    assert stepvault.ops.verify_signatures(store, signer.verifier(), require=True).ok


def test_wrong_key_and_unsigned_records_are_reported(tmp_path):
    signer = Signer.from_spec(HMAC)
    root = _signed_store(tmp_path, signer)
    stepvault.save(root, linear_state(3), run="r", step=3)  # unsigned
    other = Signer.from_spec("hmac:" + "cd" * 32).verifier()
    report = stepvault.ops.verify_signatures(Store.open(root), other)
    assert {e["status"] for e in report.problems} == {"other-key"}
    report = stepvault.ops.verify_signatures(Store.open(root), signer.verifier())
    assert report.ok and report.count("unsigned") == 1
    strict = stepvault.ops.verify_signatures(Store.open(root), signer.verifier(), require=True)
    assert [e["ref"] for e in strict.problems] == ["r@3"]


def test_manager_signs_from_the_environment_and_cleans_signatures(tmp_path, monkeypatch):
    monkeypatch.setenv("STEPVAULT_SIGNING_KEY", HMAC)
    root = tmp_path / "s"
    with CheckpointManager(root, "r", keep=KeepLast(1), async_save=True) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, linear_state(step))
    names = sorted(p.name for p in (root / "runs/r/checkpoints").iterdir())
    assert names == ["3.json", "3.sig"]  # deleted checkpoints take their signature along
    monkeypatch.setenv("STEPVAULT_VERIFY_KEY", HMAC)
    res = cli(root, "verify", "--signatures", "--require")
    assert res.exit_code == 0, res.output
    assert "1 valid" in res.output


def test_cli_keygen_sign_and_verify(tmp_path):
    root = tmp_path / "s"
    stepvault.save(root, linear_state(1), run="r", step=1)
    key = tmp_path / "team"
    res = cli(root, "keygen", str(key))
    assert res.exit_code == 0, res.output
    assert (key.with_suffix(".key").stat().st_mode & 0o777) == 0o600
    pub = str(key) + ".pub"
    res = cli(root, "verify", "--signatures", "--key", pub, "--require")
    assert res.exit_code == 1 and "UNSIGNED" in res.output
    res = cli(root, "sign", "r", "--key", str(key) + ".key")
    assert res.exit_code == 0 and "signed 1 manifest" in res.output
    res = cli(root, "verify", "--signatures", "--key", pub, "--require", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["signatures"]["counts"] == {"valid": 1}
    (root / "runs/r/checkpoints/1.sig").write_text('{"alg": "ed25519", "signature": "x"}')
    res = cli(root, "verify", "--signatures", "--key", pub)
    assert res.exit_code == 1
    res = cli(root, "verify", "--signatures")
    assert res.exit_code == 2 and "needs a key" in res.output


def test_bad_keys_give_clear_errors(tmp_path):
    with pytest.raises(stepvault.errors.StepvaultError, match="at least 16 bytes"):
        Signer.hmac(b"short")
    with pytest.raises(stepvault.errors.StepvaultError, match="cannot load a private key"):
        Signer.from_key_file(tmp_path / "missing.key")
    (tmp_path / "junk.pub").write_text("not a key")
    with pytest.raises(stepvault.errors.StepvaultError, match="holds no Ed25519 key"):
        Verifier.from_spec(str(tmp_path / "junk.pub"))


def test_plain_verify_of_a_store_checks_the_registry_history(tmp_path):
    root = _signed_store(tmp_path, Signer.from_spec(HMAC))
    res = cli(root, "verify")
    assert res.exit_code == 0, res.output
    (root / "refs/registry/m/moves/2.json").unlink()  # the newest promotion, hidden
    res = cli(root, "verify")
    assert res.exit_code == 1 and "TRUNCATED" in res.output and "move 2" in res.output
    res = cli(root, "verify", "--json")
    assert res.exit_code == 1
    assert [e["status"] for e in json.loads(res.output)["registry"]] == ["truncated"]
    assert cli(root, "verify", "r").exit_code == 0  # one run: its checkpoints only


def test_the_dashboard_shows_a_tampered_signed_checkpoint_as_altered(tmp_path):
    """The checkpoint page showed "ed25519, key …" for a manifest edited (checksum
    recomputed) after it was signed: the signature record names the signed bytes'
    BLAKE3, so the page can say the manifest is not what was signed, without the key."""
    from starlette.testclient import TestClient

    from stepvault.ui.app import create_app

    root = _signed_store(tmp_path, Signer.generate())
    client = TestClient(create_app(str(root)), base_url="http://127.0.0.1:8765")
    honest = client.get("/api/runs/r/checkpoints/2").json()["signature"]
    assert honest["alg"] == "ed25519" and "altered" not in honest
    path = root / "runs/r/checkpoints/2.json"
    _, body = path.read_bytes().split(b"\n", 1)
    doc = json.loads(body)
    doc["metrics"] = {"val_loss": 0.01}
    path.write_bytes(_recompute_envelope(json.dumps(doc, separators=(",", ":")).encode()))
    client = TestClient(create_app(str(root)), base_url="http://127.0.0.1:8765")
    assert client.get("/api/runs/r/checkpoints/2").json()["signature"]["altered"] is True
    page = client.get("/runs/r/checkpoints/2").text
    assert "ALTERED: the manifest is not what key" in page
