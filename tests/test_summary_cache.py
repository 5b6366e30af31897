"""Listing a run uses a summary cache keyed by manifest checksums; it never hides damage."""

from __future__ import annotations

import json

import torch

import stepvault
from stepvault.catalog.summaries import cache_key, log_key
from stepvault.format.hashing import content_hash


def _run(root, n=4):
    model = torch.nn.Linear(4, 3)
    for step in range(n):
        with torch.no_grad():
            model.bias[0] = step
        stepvault.save(
            root, {"model": model}, run="r", step=step, metrics={"loss": 1.0 / (step + 1)}
        )
    return model


def _fields(summaries):
    return [
        (
            s.step,
            s.epoch,
            s.created,
            s.kind,
            s.metrics,
            s.logical_bytes,
            s.stored_bytes,
            s.new_bytes,
            s.tensors,
            s.error,
        )
        for s in summaries
    ]


def test_second_listing_equals_the_first_and_uses_the_cache(tmp_path):
    _run(tmp_path)
    vault = stepvault.open(tmp_path)
    first = vault.checkpoints("r")
    cache = tmp_path / cache_key("r")
    assert cache.exists()
    assert _fields(stepvault.open(tmp_path).checkpoints("r")) == _fields(first)
    assert [s.metrics["loss"] for s in first] == [1.0, 0.5, 1 / 3, 0.25]
    # The second listing took its summaries from the cache (no manifest parsed): an entry
    # rewritten with a valid cache checksum is what it shows, for an intact manifest.
    head, body = cache.read_bytes().split(b"\n", 1)
    entries = json.loads(body)
    assert len(entries) == 4
    for entry in entries.values():
        entry[4] = {"loss": -1.0}
    body = json.dumps(entries).encode()
    env = json.loads(head)
    env["body_blake3"] = content_hash(body)
    cache.write_bytes(json.dumps(env).encode() + b"\n" + body)
    assert {s.metrics["loss"] for s in stepvault.open(tmp_path).checkpoints("r")} == {-1.0}


def test_a_manifest_damaged_after_caching_is_reported(tmp_path):
    _run(tmp_path)
    vault = stepvault.open(tmp_path)
    vault.checkpoints("r")
    path = tmp_path / "runs/r/checkpoints/2.json"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # one bit of the body
    path.write_bytes(bytes(data))
    listed = {s.step: s for s in vault.checkpoints("r")}
    assert listed[2].error and "checksum" in listed[2].error
    assert all(listed[s].error is None for s in (0, 1, 3))


def test_an_overwritten_checkpoint_shows_its_new_summary(tmp_path):
    model = _run(tmp_path)
    vault = stepvault.open(tmp_path)
    vault.checkpoints("r")
    stepvault.save(
        tmp_path, {"model": model}, run="r", step=1, metrics={"loss": 9.0}, overwrite=True
    )
    assert vault.checkpoints("r")[1].metrics == {"loss": 9.0}


def test_a_damaged_or_forged_cache_is_ignored_and_rebuilt(tmp_path):
    _run(tmp_path)
    vault = stepvault.open(tmp_path)
    good = _fields(vault.checkpoints("r"))
    cache = tmp_path / cache_key("r")
    cache.write_bytes(b"garbage\n{")
    assert _fields(vault.checkpoints("r")) == good
    # Entries edited without fixing the cache's own checksum: ignored as a whole.
    head, body = cache.read_bytes().split(b"\n", 1)
    entries = json.loads(body)
    for entry in entries.values():
        entry[4] = {"loss": -1.0}
    cache.write_bytes(head + b"\n" + json.dumps(entries).encode())
    assert _fields(vault.checkpoints("r")) == good


def test_deleted_checkpoints_leave_the_cache(tmp_path):
    _run(tmp_path)
    vault = stepvault.open(tmp_path)
    vault.checkpoints("r")
    vault.store.delete_manifest("r", 0)
    assert [s.step for s in vault.checkpoints("r")] == [1, 2, 3]
    _, body = (tmp_path / cache_key("r")).read_bytes().split(b"\n", 1)
    assert len(json.loads(body)) == 3


def test_the_writer_logs_summaries_so_the_first_listing_parses_nothing(tmp_path):
    _run(tmp_path)
    log = tmp_path / log_key("r")
    lines = log.read_bytes().splitlines()
    assert len(lines) == 4
    # Rewrite one record (with a valid record checksum): the first listing shows it, so it
    # came from the log, not from parsing the (intact, verified) manifest.
    checksum, payload = lines[2].split(b" ", 1)  # "<blake3 of payload> <payload>"
    assert content_hash(payload).encode() == checksum
    digest, entry = json.loads(payload)
    entry[4] = {"loss": -2.0}
    payload = json.dumps([digest, entry]).encode()
    lines[2] = content_hash(payload).encode() + b" " + payload
    lines[3] = lines[3][:-7] + b"garbage"  # a torn line is ignored (that step is parsed)
    changed = lines[1].replace(b"0.5", b"9.5")  # a changed line fails its checksum: parsed
    assert changed != lines[1]
    lines[1] = changed
    log.write_bytes(b"\n".join(lines) + b"\n")
    listed = stepvault.open(tmp_path).checkpoints("r")
    assert [s.metrics["loss"] for s in listed] == [1.0, 0.5, -2.0, 0.25]
    # The listing compacted the log into summaries.json and removed it.
    assert not log.exists() and (tmp_path / cache_key("r")).exists()
    assert [s.metrics["loss"] for s in stepvault.open(tmp_path).checkpoints("r")] == [
        1.0,
        0.5,
        -2.0,
        0.25,
    ]


def test_logged_summaries_equal_parsed_ones(tmp_path):
    _run(tmp_path)
    from_log = _fields(stepvault.open(tmp_path).checkpoints("r"))
    (tmp_path / cache_key("r")).unlink()
    assert _fields(stepvault.open(tmp_path).checkpoints("r")) == from_log


class _EvictingCache(dict):
    """A shared step -> record cache from which another thread pops each entry right after
    it is stored (the tier mover evicting a step while the writer lists the run)."""

    def __setitem__(self, step, rec):
        super().__setitem__(step, rec)
        self.pop(step)


def test_a_listing_survives_entries_dropped_from_a_shared_cache(tmp_path):
    # CI found this as a KeyError in retention's hold() while the tier mover evicted a step.
    from stepvault.catalog import checkpoint_records
    from stepvault.store import Store

    root = tmp_path / "store"
    _run(root, n=3)
    store = Store.open(root)
    cache = _EvictingCache()
    assert [r.step for r in checkpoint_records(store, "r", cache)] == [0, 1, 2]
    assert [r.step for r in checkpoint_records(store, "r", cache)] == [0, 1, 2]
