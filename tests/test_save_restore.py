"""Save and restore of full training state through the public API."""

from __future__ import annotations

import math
import random
import sys
import warnings

import numpy as np
import pytest
import torch
from training import Trainer, assert_same_training_state, make_model

import stepvault
from stepvault.catalog.events import read_events
from stepvault.store import Store


def test_exact_resume_is_bitwise_equal(tmp_path):
    """Train N steps straight vs. stop at k, restore into fresh objects, continue to N."""
    n, k = 30, 17  # k lands mid-epoch (12 batches per epoch)
    reference = Trainer()
    reference.train(n)

    first = Trainer()
    first.train(k)
    stepvault.save(tmp_path, first.state, run="r", step=k, epoch=first.data["epoch"])
    # Disturb every global RNG, as a fresh process would have different states.
    torch.manual_seed(999)
    np.random.seed(999)
    random.seed(999)

    resumed = Trainer(seed=5)  # different init: everything must come from the checkpoint
    state = resumed.state
    info = stepvault.restore(tmp_path, state, run="r")
    resumed.load_from(state)
    assert info.step == k and info.epoch == 1 and info.skipped == []
    assert resumed.step == k
    resumed.train(n)
    assert_same_training_state(reference, resumed)


def test_restore_roundtrips_values_arrays_and_rng(tmp_path):
    gen_np = np.random.default_rng(7)
    gen_torch = torch.Generator().manual_seed(3)
    rng = stepvault.RNGState(generators=[gen_np, gen_torch])
    big = 2**70 + 1
    values = {"a": (1, 2.5, -0.0, float("inf")), 3: b"\x00\xff", "$weird": [None, True, big]}
    arr = np.arange(12, dtype=np.float64).reshape(3, 4)
    tensor = torch.arange(6, dtype=torch.bfloat16)
    state = {"values": values, "arr": arr, "t": tensor, "rng": rng, "nan": float("nan")}
    stepvault.save(tmp_path, state, run="r", step=1, metadata={"note": "hi", "k": [1, 2]})
    expected = (
        random.random(),
        np.random.rand(),
        torch.rand(1),
        gen_np.random(),
        torch.rand(1, generator=gen_torch),
    )

    live_arr = np.zeros((3, 4))
    live_t = torch.zeros(6, dtype=torch.bfloat16)
    live = {"values": None, "arr": live_arr, "t": live_t, "rng": rng, "nan": 0.0}
    info = stepvault.restore(tmp_path, live, run="r", step=1)
    assert info.metadata == {"note": "hi", "k": [1, 2]}
    assert live["values"] == values
    assert math.copysign(1.0, live["values"]["a"][2]) == -1.0
    assert live["arr"] is live_arr and np.array_equal(live_arr, arr)  # restored in place
    assert live["t"] is live_t and torch.equal(live_t, tensor)
    assert math.isnan(live["nan"])
    got = (
        random.random(),
        np.random.rand(),
        torch.rand(1),
        gen_np.random(),
        torch.rand(1, generator=gen_torch),
    )
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])
    assert got[3] == expected[3] and torch.equal(got[4], expected[4])


def test_grad_scaler_and_custom_stateful(tmp_path):
    class Counter:
        def __init__(self):
            self.n = 0

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, sd):
            self.n = sd["n"]

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    c = Counter()
    c.n = 41
    stepvault.save(tmp_path, {"scaler": scaler, "counter": c}, run="r", step=0)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0)
    c2 = Counter()
    stepvault.restore(tmp_path, {"scaler": scaler2, "counter": c2}, run="r")
    assert c2.n == 41
    assert scaler2.get_scale() == 1024.0


def test_mismatch_is_reported_at_once_and_changes_nothing(tmp_path):
    model = make_model(width=32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    stepvault.save(tmp_path, {"model": model, "optimizer": opt, "step": 5}, run="r", step=1)

    other = make_model(width=48, seed=1)  # different hidden width: shapes differ
    other_opt = torch.optim.AdamW(other.parameters())
    before = {k: v.clone() for k, v in other.state_dict().items()}
    live = {"model": other, "optimizer": other_opt, "step": 0}
    with pytest.raises(stepvault.errors.StateMismatchError) as exc:
        stepvault.restore(tmp_path, live, run="r")
    msg = str(exc.value)
    assert "model.0.weight: shape (32, 16) in checkpoint, (48, 16) live" in msg
    assert "exp_avg" in msg  # optimizer state shapes checked as well
    assert len(exc.value.problems) >= 4
    assert live["step"] == 0
    assert other_opt.state_dict()["state"] == {}
    for k, v in other.state_dict().items():
        assert torch.equal(v, before[k])


def test_missing_and_unexpected_keys(tmp_path):
    model = make_model()
    stepvault.save(tmp_path, {"model": model}, run="r", step=1)
    live = {"model": make_model(), "extra": 1}
    with pytest.raises(
        stepvault.errors.StateMismatchError, match=r"extra: not in checkpoint.*strict=False"
    ):
        stepvault.restore(tmp_path, live, run="r")
    info = stepvault.restore(tmp_path, live, run="r", strict=False)
    assert info.step == 1 and live["extra"] == 1
    wrapper = torch.nn.Sequential(make_model())  # keys gain a "0." prefix
    with pytest.raises(stepvault.errors.StateMismatchError, match="missing keys"):
        stepvault.restore(tmp_path, {"model": wrapper}, run="r")


def test_wrong_kind_and_dtype(tmp_path):
    model = make_model()
    stepvault.save(tmp_path, {"model": model, "t": torch.zeros(3)}, run="r", step=1)
    with pytest.raises(stepvault.errors.StateMismatchError) as exc:
        stepvault.restore(
            tmp_path,
            {"model": make_model().to(torch.float64), "t": torch.zeros(3, dtype=torch.int32)},
            run="r",
        )
    text = str(exc.value)
    assert "dtype torch.float32 in checkpoint, torch.float64 live" in text
    assert "t: checkpoint holds (3,) torch.float32, live is (3,) torch.int32" in text


def test_unencodable_value_refused_before_writing(tmp_path):
    class Opaque:
        pass

    with pytest.raises(stepvault.errors.UnsupportedTypeError) as exc:
        stepvault.save(tmp_path, {"cfg": {"inner": [1, Opaque()]}}, run="r", step=1)
    assert "state['cfg']['inner'][1]" in str(exc.value)
    assert "Opaque" in str(exc.value) and "register_type" in str(exc.value)
    assert not (tmp_path / "runs").exists()


def test_register_type_converter(tmp_path):
    from fractions import Fraction

    stepvault.state.register_type(
        Fraction,
        "fractions.Fraction",
        lambda f: [f.numerator, f.denominator],
        lambda v: Fraction(*v),
    )
    try:
        stepvault.save(tmp_path, {"x": {"f": Fraction(3, 7)}}, run="r", step=1)
        live = {"x": None}
        stepvault.restore(tmp_path, live, run="r")
        assert live["x"] == {"f": Fraction(3, 7)}
    finally:
        stepvault.state.unregister_type(Fraction)
    with pytest.raises(stepvault.errors.UnsupportedTypeError, match="register_type"):
        stepvault.restore(tmp_path, {"x": None}, run="r")


def test_lazy_tensor_read_and_load(tmp_path):
    model = make_model()
    stepvault.save(tmp_path, {"model": model, "step": 3}, run="r", step=3)
    vault = stepvault.open(tmp_path)
    assert vault.runs() == ["r"] and vault.steps("r") == [3]
    ckpt = vault.checkpoint("r@3")
    assert "model/0.weight" in ckpt.tensor_names()
    w = ckpt.tensor("model/0.weight")
    assert torch.equal(w, model.state_dict()["0.weight"])
    w2 = ckpt.tensor("model/0.weight")
    w2.add_(1)  # tensors handed out never alias each other
    assert torch.equal(w, model.state_dict()["0.weight"])
    full = ckpt.load()
    assert full["step"] == 3 and set(full["model"]) == set(model.state_dict())
    with pytest.raises(KeyError, match="tensor_names"):
        ckpt.tensor("model/nope")


def test_deduplicated_tensors_do_not_alias_after_restore(tmp_path):
    # Two identical tensors share one object; restored, they must be independent.
    a, b = torch.zeros(300_000), torch.zeros(300_000)
    stepvault.save(tmp_path, {"x": {"a": a, "b": b}}, run="r", step=1)
    live = {"x": None}
    stepvault.restore(tmp_path, live, run="r")
    live["x"]["a"].add_(1)
    assert float(live["x"]["b"].sum()) == 0.0


def test_large_tensor_is_chunked_and_restored(tmp_path):
    from stepvault.store import Store

    store = Store.open(
        tmp_path, create=True, defaults={"chunk_size": 64 << 10, "small_tensor": 16 << 10}
    )
    assert store.settings["chunk_size"] == 64 << 10
    t = torch.randn(100_003)  # 400 KB, not a multiple of the chunk size
    info = stepvault.save(tmp_path, {"t": t}, run="r", step=1)
    assert info.objects == 7
    live = {"t": torch.zeros(100_003)}
    stepvault.restore(tmp_path, live, run="r")
    assert torch.equal(live["t"], t)


@pytest.mark.parametrize("codec", ["raw", "zstd", "float", "auto"])
def test_every_codec_setting_roundtrips(tmp_path, codec):
    state = {
        "f32": torch.randn(70_000) * 0.02,
        "bf16": (torch.randn(600_000) * 0.02).to(torch.bfloat16),
        "f16": torch.randn(5_000).half(),
        "i64": torch.arange(1000),
        "b": torch.rand(100) > 0.5,
    }
    state["f32"][:4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")])
    info = stepvault.save(tmp_path, state, run="r", step=1, codec=codec)
    if codec in ("float", "auto"):
        assert info.stored_bytes < 0.9 * info.logical_bytes
    live = {k: torch.empty_like(v) for k, v in state.items()}
    stepvault.restore(tmp_path, live, run="r")
    for k, v in state.items():
        assert torch.equal(
            live[k].view(torch.uint8) if v.dtype != torch.bool else live[k],
            v.view(torch.uint8) if v.dtype != torch.bool else v,
        ), k


def test_existing_step_is_not_overwritten_silently(tmp_path):
    stepvault.save(tmp_path, {"x": 1}, run="r", step=1)
    with pytest.raises(stepvault.errors.CheckpointExistsError, match="overwrite=True"):
        stepvault.save(tmp_path, {"x": 2}, run="r", step=1)
    stepvault.save(tmp_path, {"x": 3}, run="r", step=1, overwrite=True)
    live = {"x": 0}
    stepvault.restore(tmp_path, live, run="r")
    assert live["x"] == 3


def test_restore_of_missing_run(tmp_path):
    assert stepvault.restore(tmp_path, {}, run="r", missing_ok=True) is None
    stepvault.save(tmp_path, {"x": 1}, run="other", step=1)
    assert stepvault.restore(tmp_path, {}, run="r", missing_ok=True) is None
    with pytest.raises(stepvault.errors.CheckpointNotFoundError, match="other"):
        stepvault.restore(tmp_path, {}, run="r")
    with pytest.raises(stepvault.errors.CheckpointNotFoundError):
        stepvault.restore(tmp_path, {"x": 0}, run="other", step=7)


def test_restore_places_bytes_into_live_parameters(tmp_path):
    model = make_model()
    big = torch.randn(700_000)
    stepvault.save(tmp_path, {"model": model, "big": big}, run="r", step=1)
    other = make_model(seed=3)
    ptrs = {k: v.data_ptr() for k, v in other.state_dict().items()}
    live_big = torch.zeros(700_000)
    ptr_big = live_big.data_ptr()
    stepvault.restore(tmp_path, {"model": other, "big": live_big}, run="r")
    assert {k: v.data_ptr() for k, v in other.state_dict().items()} == ptrs  # same memory
    assert live_big.data_ptr() == ptr_big and torch.equal(live_big, big)
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v)


def test_restore_into_non_contiguous_parameter(tmp_path):
    model = torch.nn.Linear(8, 4)
    stepvault.save(tmp_path, {"model": model}, run="r", step=1)
    other = torch.nn.Linear(8, 4)
    with torch.no_grad():  # a transposed (non-contiguous) weight cannot take raw bytes
        other.weight = torch.nn.Parameter(torch.zeros(8, 4).t())
    assert not other.weight.is_contiguous()
    stepvault.restore(tmp_path, {"model": other}, run="r")
    assert torch.equal(other.weight, model.weight)


def test_latest_of_a_training_state_passes_over_weights_only_checkpoints(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": model, "optimizer": opt, "step": 1}
    stepvault.save(tmp_path, state, run="r", step=1)
    state["step"] = 2
    stepvault.save(tmp_path, state, run="r", step=2, kind="weights")
    fresh_model = torch.nn.Linear(4, 4)
    fresh = {
        "model": fresh_model,
        "optimizer": torch.optim.SGD(fresh_model.parameters(), lr=0.1, momentum=0.9),
        "step": None,
    }
    info = stepvault.restore(tmp_path, fresh, run="r")
    assert info.step == 1 and fresh["step"] == 1 and info.skipped == []
    weights = {"model": torch.nn.Linear(4, 4)}  # modules alone: the weights checkpoint is fine
    assert stepvault.restore(tmp_path, weights, run="r").step == 2
    stepvault.save(tmp_path / "w", {"model": model}, run="r", step=5, kind="weights")
    with pytest.raises(stepvault.errors.NoValidCheckpointError, match="only weights-only"):
        stepvault.restore(tmp_path / "w", fresh, run="r")


def _mapped_files_under(root) -> list[str]:
    """Files under ``root`` that this process still has memory-mapped (Linux)."""
    prefix = str(root.resolve())
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-1] for line in f if prefix in line})


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")
def test_restored_optimizer_state_owns_its_memory_and_trains_on(tmp_path):
    # A fresh optimizer has no state to copy into: its moments are built by the restore.
    # They must live in memory of their own, not in views of the stored objects' maps: a
    # view would copy every page on its first write inside the training step, and keep the
    # object files (on a tmpfs mem tier: their memory) alive as long as training runs.
    from stepvault.store import Store

    root = tmp_path / "store"
    Store.open(root, create=True, defaults={"chunk_size": 64 << 10, "small_tensor": 16 << 10})

    def build(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, opt, seed: int) -> None:
        torch.manual_seed(seed)
        opt.zero_grad()
        model(torch.randn(16, 256)).pow(2).mean().backward()
        opt.step()

    model, opt = build(0)
    for s in range(3):
        step(model, opt, s)
    arr = np.random.default_rng(0).standard_normal(100_003)  # several chunks, numpy
    extra = {"t": torch.randn(70_001), "arr": arr}  # plain nested values: materialised
    stepvault.save(root, {"model": model, "opt": opt, "extra": extra}, run="r", step=3)

    model2, opt2 = build(1)
    live = {"model": model2, "opt": opt2, "extra": None}
    stepvault.restore(root, live, run="r")
    assert _mapped_files_under(root) == []
    want, got = opt.state_dict()["state"], opt2.state_dict()["state"]
    for i in want:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[i][k], want[i][k]), (i, k)
    assert torch.equal(live["extra"]["t"], extra["t"])
    assert np.array_equal(live["extra"]["arr"], arr)
    # Training goes on from the restored state exactly as from the original.
    for s in range(3, 5):
        step(model, opt, s)
        step(model2, opt2, s)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_non_finite_metric_is_left_out_and_the_checkpoint_saved(tmp_path):
    """A diverged loss (NaN) passed as a metric raised UnsupportedTypeError on the training
    thread: the checkpoint of that step was lost, with on_save_error="warn" too."""
    from stepvault import CheckpointManager, KeepBest, KeepLast

    model = torch.nn.Linear(4, 4)
    with pytest.warns(RuntimeWarning, match=r"val=nan are not finite"):
        stepvault.save(tmp_path / "a", {"m": model}, run="r", step=1, metrics={"val": math.nan})
    assert stepvault.open(tmp_path / "a").manifest("r", 1).metrics == {}
    keep = KeepLast(1) | KeepBest(1, "val")
    with CheckpointManager(tmp_path / "b", "r", keep=keep, async_save=True) as mgr:
        for step, val in ((1, 0.5), (2, math.inf), (3, 0.9)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                mgr.save(step, {"m": model}, metrics={"val": val, "loss": 1.0})
    vault = stepvault.open(tmp_path / "b")
    assert vault.steps("r") == [1, 3]  # step 2 was saved, then dropped by keep; 1 is best
    events = [e for e in read_events(Store.open(tmp_path / "b"), "r") if e.get("step") == 2]
    assert [e["event"] for e in events][:1] == ["save"]


def test_a_file_as_store_and_a_missing_step_are_errors_that_say_what_exists(tmp_path):
    """A file given as the store raised a bare NotADirectoryError; a missing step named no
    step the run has."""
    from stepvault.errors import CheckpointNotFoundError, StoreNotFoundError

    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    model = torch.nn.Linear(4, 4)
    with pytest.raises(StoreNotFoundError, match="is a file"):
        stepvault.save(a_file, {"m": model}, run="r", step=1)
    with pytest.raises(StoreNotFoundError, match="is a file"):
        stepvault.open(a_file / "sub")
    for step in (1, 2, 5):
        stepvault.save(tmp_path / "s", {"m": model}, run="r", step=step)
    with pytest.raises(CheckpointNotFoundError, match=r"r@3 .*\(r has 1, 2, 5; .*ops\.hold"):
        stepvault.open(tmp_path / "s").checkpoint("r", 3).load()
    with pytest.raises(CheckpointNotFoundError, match=r"r@9 .*\(r has 1, 2, 5\)$"):
        stepvault.restore(tmp_path / "s", {"m": model}, run="r", step=9)
