"""Integrity: damage is detected by verify and never restored; restore falls back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import flip_byte, object_path
from typer.testing import CliRunner

import stepvault
from stepvault.cli.main import app


def _objects(root, run, step):
    return set(stepvault.open(root).manifest(run, step).objects)


@pytest.fixture
def two_checkpoints(tmp_path):
    """Steps 1 and 2 of run r; returns (root, objects only step 2 has, tensors of step 1)."""
    torch.manual_seed(0)
    state = {"w": torch.randn(400_000), "b": torch.randn(10), "step": 1}
    stepvault.save(tmp_path, state, run="r", step=1)
    first = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    state["w"] += 1
    state["step"] = 2
    stepvault.save(tmp_path, state, run="r", step=2)
    only2 = _objects(tmp_path, "r", 2) - _objects(tmp_path, "r", 1)
    assert only2
    return tmp_path, only2, first


def _live():
    return {"w": torch.zeros(400_000), "b": torch.zeros(10), "step": 0}


def test_flipped_byte_found_by_deep_verify_and_skipped_by_restore(two_checkpoints):
    root, only2, first = two_checkpoints
    flip_byte(object_path(root, next(iter(only2))))
    assert stepvault.ops.verify(root).ok  # sizes unchanged: quick verify cannot see a flip
    report = stepvault.ops.verify(root, deep=True)
    assert not report.ok
    assert [(c.step, c.ok) for c in report.checkpoints] == [(1, True), (2, False)]
    assert "does not match its hash" in report.damaged[0].problems[0]

    live = _live()
    info = stepvault.restore(root, live, run="r")
    assert info.step == 1
    assert [s.step for s in info.skipped] == [2]
    assert "xxh3-128 checksum of segment" in info.skipped[0].reason  # the fast read path
    assert torch.equal(live["w"], first["w"]) and live["step"] == 1

    with pytest.raises(stepvault.errors.IntegrityError):  # (the bad object is now quarantined)
        stepvault.restore(root, _live(), run="r", step=2)  # an explicit step never falls back


def test_truncated_and_missing_objects(two_checkpoints):
    root, only2, _ = two_checkpoints
    path = object_path(root, next(iter(only2)))
    with open(path, "r+b") as f:
        f.truncate(100)
    report = stepvault.ops.verify(root)
    assert "truncated" in report.damaged[0].problems[0]
    os.unlink(path)
    report = stepvault.ops.verify(root)
    assert report.damaged[0].step == 2 and "missing" in report.damaged[0].problems[0]
    assert stepvault.restore(root, _live(), run="r").step == 1


def test_damaged_manifest_is_skipped(two_checkpoints):
    root, _, _ = two_checkpoints
    path = os.path.join(root, "runs", "r", "checkpoints", "2.json")
    data = bytearray(Path(path).read_bytes())
    data[-10] ^= 0x20
    Path(path).write_bytes(bytes(data))
    report = stepvault.ops.verify(root)
    assert "checksum" in report.damaged[0].problems[0]
    info = stepvault.restore(root, _live(), run="r")
    assert info.step == 1 and "checksum" in info.skipped[0].reason


def test_unknown_codec_is_an_error_not_garbage(two_checkpoints):
    root, only2, _ = two_checkpoints
    path = object_path(root, next(iter(only2)))
    data = Path(path).read_bytes()
    assert b'"codec":"raw"' in data
    Path(path).write_bytes(data.replace(b'"codec":"raw"', b'"codec":"lz9"', 1))
    report = stepvault.ops.verify(root, deep=True)
    assert "unknown codec 'lz9'" in report.damaged[0].problems[0]
    assert stepvault.restore(root, _live(), run="r").step == 1


def test_newer_manifest_version_is_refused(two_checkpoints):
    root, _, _ = two_checkpoints
    path = os.path.join(root, "runs", "r", "checkpoints", "2.json")
    head, body = Path(path).read_bytes().split(b"\n", 1)
    env = json.loads(head)
    env["version"] = 99
    Path(path).write_bytes(json.dumps(env).encode() + b"\n" + body)
    with pytest.raises(stepvault.errors.StoreVersionError, match="upgrade"):
        stepvault.restore(root, _live(), run="r", step=2)
    info = stepvault.restore(root, _live(), run="r")
    assert info.step == 1 and "newer" in info.skipped[0].reason


def test_every_checkpoint_damaged(two_checkpoints):
    root, _, _ = two_checkpoints
    for digest in _objects(root, "r", 1) | _objects(root, "r", 2):
        os.unlink(object_path(root, digest))
    live = _live()
    with pytest.raises(stepvault.errors.NoValidCheckpointError) as exc:
        stepvault.restore(root, live, run="r")
    assert [s.step for s in exc.value.skipped] == [2, 1]
    assert live["step"] == 0 and float(live["w"].abs().sum()) == 0.0


def test_cli_verify_exit_codes_and_json(two_checkpoints):
    root, only2, _ = two_checkpoints
    runner = CliRunner()
    ok = runner.invoke(app, ["--root", str(root), "verify", "--deep"])
    assert ok.exit_code == 0, ok.output
    assert "0 damaged" in ok.output
    flip_byte(object_path(root, next(iter(only2))))
    bad = runner.invoke(app, ["--root", str(root), "verify", "--deep", "--json"])
    assert bad.exit_code == 1
    doc = json.loads(bad.output)
    assert doc["ok"] is False
    assert [c["step"] for c in doc["checkpoints"] if not c["ok"]] == [2]
    one = runner.invoke(app, ["verify", "r@1", "--deep", "--root", str(root)])
    assert one.exit_code == 0, one.output


def test_damaged_object_is_quarantined_and_rewritten_by_the_next_save(two_checkpoints):
    root, only2, _ = two_checkpoints
    victim = next(iter(only2))
    flip_byte(object_path(root, victim))
    info = stepvault.restore(root, _live(), run="r")
    assert info.step == 1 and "quarantine" in info.skipped[0].reason
    assert not os.path.exists(object_path(root, victim))
    assert os.path.exists(os.path.join(root, "quarantine", victim))
    # Re-saving the same content (deterministic training after a resume) writes a good copy
    # instead of deduplicating against the damaged one.
    torch.manual_seed(0)
    state = {"w": torch.randn(400_000) + 1, "b": torch.randn(10), "step": 2}
    saved = stepvault.save(root, state, run="r", step=2, overwrite=True)
    assert saved.new_bytes > 0
    assert stepvault.ops.verify(root, deep=True).ok


# --- The corruption campaign (issue 31): every kind of damage, every read path -----------
#
# Reads verify with the segment checksums recorded at save (xxh3-128, FORMAT.md §3.3) or,
# with verify="full", with BLAKE3; partial reads (one tensor, mmap=True) verify only the
# segments they use. Whatever the path, every damage below must be found, and a restore
# that finds it changes no live tensor.

CAMPAIGN_NAMES = [f"p{i}" for i in range(6)] + ["big"]


def _campaign_state(step: int) -> dict:
    """Six 600 KB tensors that share one 3.6 MB bundle (four 1 MiB checksum segments) and
    one 2.4 MB tensor in objects of its own."""
    g = torch.Generator().manual_seed(step)
    state: dict = {name: torch.randn(150_000, generator=g) for name in CAMPAIGN_NAMES[:-1]}
    state["big"] = torch.randn(600_000, generator=g)
    state["step"] = step
    return state


def _zeros() -> dict:
    live = {k: torch.zeros_like(v) for k, v in _campaign_state(0).items() if k != "step"}
    live["step"] = 0
    return live


def _flip_at(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


def _payload_offset(path: str) -> int:
    from stepvault.format.objects import parse_header

    return parse_header(Path(path).read_bytes()).payload_offset


def _swap_in_other(path: str, other: str) -> None:
    Path(path).write_bytes(Path(other).read_bytes())


DAMAGE = {
    # a bit of the first and the last payload byte, the middle of the payload
    "first_byte": lambda p, o: _flip_at(p, _payload_offset(p)),
    "last_byte": lambda p, o: flip_byte(p),
    "middle_byte": lambda p, o: _flip_at(p, (_payload_offset(p) + os.path.getsize(p)) // 2),
    # the recorded checksums themselves (a hex digit of the header's sums)
    "sums_digit": lambda p, o: Path(p).write_bytes(_bump_sums(Path(p).read_bytes())),
    "truncated": lambda p, o: os.truncate(p, os.path.getsize(p) - 4096),
    "deleted": lambda p, o: os.unlink(p),
    "swapped": _swap_in_other,
}


def _bump_sums(data: bytes) -> bytes:
    at = data.index(b'"hex":"') + len(b'"hex":"')
    digit = data[at : at + 1]
    return data[:at] + (b"0" if digit != b"0" else b"1") + data[at + 1 :]


@pytest.fixture(scope="module")
def campaign_template(tmp_path_factory):
    """Steps 1 and 2 of run r (written with segment checksums); step 2's own objects."""
    root = tmp_path_factory.mktemp("campaign") / "store"
    for step in (1, 2):
        stepvault.save(root, _campaign_state(step), run="r", step=step)
    only2 = sorted(_objects(root, "r", 2) - _objects(root, "r", 1))
    assert len(only2) >= 2
    head = Path(object_path(root, only2[0])).read_bytes()[:4096]
    assert b'"sums":{"alg":"xxh3-128"' in head  # saves record them
    return root, only2


def _copy(template, tmp_path) -> Path:
    import shutil

    dst = tmp_path / "store"
    shutil.copytree(template, dst)
    return dst


def _same_as(live: dict, step: int) -> bool:
    want = _campaign_state(step)
    return live["step"] == want["step"] and all(
        torch.equal(live[k], want[k]) for k in CAMPAIGN_NAMES
    )


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("verify", ["fast", "full"])
def test_campaign_restore_finds_every_damage_and_changes_nothing(
    campaign_template, tmp_path, damage, verify
):
    template, only2 = campaign_template
    found = 0
    for i, victim in enumerate(only2):  # every object of step 2 in turn
        root = _copy(template, tmp_path / f"{i}")
        other = object_path(root, only2[(i + 1) % len(only2)])
        DAMAGE[damage](object_path(root, victim), other)
        if verify == "full" and damage == "sums_digit":
            # BLAKE3 does not read the checksums: the bytes are what their name says, so
            # the restore is right (the fast path refuses the object instead).
            live = _zeros()
            stepvault.restore(root, live, run="r", step=2, verify=verify)
            assert _same_as(live, 2)
            found += 1
            continue
        # An explicit step: the damage is an error, and not one live tensor changed.
        live = _zeros()
        with pytest.raises(stepvault.errors.IntegrityError):
            stepvault.restore(root, live, run="r", step=2, verify=verify)
        assert live["step"] == 0 and all(float(live[k].abs().sum()) == 0 for k in CAMPAIGN_NAMES)
        # "latest" falls back past it to step 1, bitwise.
        root = _copy(template, tmp_path / f"{i}b")
        DAMAGE[damage](object_path(root, victim), object_path(root, only2[(i + 1) % len(only2)]))
        live = _zeros()
        info = stepvault.restore(root, live, run="r", verify=verify)
        assert info.step == 1 and [s.step for s in info.skipped] == [2]
        assert _same_as(live, 1)
        found += 1
    assert found == len(only2)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_campaign_partial_and_whole_reads_find_every_damage(campaign_template, tmp_path, damage):
    template, only2 = campaign_template
    for i, victim in enumerate(only2):
        root = _copy(template, tmp_path / f"{i}")
        DAMAGE[damage](object_path(root, victim), object_path(root, only2[(i + 1) % len(only2)]))
        manifest = stepvault.open(root).manifest("r", 2)
        users = [
            n for n in CAMPAIGN_NAMES if any(c[0] == victim for c in manifest.tensors[n].chunks)
        ]
        assert users
        for mmap in (True, False):
            ckpt = stepvault.open(root).checkpoint("r", 2)
            with pytest.raises(stepvault.errors.IntegrityError):
                ckpt.load(mmap=mmap)
        # One tensor at a time (a fresh reader each, so nothing was verified before): a
        # tensor whose bytes lie in damaged segments is refused. The damage of a whole
        # object (truncated, deleted, swapped) refuses every tensor in it.
        refused = 0
        for name in users:
            ckpt = stepvault.open(root).checkpoint("r", 2)
            try:
                got = ckpt.tensor(name, mmap=True)
            except stepvault.errors.IntegrityError:
                refused += 1
            else:  # read without error: then it is exactly what was saved
                assert torch.equal(got, _campaign_state(2)[name])
        assert refused >= 1
        if damage in ("truncated", "deleted", "swapped"):
            assert refused == len(users)


def test_a_partial_read_verifies_only_the_segments_it_reads(campaign_template, tmp_path):
    """Damage in the bundle's first segment: the tensor there is refused, one in a later
    segment of the same object reads (its own segments verify), a whole load refuses."""
    template, _ = campaign_template
    root = _copy(template, tmp_path)
    manifest = stepvault.open(root).manifest("r", 2)
    bundle, first_off, _ = manifest.tensors["p0"].chunks[0]
    last_digest, last_off, _ = manifest.tensors["p5"].chunks[0]
    assert last_digest == bundle and first_off < (1 << 20) <= last_off  # other segments
    path = object_path(root, bundle)
    _flip_at(path, _payload_offset(path) + first_off + 100)
    ckpt = stepvault.open(root).checkpoint("r", 2)
    assert torch.equal(ckpt.tensor("p5", mmap=True), _campaign_state(2)["p5"])
    with pytest.raises(stepvault.errors.CorruptObjectError, match="checksum of segment 0 differs"):
        ckpt.tensor("p0", mmap=True)
    with pytest.raises(stepvault.errors.CorruptObjectError):
        stepvault.open(root).checkpoint("r", 2).load()


@pytest.mark.slow
def test_campaign_on_the_s3_tier_finds_every_damage(s3, bucket, monkeypatch):
    """The same damage kinds in objects on a real S3 server (moto on loopback): restore
    falls back, an explicit step changes nothing, a one-tensor read refuses."""
    from stepvault.store import Store

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    for damage in ("first_byte", "last_byte", "sums_digit", "truncated", "deleted", "swapped"):
        url = f"s3://{bucket}/{damage}"
        for step in (1, 2):
            stepvault.save(url, _campaign_state(step), run="r", step=step)
        only2 = sorted(_objects(url, "r", 2) - _objects(url, "r", 1))
        store = Store.open(url)
        key, other = Store.object_key(only2[0]), Store.object_key(only2[1])
        local = Path(os.environ.get("TMPDIR", "/tmp")) / f"sv-s3-{os.getpid()}-{damage}"
        local.write_bytes(store.backend.read_bytes(key))
        other_local = local.with_suffix(".other")
        other_local.write_bytes(store.backend.read_bytes(other))
        DAMAGE[damage](str(local), str(other_local))
        if damage == "deleted":
            store.backend.delete(key)
        else:
            store.backend.put_atomic(key, [local.read_bytes()], overwrite=True)
            local.unlink()
        other_local.unlink()
        live = _zeros()
        with pytest.raises(stepvault.errors.IntegrityError):
            stepvault.restore(url, live, run="r", step=2)
        assert live["step"] == 0 and all(float(live[k].abs().sum()) == 0 for k in CAMPAIGN_NAMES)
        live = _zeros()
        info = stepvault.restore(url, live, run="r")
        assert info.step == 1 and _same_as(live, 1), damage


FIXTURE_V1 = Path(__file__).parent / "data" / "store_v1"


def _fixture_state(step: int) -> dict:
    """What tests/data/store_v1 holds (written by stepvault before segment checksums, with
    chunk_size 8 KiB: 'big' spans three objects; step 2 with codec 'auto')."""
    g = torch.Generator().manual_seed(step)
    return {
        "big": torch.randn(6000, generator=g),
        "small": torch.arange(100, dtype=torch.float16) * step,
        "ids": torch.arange(300, dtype=torch.int64) + step,
        "step": step,
    }


@pytest.mark.parametrize("verify", ["fast", "full"])
def test_a_store_written_before_segment_checksums_restores_bitwise(tmp_path, verify):
    import shutil

    root = tmp_path / "v1"
    shutil.copytree(FIXTURE_V1, root)
    assert not any(
        b'"sums"' in p.read_bytes()[:4096] for p in (root / "objects").rglob("*") if p.is_file()
    )
    for step in (1, 2):
        live = {
            k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0)
            for k, v in _fixture_state(step).items()
        }
        info = stepvault.restore(root, live, run="r", step=step, verify=verify)
        want = _fixture_state(step)
        assert info.step == step and live["step"] == step
        for k in ("big", "small", "ids"):
            assert live[k].dtype == want[k].dtype
            assert torch.equal(live[k].view(torch.uint8), want[k].view(torch.uint8))
        one = stepvault.open(root).checkpoint("r", step).tensor("small", mmap=True)
        assert torch.equal(one, want["small"])
    # Damage in an old object (no checksums): found by BLAKE3 on the fast path too.
    victim = sorted(_objects(root, "r", 2) - _objects(root, "r", 1))[0]
    flip_byte(object_path(root, victim))
    live = {
        k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0)
        for k, v in _fixture_state(2).items()
    }
    info = stepvault.restore(root, live, run="r", verify=verify)
    assert info.step == 1 and [s.step for s in info.skipped] == [2]


def test_verify_mode_is_checked_and_signed_checkpoints_read_with_blake3(tmp_path):
    from stepvault.core.opened import open_checkpoint
    from stepvault.store import Store

    stepvault.save(tmp_path, _campaign_state(1), run="r", step=1)
    with pytest.raises(ValueError, match=r"'fast'.*'full'"):
        stepvault.restore(tmp_path, _zeros(), run="r", verify="quick")
    store = Store.open(tmp_path)
    assert open_checkpoint(store, "r", 1).reader.verify == "fast"
    # A signature record makes every read of that checkpoint a BLAKE3 one.
    store.backend.put_atomic(Store.signature_key("r", 1), [b"{}"], overwrite=True)
    assert open_checkpoint(store, "r", 1).reader.verify == "full"


def test_a_forged_object_with_matching_checksums_is_refused_when_signed(tmp_path):
    """XXH3 is not collision resistant: someone who can write to the store can change an
    object's bytes and recompute its segment checksums. A signed checkpoint is therefore
    read with BLAKE3 on every path (restore, load, one tensor), which refuses it."""
    import shutil

    from stepvault.format.hashing import segment_sums
    from stepvault.format.objects import parse_header
    from stepvault.store import Store

    root, signed = tmp_path / "a", tmp_path / "b"
    stepvault.save(root, _campaign_state(1), run="r", step=1)
    digest = stepvault.open(root).manifest("r", 1).tensors["big"].chunks[0][0]
    path = Path(object_path(root, digest))
    data = bytearray(path.read_bytes())
    head = parse_header(bytes(data))
    assert head.sums is not None
    data[head.payload_offset + 10] ^= 0xFF  # the forgery
    forged = segment_sums(memoryview(bytes(data[head.payload_offset :])))
    path.write_bytes(bytes(data).replace(head.sums.hex.encode(), forged.encode(), 1))
    shutil.copytree(root, signed)
    # Unsigned, the fast read cannot tell (the known limit of a non-cryptographic checksum:
    # why BLAKE3 stays the name and `verify="full"` exists); BLAKE3 can.
    live = _zeros()
    stepvault.restore(root, live, run="r", step=1)
    assert not torch.equal(live["big"], _campaign_state(1)["big"])
    with pytest.raises(stepvault.errors.IntegrityError, match="does not match its hash"):
        stepvault.restore(root, _zeros(), run="r", step=1, verify="full")
    # Signed: every path reads with BLAKE3 and refuses the forged object (a copy of the
    # store: the restore above quarantined the object in its own).
    store = Store.open(signed)
    store.backend.put_atomic(Store.signature_key("r", 1), [b'{"alg": "ed25519"}'], overwrite=True)
    live = _zeros()
    hashed = r"does not match its hash \(bit rot"  # BLAKE3's refusal (not the sums, not missing)
    with pytest.raises(stepvault.errors.IntegrityError, match=hashed):
        stepvault.open(signed).checkpoint("r", 1).tensor("big", mmap=True)
    with pytest.raises(stepvault.errors.IntegrityError, match=hashed):
        stepvault.open(signed).checkpoint("r", 1).load()
    with pytest.raises(stepvault.errors.IntegrityError, match=hashed):
        stepvault.restore(signed, live, run="r", step=1)
    assert all(float(live[k].abs().sum()) == 0 for k in CAMPAIGN_NAMES)
