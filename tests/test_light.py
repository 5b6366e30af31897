"""Light checkpoints (issue 17 A): quantised deltas against the newest full checkpoint."""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers import flip_byte, object_path
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import stepvault
from stepvault import CheckpointManager, Every, KeepLast, KeepWithin, LightOptions
from stepvault.catalog.events import read_events
from stepvault.cli.main import app
from stepvault.engine.light_delta import (
    DeltaError,
    decode_light_delta,
    encode_light_delta,
    light_delta_size,
)
from stepvault.format.record import CheckpointRecord
from stepvault.manager.options import ManagerOptions
from stepvault.policy import plan_retention

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


# ------------------------------------------------------------------------------ codec


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [1, 255, 256, 257, 5000])
def test_round_trip_error_is_the_recorded_one(dtype, bits, n):
    g = torch.Generator().manual_seed(n + bits)
    base = torch.randn(n, generator=g).to(dtype)
    new = (base.double() + 0.01 * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype)
    payload, err = encode_light_delta(base, new, bits=bits, block=256)
    assert len(payload) == light_delta_size(n, bits=bits, block=256)
    back = decode_light_delta(base, payload, bits=bits, block=256)
    assert back.dtype == dtype and back.shape == new.shape
    measured = DeltaError.between(back, new)
    assert measured == err  # the recorded error is exactly the error a restore gets
    # and it is bounded by half a quantisation step of the largest block delta (+ rounding
    # to the dtype): the delta really is encoded, not passed through
    step = float((new.double() - base.double()).abs().max()) / (127 if bits == 8 else 7)
    ulp = float(torch.finfo(dtype).eps) * float(new.double().abs().max())
    assert err.max_abs <= step / 2 + ulp + 1e-12


def test_zeros_and_unchanged_tensors_are_exact():
    z = torch.zeros(1000)
    payload, err = encode_light_delta(z, z)
    assert err.max_abs == 0 and err.max_rel == 0
    assert torch.equal(decode_light_delta(z, payload), z)
    w = torch.randn(300)
    assert torch.equal(decode_light_delta(w, encode_light_delta(w, w.clone())[0]), w)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_values_are_refused_clearly(bad):
    base, new = torch.zeros(10), torch.zeros(10)
    new[3] = bad
    with pytest.raises(ValueError, match=r"inf or nan.*store the tensor exactly"):
        encode_light_delta(base, new)
    with pytest.raises(ValueError, match="inf or nan"):
        encode_light_delta(new, base)  # in the base as well


def test_mismatched_or_integer_tensors_are_refused():
    with pytest.raises(ValueError, match="not a float dtype"):
        encode_light_delta(torch.arange(4), torch.arange(4))
    with pytest.raises(ValueError, match="base is"):
        encode_light_delta(torch.zeros(4), torch.zeros(5))
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        encode_light_delta(torch.zeros(4), torch.zeros(4), bits=2)
    with pytest.raises(ValueError, match="payload is 3 bytes"):
        decode_light_delta(torch.zeros(4), b"abc")


# -------------------------------------------------------------------- save / restore


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("h16", torch.zeros(2048, dtype=torch.bfloat16))


def _train(model, opt, steps=1):
    for _ in range(steps):
        loss = model.norm(model.a(torch.randn(8, 64))).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.count += 1
        model.h16 += 0.01


def _state(model, opt, step):
    return {"model": model, "opt": opt, "step": step, "ids": torch.arange(5) * step}


def _fresh():
    torch.manual_seed(123)
    m = Tiny()
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def test_first_light_save_is_full_and_says_so(tmp_path):
    m, o = _fresh()
    _train(m, o)
    info = stepvault.save(tmp_path, _state(m, o, 1), run="r", step=1, kind="light")
    assert info.kind == "full"
    store = stepvault.open(tmp_path)
    assert store.manifest("r", 1).kind == "full"
    events = [e for e in read_events(store.store, "r") if e["event"] == "light_as_full"]
    assert events and events[0]["step"] == 1


def test_light_restore_is_base_plus_delta_within_recorded_error(tmp_path):
    torch.manual_seed(0)
    m, o = _fresh()
    _train(m, o)
    stepvault.save(tmp_path, _state(m, o, 1), run="r", step=1)
    _train(m, o, 3)
    exact = {k: v.clone() for k, v in m.state_dict().items()}
    info = stepvault.save(
        tmp_path, _state(m, o, 4), run="r", step=4, kind="light",
        light=LightOptions(optimizer="delta", min_elements=1000),
    )  # fmt: skip
    assert info.kind == "light"
    man = stepvault.open(tmp_path).manifest("r", 4)
    assert man.light["base_step"] == 1
    entries = man.light["tensors"]
    assert {"model/a.weight", "model/h16", "opt/state/0/exp_avg"} <= set(entries)
    assert "model/count" not in entries and "opt/state/0/step" not in entries  # exact

    m2, o2 = _fresh()
    got = stepvault.restore(tmp_path, _state(m2, o2, 0), run="r", step=4)
    assert got.step == 4 and got.lossy and got.base_step == 1
    restored = m2.state_dict()
    errors = []
    for name, e in entries.items():
        if not name.startswith("model/"):
            continue
        key = name.removeprefix("model/")
        err = (restored[key].double() - exact[key].double()).abs().max().item()
        assert err == pytest.approx(e["error"]["max_abs"], abs=0)
        errors.append(err)
    assert max(errors) > 0  # really lossy deltas, not copies
    assert int(restored["count"]) == 4  # ints exact
    assert float(o2.state_dict()["state"][0]["step"]) == 4.0  # Adam's step exact
    # exact save for comparison: a light one stores much less
    full = stepvault.save(tmp_path, _state(m, o, 4), run="r", step=5)
    assert info.new_bytes < 0.5 * full.new_bytes


def test_inf_tensor_is_stored_exactly_and_named(tmp_path):
    state = {"w": torch.randn(4096)}
    stepvault.save(tmp_path, state, run="r", step=1)
    state["w"][7] = float("inf")
    state["w"][8] += 1
    stepvault.save(tmp_path, state, run="r", step=2, kind="light")
    man = stepvault.open(tmp_path).manifest("r", 2)
    assert "inf or nan" in man.light["exact"]["w"]
    live = {"w": torch.zeros(4096)}
    stepvault.restore(tmp_path, live, run="r", step=2)
    assert torch.equal(live["w"], state["w"])


def _run_with_light(root):
    """full@1, full@2, light@3 (base 2), light@4 (base 2)."""
    m, o = _fresh()
    for step, kind in [(1, "full"), (2, "full"), (3, "light"), (4, "light")]:
        _train(m, o)
        stepvault.save(root, _state(m, o, step), run="r", step=step, kind=kind)
    return m, o


def test_latest_uses_light_only_when_told_and_never_past_a_newer_full(tmp_path):
    _run_with_light(tmp_path)
    m2, o2 = _fresh()
    assert stepvault.restore(tmp_path, _state(m2, o2, 0), run="r").step == 2
    info = stepvault.restore(tmp_path, _state(m2, o2, 0), run="r", resume_from_light=True)
    assert (info.step, info.lossy, info.base_step) == (4, True, 2)
    m, o = _fresh()
    stepvault.save(tmp_path, _state(m, o, 5), run="r", step=5)  # a newer full one
    info = stepvault.restore(tmp_path, _state(m2, o2, 0), run="r", resume_from_light=True)
    assert (info.step, info.lossy) == (5, False)
    # a modules-only state ("latest" takes weights-only ones) passes over light ones too
    (tmp_path / "runs" / "r" / "checkpoints" / "5.json").unlink()
    assert stepvault.restore(tmp_path, {"model": m2}, run="r", strict=False).step == 2


def test_damaged_or_missing_base_is_reported_and_skipped(tmp_path):
    _run_with_light(tmp_path)
    vault = stepvault.open(tmp_path)
    only2 = set(vault.manifest("r", 2).objects) - set(vault.manifest("r", 1).objects)
    only2 -= set(vault.manifest("r", 4).objects)  # damage what only the base holds
    assert only2
    for digest in only2:
        flip_byte(object_path(tmp_path, digest))
    m2, o2 = _fresh()
    info = stepvault.restore(tmp_path, _state(m2, o2, 0), run="r", resume_from_light=True)
    assert info.step == 1 and not info.lossy
    reasons = {s.step: s.reason for s in info.skipped}
    assert "base r@2 of light checkpoint r@4 is damaged" in reasons[4]
    assert set(reasons) == {4, 3, 2}  # both light ones are newer than their (damaged) base
    with pytest.raises(stepvault.errors.IntegrityError, match="base r@2"):
        stepvault.restore(tmp_path, _state(m2, o2, 0), run="r", step=4)


def test_base_gone_is_reported_and_skipped(tmp_path):
    _run_with_light(tmp_path)
    (tmp_path / "runs" / "r" / "checkpoints" / "2.json").unlink()
    m2, o2 = _fresh()
    info = stepvault.restore(tmp_path, _state(m2, o2, 0), run="r", resume_from_light=True)
    assert info.step == 1
    assert "cannot be read" in {s.step: s.reason for s in info.skipped}[4]


def test_light_manifest_is_version_2_and_exact_ones_stay_version_1(tmp_path):
    _run_with_light(tmp_path)
    for step, version in [(2, 1), (4, 2)]:
        head = (tmp_path / "runs" / "r" / "checkpoints" / f"{step}.json").read_bytes()
        assert json.loads(head.split(b"\n", 1)[0])["version"] == version


def test_exact_checkpoints_are_bitwise_unaffected(tmp_path):
    """Same training, with and without light saves in between: the full checkpoints name
    the same objects with the same bytes and the same tables."""
    tables = []
    for root, light in [(tmp_path / "a", False), (tmp_path / "b", True)]:
        m, o = _fresh()
        torch.manual_seed(7)
        for step in range(1, 8):
            _train(m, o)
            if step % 3 == 1:
                stepvault.save(root, _state(m, o, step), run="r", step=step)
            elif light:
                stepvault.save(root, _state(m, o, step), run="r", step=step, kind="light")
        vault = stepvault.open(root)
        out = {}
        for step in (1, 4, 7):
            man = vault.manifest("r", step).to_json()
            blobs = {d: (root / "objects" / d[:2] / d).read_bytes() for d in man["objects"]}
            for key in ("created", "environment", "stats", "parent_step"):
                man.pop(key)
            out[step] = (man, blobs)
        tables.append(out)
    assert tables[0] == tables[1]


# ---------------------------------------------------------------------- manager


def test_manager_light_policy_keep_rules_and_resume(tmp_path):
    m, o = _fresh()
    keep = KeepLast(1, kind="full") | KeepLast(2, kind="light")
    save = Every(steps=2, what="light") | Every(steps=6)
    with CheckpointManager(tmp_path, "r", save=save, keep=keep, async_save=True) as mgr:
        for step in range(1, 12):
            _train(m, o)
            mgr.save(step, _state(m, o, step))
        mgr.wait()
        kinds = {r.step: (r.kind, r.base_step) for r in mgr.checkpoints()}
        plan = {e.step: e.reasons for e in mgr.retention_plan().entries if e.keep}
    # step 2 had no full base yet: saved full; 4 is light on 2; 6 full; 8, 10 light on 6
    assert kinds == {6: ("full", None), 8: ("light", 6), 10: ("light", 6)}
    assert any(r.startswith("base of light @10") for r in plan[6])

    m2, o2 = _fresh()
    with CheckpointManager(tmp_path, "r") as mgr:
        assert mgr.restore(_state(m2, o2, 0)).step == 6
    with CheckpointManager(tmp_path, "r", options=ManagerOptions(resume_from_light=True)) as mgr:
        info = mgr.restore(_state(m2, o2, 0))
        assert (info.step, info.lossy, info.base_step) == (10, True, 6)
        event = [e for e in mgr.events() if e["event"] == "restore"][-1]
        assert event["lossy"] is True and event["base_step"] == 6
    assert int(m2.count) == 10


def test_base_of_a_kept_light_survives_keep_last_full(tmp_path):
    m, o = _fresh()
    # a full save every 4 steps, light ones between; keep only the newest full, and light
    # checkpoints of the last 3: the older full bases stay while a kept light needs them
    keep = KeepLast(1, kind="full") | KeepLast(3, kind="light")
    with CheckpointManager(
        tmp_path, "r", save=Every(steps=1, what="light") | Every(steps=4), keep=keep,
        async_save=False,
    ) as mgr:  # fmt: skip
        for step in range(1, 10):
            _train(m, o)
            mgr.save(step, _state(m, o, step))
        records = {r.step: r for r in mgr.checkpoints()}
    # full: 1 (first), 4, 8; light 9 on 8; 7, 6 on 4 -> 4 kept as their base
    assert set(records) == {4, 6, 7, 8, 9}
    m2, o2 = _fresh()
    assert stepvault.restore(tmp_path, _state(m2, o2, 0), run="r", step=6).base_step == 4


# ------------------------------------------------------------------- property: plans


@st.composite
def _records(draw):
    n = draw(st.integers(1, 25))
    records, last_full = [], None
    for step in range(n):
        kind = draw(st.sampled_from(["full", "light", "light", "weights"]))
        if kind == "light" and last_full is None:
            kind = "full"
        valid = draw(st.booleans()) or draw(st.booleans())
        rec = CheckpointRecord(
            step * 10,
            float(step),
            kind=kind,
            valid=valid,
            pinned=draw(st.integers(0, 9)) == 0,
            base_step=last_full if kind == "light" else None,
        )
        if kind == "full":
            last_full = step * 10
        records.append(rec)
    return records


_POLICIES = st.sampled_from(
    [
        KeepLast(1, kind="full") | KeepLast(3, kind="light"),
        KeepLast(2),
        KeepWithin(seconds=5, kind="light"),
        KeepWithin(seconds=3) | KeepLast(1, kind="light"),
        KeepLast(4, kind="light"),
    ]
)


@settings(max_examples=80, deadline=None)
@given(_records(), _POLICIES, st.floats(0, 30))
def test_plan_never_deletes_the_valid_base_of_a_kept_light(records, policy, now):
    plan = plan_retention(records, policy, now=now)
    kept = {e.step for e in plan.entries if e.keep}
    by_step = {r.step: r for r in records}
    for r in records:
        if r.kind == "light" and r.step in kept and by_step[r.base_step].valid:
            assert r.base_step in kept
            reasons = next(e.reasons for e in plan.entries if e.step == r.base_step)
            assert any(x.startswith("base of light @") for x in reasons)
    fulls = [r.step for r in records if r.valid and r.kind == "full"]
    if fulls:
        assert fulls[-1] in kept  # the newest *full* one, never a light one, is the anchor


def test_keep_within_kind_light_expires_light_ones_only():
    rs = [
        CheckpointRecord(0, 0.0, kind="full"),
        CheckpointRecord(10, 1.0, kind="light", base_step=0),
        CheckpointRecord(20, 9.0, kind="light", base_step=0),
        CheckpointRecord(30, 9.5, kind="full"),
    ]
    plan = plan_retention(rs, KeepWithin(seconds=2, kind="light"), now=10.0)
    assert [e.step for e in plan.entries if e.keep] == [0, 20, 30]
    assert repr(KeepWithin(days=7, kind="light")) == "KeepWithin(days=7, kind='light')"
    assert "base of light @20" in plan.entries[0].reasons


def test_random_manager_runs_keep_restorable_lights(tmp_path):
    """Plain randomized loop (seeded): every light checkpoint kept by the manager restores."""
    rng = random.Random(5)
    m, o = _fresh()
    keep = KeepLast(1, kind="full") | KeepLast(rng.randint(1, 3), kind="light")
    with CheckpointManager(tmp_path, "r", keep=keep, async_save=False) as mgr:
        for step in range(1, 15):
            _train(m, o)
            mgr.save(step, _state(m, o, step), force=True, kind=rng.choice(["full", "light"]))
        lights = [r.step for r in mgr.checkpoints() if r.kind == "light"]
    for step in lights:
        m2, o2 = _fresh()
        assert stepvault.restore(tmp_path, _state(m2, o2, 0), run="r", step=step).lossy


# -------------------------------------------------------------------------- CLI


def test_show_and_ls_mark_light(tmp_path):
    _run_with_light(tmp_path)
    runner = CliRunner()
    shown = runner.invoke(app, ["--root", str(tmp_path), "show", "r@4"])
    assert shown.exit_code == 0, shown.output
    assert "light: delta against 2" in shown.output and "max_rel=" in shown.output
    doc = json.loads(runner.invoke(app, ["--root", str(tmp_path), "show", "r@4", "--json"]).output)
    assert doc["light"]["base_step"] == 2
    assert "max_abs" in next(iter(doc["light"]["tensors"].values()))["error"]
    listed = runner.invoke(app, ["--root", str(tmp_path), "ls", "r"])
    assert "light@2" in listed.output


@pytest.mark.parametrize("async_save", [False, True])
def test_manager_handle_of_a_first_light_save_says_full(tmp_path, async_save):
    """The first light save has no base: it is written full, and the manager's handle,
    its result and the manifest all say so (the handle said "light" before)."""
    m, o = _fresh()
    _train(m, o)
    with CheckpointManager(tmp_path, "r", async_save=async_save) as mgr:
        first = mgr.save(1, _state(m, o, 1), force=True, kind="light")
        assert first is not None and first.kind == "full"
        assert first.result().kind == "full"
        _train(m, o)
        second = mgr.save(2, _state(m, o, 2), force=True, kind="light")
        assert second is not None and second.kind == "light" and second.result().kind == "light"
    store = stepvault.open(tmp_path)
    assert [store.manifest("r", s).kind for s in (1, 2)] == ["full", "light"]


def test_async_light_save_builds_its_deltas_from_the_staged_copy_off_the_training_thread(
    tmp_path, monkeypatch
):
    """An asynchronous light save stalls only for the memory copy: the deltas are encoded
    on the writer thread, from the copy taken when save() was called (the live weights
    are changed before the encoder runs, and the checkpoint does not see it)."""
    import threading

    import stepvault.core.light as core_light

    m, o = _fresh()
    _train(m, o)
    gate, threads = threading.Event(), []
    real = core_light.encode_light_delta

    def encode(held, new, **kw):
        threads.append(threading.current_thread())
        assert gate.wait(10)  # the training thread changes the weights first
        return real(held, new, **kw)

    with CheckpointManager(tmp_path, "r", async_save=True) as mgr:
        mgr.save(1, _state(m, o, 1), force=True).result()
        _train(m, o)
        mgr.prepare(_state(m, o, 2), wait=True)
        saved = {k: v.clone() for k, v in m.state_dict().items()}
        monkeypatch.setattr(core_light, "encode_light_delta", encode)
        handle = mgr.save(2, _state(m, o, 2), force=True, kind="light")
        assert handle is not None and handle.asynchronous
        with torch.no_grad():
            m.a.weight.add_(1000.0)  # training goes on while the save is written
        gate.set()
        assert handle.result().kind == "light" and handle.kind == "light"
    assert threads and threading.main_thread() not in threads
    m2, o2 = _fresh()
    with CheckpointManager(tmp_path, "r", options=ManagerOptions(resume_from_light=True)) as mgr:
        info = mgr.restore(_state(m2, o2, 0))
    assert info.step == 2 and info.lossy
    err = (m2.a.weight - saved["a.weight"]).abs().max().item()
    assert err < 0.05, err  # the staged values, not the +1000 ones
    assert torch.equal(m2.count, saved["count"])
