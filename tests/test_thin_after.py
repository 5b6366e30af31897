"""ThinAfter: old kept checkpoints lose their training-only state and keep their weights.

Plans by steps and by days (time injected), restores of a thinned checkpoint (weights
bitwise, full training state refused with the way out), export read by safetensors, the
protections (newest full, pin, registry, reader hold, signature), annotations and later
attachments carried over, the manager applying it, and a SIGKILL in the middle of a thin.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest
import torch
from typer.testing import CliRunner

import stepvault
from stepvault import CheckpointManager, Every, KeepEvery, KeepLast, ThinAfter
from stepvault.catalog import apply_retention, checkpoint_records
from stepvault.catalog.attachments import attach_after, checkpoint_attachments
from stepvault.cli.main import app
from stepvault.errors import StateMismatchError
from stepvault.format import parse_manifest
from stepvault.manager.options import GCOptions, ManagerOptions
from stepvault.store import Store


def trained(width: int = 256, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 4))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


def train_step(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    m(torch.randn(8, m[0].in_features)).pow(2).mean().backward()
    opt.step()


def weights(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def save_run(root, steps, width: int = 256) -> dict[int, dict[str, torch.Tensor]]:
    """Full checkpoints of a real AdamW run at ``steps``; the weights saved at each."""
    m, opt = trained(width)
    saved = {}
    for step in steps:
        train_step(m, opt)
        state = {"model": m, "optimizer": opt, "rng": stepvault.RNGState(), "step": step}
        stepvault.save(root, state, run="r", step=step)
        saved[step] = weights(m)
    return saved


def kinds(store: Store) -> dict[int, str]:
    return {r.step: r.kind for r in checkpoint_records(store, "r")}


def test_thin_after_steps_plans_then_thins_and_restores_weights_bitwise(tmp_path):
    # 512 wide: each weight and moment is 1 MiB, an object of its own (smaller tensors
    # share bundles, and a bundle that holds a weight stays).
    saved = save_run(tmp_path, [100, 200, 300], width=512)
    store = Store.open(tmp_path)
    keep = KeepLast(1) | KeepEvery(steps=200) | ThinAfter(steps=100)
    dry = apply_retention(store, "r", keep, checkpoint_records(store, "r"), dry_run=True)
    text = str(dry.plan)
    assert "thin @200: drop optimizer, rng, step (" in text and "B; ThinAfter(steps=100))" in text
    assert "@300" not in text  # the newest: never thinned
    assert dry.plan.delete == [100] and kinds(store)[200] == "full"  # dry: nothing changed

    before = store.read_manifest("r", 200)
    result = apply_retention(
        store, "r", keep, checkpoint_records(store, "r"), grace_seconds=0, now=time.time()
    )
    assert result.thinned == [200] and result.deleted == [100]
    assert kinds(store) == {200: "weights", 300: "full"}
    # The optimizer moments of the 512-wide layer (2 x 1 MiB) are gone from the store.
    (entry,) = result.plan.thin
    assert entry.dropped_bytes >= 2 << 20 and result.sweep is not None
    assert result.sweep.freed_bytes > entry.dropped_bytes  # plus the deleted 100
    thin = parse_manifest(store.read_manifest("r", 200))
    assert thin.stats["thinned"]["from_kind"] == "full"
    assert thin.stats["thinned"]["dropped"] == ["optimizer", "rng", "step"]
    assert all(name.startswith("model/") for name in thin.tensors)
    assert store.read_manifest("r", 200) != before
    assert stepvault.ops.verify(tmp_path).ok

    m, opt = trained(512, seed=5)
    info = stepvault.restore(tmp_path, {"model": m}, run="r", step=200)
    assert info.kind == "weights"
    assert all(torch.equal(saved[200][k], v) for k, v in m.state_dict().items())

    full = {"model": m, "optimizer": opt, "rng": stepvault.RNGState(), "step": 0}
    with pytest.raises(StateMismatchError) as err:
        stepvault.restore(tmp_path, full, run="r", step=200)
    message = str(err.value)
    assert "r@200 is a weights-only checkpoint" in message
    assert "thinned by ThinAfter(steps=100)" in message and "optimizer" in message
    assert "restore its modules alone" in message and "step='latest'" in message
    assert stepvault.restore(tmp_path, full, run="r").step == 300  # resume is untouched

    shown = CliRunner().invoke(app, ["show", "r@200", "--root", str(tmp_path)])
    assert shown.exit_code == 0 and "kind=weights" in shown.output
    events = [e["event"] for e in stepvault.catalog.events.read_events(store, "r")]
    assert "thin" in events


def test_thin_after_days_uses_the_injected_clock(tmp_path):
    save_run(tmp_path, [1, 2, 3], width=32)
    store = Store.open(tmp_path)
    keep = KeepLast(3) | ThinAfter(days=7)
    now = time.time()
    six = apply_retention(store, "r", keep, checkpoint_records(store, "r"), now=now + 6 * 86400)
    assert six.thinned == [] and six.plan.thin == []
    eight = apply_retention(store, "r", keep, checkpoint_records(store, "r"), now=now + 8 * 86400)
    assert eight.thinned == [1, 2]  # the newest full one is never thinned
    assert kinds(store) == {1: "weights", 2: "weights", 3: "full"}
    again = apply_retention(store, "r", keep, checkpoint_records(store, "r"), now=now + 9 * 86400)
    assert again.thinned == [] and kinds(store)[1] == "weights"  # thinned once


def test_thin_alone_is_refused_before_anything_is_deleted(tmp_path):
    save_run(tmp_path, [1, 2, 3], width=16)
    store = Store.open(tmp_path)
    with pytest.raises(ValueError, match="keeps nothing on its own"):
        apply_retention(store, "r", ThinAfter(days=7), checkpoint_records(store, "r"))
    assert store.list_steps("r") == [1, 2, 3]
    with pytest.raises(ValueError, match="exactly one of days= or steps="):
        ThinAfter()
    assert ThinAfter(days=7) == ThinAfter(days=7) and repr(ThinAfter(steps=10)) == (
        "ThinAfter(steps=10)"
    )
    assert repr(KeepLast(2) | ThinAfter(days=7)) == "KeepLast(2) | ThinAfter(days=7)"


def test_pinned_registry_reader_held_and_signed_checkpoints_stay_whole(tmp_path):
    save_run(tmp_path, [1, 2, 3, 4], width=16)
    store = Store.open(tmp_path)
    store.pin("r", 1)
    store.hold("r", 2, "model-a")  # a registry hold
    signer = stepvault.signing.Signer.from_spec("hmac:" + "ab" * 32)
    m, opt = trained(16)
    signed = Store.open(tmp_path)
    signed.signer = signer
    stepvault.save(signed, {"model": m, "optimizer": opt}, run="r", step=5)
    stepvault.save(tmp_path, {"model": m, "optimizer": opt}, run="r", step=6)
    keep = KeepLast(10) | ThinAfter(steps=1)
    with stepvault.ops.hold(tmp_path, "r@3", ttl=60, owner="eval"):
        result = apply_retention(store, "r", keep, checkpoint_records(store, "r"))
    assert result.thinned == [4]
    why = {t.step: t.reason for t in result.plan.thin if not t.thin}
    assert "pinned" in why[1] and "registry" in why[2]
    assert "held by reader eval" in why[3]
    assert "signed: thinning would break its signature" in why[5]
    assert 6 not in why  # newest full: not even due
    assert "keep whole @5: signed" in str(result.plan)
    assert kinds(store) == {1: "full", 2: "full", 3: "full", 4: "weights", 5: "full", 6: "full"}


def test_thinning_keeps_annotated_metrics_and_later_attachments(tmp_path):
    save_run(tmp_path, [1, 2], width=16)
    store = Store.open(tmp_path)
    stepvault.ops.annotate(tmp_path, "r", 1, {"val_loss": 0.25})
    attach_after(store, "r", 1, {"config.json": b'{"hidden": 16}'})
    keep = KeepLast(2) | ThinAfter(steps=1)
    assert apply_retention(store, "r", keep, checkpoint_records(store, "r")).thinned == [1]
    record = checkpoint_records(store, "r")[0]
    assert record.kind == "weights" and record.metrics["val_loss"] == 0.25
    files = checkpoint_attachments(store, "r", 1)
    assert files["config.json"].read() == b'{"hidden": 16}'


def test_export_of_a_thinned_checkpoint_loads_with_safe_open(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    saved = save_run(tmp_path / "s", [1, 2], width=64)
    store = Store.open(tmp_path / "s")
    apply_retention(store, "r", KeepLast(2) | ThinAfter(steps=1), checkpoint_records(store, "r"))
    assert kinds(store)[1] == "weights"
    out = tmp_path / "w.safetensors"
    stepvault.ops.export_weights(store, "r", 1, out)
    with safetensors.safe_open(str(out), "pt") as f:
        loaded = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open API)
    assert loaded.keys() == saved[1].keys()
    assert all(torch.equal(loaded[k], saved[1][k]) for k in loaded)


def test_the_manager_thins_as_it_saves(tmp_path):
    m, opt = trained(32)
    keep = KeepLast(2) | KeepEvery(steps=4) | ThinAfter(steps=4)
    with CheckpointManager(
        tmp_path,
        "r",
        save=Every(steps=2),
        keep=keep,
        options=ManagerOptions(gc=GCOptions(grace_seconds=0)),
    ) as mgr:
        for step in range(1, 13):
            train_step(m, opt)
            mgr.save(step, {"model": m, "optimizer": opt})
        mgr.wait()
        listed = {c.step: c.kind for c in mgr.checkpoints()}
    # 10 and 12: last two; 4 and 8: every 4 and older than 4 steps, so weights only.
    assert listed == {4: "weights", 8: "weights", 10: "full", 12: "full"}
    m2, opt2 = trained(32, seed=3)
    assert stepvault.restore(tmp_path, {"model": m2, "optimizer": opt2}, run="r").step == 12


def test_gc_cli_dry_run_shows_the_thinning(tmp_path):
    save_run(tmp_path, [1, 2, 3], width=128)
    args = ["gc", "r", "--root", str(tmp_path), "--keep-last", "3", "--thin-after-steps", "1"]
    dry = CliRunner().invoke(app, [*args, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "thin @1: drop optimizer, rng, step" in dry.output and "KiB" in dry.output
    assert kinds(Store.open(tmp_path))[1] == "full"
    as_json = CliRunner().invoke(app, [*args, "--json"])
    assert as_json.exit_code == 0, as_json.output
    thin = json.loads(as_json.output)["thin"]
    assert [(t["step"], t["thin"]) for t in thin] == [(1, True), (2, True)]
    assert kinds(Store.open(tmp_path)) == {1: "weights", 2: "weights", 3: "full"}


CRASH_CHILD = """
import sys, time
from stepvault import KeepLast, ThinAfter
from stepvault.catalog import apply_retention, checkpoint_records
from stepvault.store import Store
store = Store.open(sys.argv[1])
records = checkpoint_records(store, "r")
print("go", flush=True)
apply_retention(store, "r", KeepLast(100) | ThinAfter(steps=1), records, grace_seconds=0)
print("done", flush=True)
time.sleep(30)
"""


@pytest.mark.slow  # a subprocess (imports torch): ~5 s
def test_a_kill_during_thinning_leaves_old_or_new_manifests(tmp_path):
    steps = list(range(1, 13))
    saved = save_run(tmp_path, steps, width=32)
    child = subprocess.Popen(
        [sys.executable, "-c", CRASH_CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "go"
    time.sleep(random.uniform(0.0, 0.15))  # thinning all 11 takes ~0.2 s
    child.kill()
    child.wait()
    store = Store.open(tmp_path)
    found = kinds(store)
    assert sorted(found) == steps and set(found.values()) <= {"full", "weights"}
    assert found[12] == "full"
    assert stepvault.ops.verify(tmp_path, deep=True).ok  # every manifest complete
    for step in (1, 6, 11):
        m, _ = trained(32, seed=9)
        stepvault.restore(tmp_path, {"model": m}, run="r", step=step, strict=False)
        assert all(torch.equal(saved[step][k], v) for k, v in m.state_dict().items())
    # A second pass finishes the job.
    result = apply_retention(
        store, "r", KeepLast(100) | ThinAfter(steps=1), checkpoint_records(store, "r")
    )
    assert set(kinds(store).values()) == {"full", "weights"} and kinds(store)[11] == "weights"
    assert result.thinned == [s for s in steps[:-1] if found[s] == "full"]


def test_the_base_of_a_kept_light_checkpoint_is_never_thinned(tmp_path):
    # Light checkpoints take their base's optimizer moments by default: a thinned base
    # would leave them unable to resume, so the plan keeps it whole and says why.
    m, opt = trained(512)
    for step, kind in ((100, "full"), (110, "light"), (120, "light"), (200, "full"), (300, "full")):
        train_step(m, opt)
        state = {"model": m, "optimizer": opt, "step": step}
        stepvault.save(tmp_path, state, run="r", step=step, kind=kind)
    store = Store.open(tmp_path)
    assert {r.step: r.base_step for r in checkpoint_records(store, "r")}[120] == 100
    keep = KeepLast(5) | ThinAfter(steps=50)
    result = apply_retention(
        store, "r", keep, checkpoint_records(store, "r"), grace_seconds=0, now=time.time()
    )
    assert result.thinned == [200]  # 100 is due too, but it is the base of kept light ones
    assert "keep whole @100: base of light @110" in str(result.plan)
    assert kinds(store) == {100: "full", 110: "light", 120: "light", 200: "weights", 300: "full"}
    m2, opt2 = trained(512, seed=1)
    live = {"model": m2, "optimizer": opt2, "step": 0}
    info = stepvault.restore(tmp_path, live, run="r", step=120)
    assert info.lossy and info.base_step == 100
