"""CheckpointManager: policies, async saves, errors, retention, GC, leases, events."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
from training import Trainer, assert_same_training_state

import stepvault
from stepvault import CheckpointManager
from stepvault.manager.options import GCOptions, ManagerOptions, StagingOptions
from stepvault.policy import Every, KeepBest, KeepLast, OnSignal
from stepvault.store import Store
from stepvault.store.lease import LeaseHeldError


def _state(width: int = 64, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(width, width)
    return {"model": model, "step": 0}


@pytest.mark.parametrize("async_save", [False, True])
def test_policy_driven_saves_and_retention(tmp_path, async_save):
    state = _state()
    with CheckpointManager(
        tmp_path,
        "r",
        save=Every(steps=3),
        keep=KeepLast(2),
        async_save=async_save,
        options=ManagerOptions(gc=GCOptions(grace_seconds=0)),
    ) as mgr:
        handles = []
        for step in range(1, 13):
            with torch.no_grad():
                state["model"].weight.add_(1.0)
            state["step"] = step
            h = mgr.save(step, state, metrics={"loss": 1.0 / step})
            if h is not None:
                handles.append(h)
        assert [h.step for h in handles] == [3, 6, 9, 12]
        assert all(h.asynchronous == async_save for h in handles)
        assert handles[-1].result().step == 12
        mgr.wait()
        assert [c.step for c in mgr.checkpoints()] == [9, 12]
        assert mgr.latest_step == 12
    usage = stepvault.ops.usage(tmp_path)
    assert usage.unreferenced_objects == 0  # GC swept the objects of deleted checkpoints
    assert stepvault.ops.verify(tmp_path, deep=True).ok
    lines = (tmp_path / "events" / "r.jsonl").read_text().splitlines()
    events = [json.loads(line)["event"] for line in lines]
    assert events.count("save") == 4 and events.count("delete") == 2


def test_async_save_returns_before_the_write_and_stages_a_copy(tmp_path, monkeypatch):
    state = _state(width=256)
    gate = threading.Event()
    original = Store.put_object

    def gated(self, digest, parts):
        gate.wait(10)
        return original(self, digest, parts)

    monkeypatch.setattr(Store, "put_object", gated)
    with CheckpointManager(tmp_path, "r", async_save=True) as mgr:
        mgr.prepare(state, wait=True)  # buffers ready: the first save is async
        expected = state["model"].weight.detach().clone()
        handle = mgr.save(1, state)
        assert not handle.done()  # the write is blocked, save() returned anyway
        with torch.no_grad():
            state["model"].weight.add_(5.0)  # training goes on and mutates the weights
        gate.set()
        handle.result(timeout=30)
    live = _state(width=256)
    stepvault.restore(tmp_path, live, run="r")
    assert torch.equal(live["model"].weight, expected)  # the staged copy was saved


def test_background_error_surfaces_and_leaves_no_checkpoint(tmp_path, monkeypatch):
    state = _state()
    with CheckpointManager(tmp_path, "r", async_save=True) as mgr:
        mgr.prepare(state, wait=True)  # buffers ready: the first save is async
        mgr.save(1, state)
        mgr.wait()

        def boom(self, *a, **k):
            raise OSError("disk on fire")

        monkeypatch.setattr(Store, "commit_manifest", boom)
        mgr.save(2, state)  # returns: the failure happens in the background
        with pytest.raises(OSError, match="disk on fire"):
            mgr.wait()
        mgr.save(3, state)
        time.sleep(0.5)
        with pytest.raises(OSError, match="disk on fire"):  # raised on the next call
            mgr.save(4, state)
        monkeypatch.undo()
        assert mgr.stats()["failures"] == 2
        assert stepvault.open(tmp_path).steps("r") == [1]
        events = [e for e in mgr.events() if e["event"] == "save_failed"]
        assert len(events) == 2 and "disk on fire" in events[0]["error"]


def test_close_raises_a_pending_error(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, "r", async_save=True)
    state = _state()
    mgr.prepare(state, wait=True)  # buffers ready: the first save is async

    def boom(self, *a, **k):
        raise OSError("late failure")

    monkeypatch.setattr(Store, "commit_manifest", boom)
    mgr.save(1, state)
    with pytest.raises(OSError, match="late failure"):
        mgr.close()
    # the lease was released despite the error
    CheckpointManager(tmp_path, "r").close()


def test_if_busy_skip(tmp_path, monkeypatch):
    gate = threading.Event()
    original = Store.put_object
    monkeypatch.setattr(
        Store, "put_object", lambda self, d, p: (gate.wait(10), original(self, d, p))[1]
    )
    state = _state()
    with CheckpointManager(
        tmp_path, "r", options=ManagerOptions(staging=StagingOptions(if_busy="skip"))
    ) as mgr:
        mgr.prepare(state, wait=True)  # buffers ready: the first save is async
        assert mgr.save(1, state) is not None
        assert mgr.save(2, state) is None  # previous one still writing: skipped
        gate.set()
        mgr.wait()
        assert mgr.save(3, state) is not None
        mgr.wait()
        assert mgr.stats()["skipped_busy"] == 1
    assert stepvault.open(tmp_path).steps("r") == [1, 3]


def test_restore_latest_best_exact_and_fallback(tmp_path):
    state = _state()
    losses = {1: 0.5, 2: 0.2, 3: 0.4, 4: 0.3}
    with CheckpointManager(
        tmp_path,
        "r",
        keep=KeepBest(2, metric="val_loss"),
        options=ManagerOptions(gc=GCOptions(grace_seconds=0)),
    ) as mgr:
        assert mgr.restore(state) is None  # fresh start
        for step, loss in losses.items():
            with torch.no_grad():
                state["model"].bias.fill_(step)
            state["step"] = step
            mgr.save(step, state, metrics={"val_loss": loss})
        mgr.wait()
        assert mgr.best_step == 2
        # KeepBest(2) keeps 2 and 4; the newest (4) is kept anyway
        assert [c.step for c in mgr.checkpoints()] == [2, 4]
        live = _state(seed=1)
        assert mgr.restore(live).step == 4 and float(live["model"].bias.detach()[0]) == 4
        assert mgr.restore(live, "best").step == 2 and live["step"] == 2
        assert mgr.restore(live, 4).step == 4
        with pytest.raises(stepvault.errors.CheckpointNotFoundError):
            mgr.restore(live, 3)
        # damage the best: "best" falls back to the next best
        m = stepvault.open(tmp_path).manifest("r", 2)
        for digest in m.objects:
            os.unlink(tmp_path / "objects" / digest[:2] / digest)
        info = mgr.restore(live, "best")
        assert info.step == 4 and [s.step for s in info.skipped] == [2]
        st = mgr.stats()
        assert st["restores"] == 5 and st["restore_failures"] == 1 and st["fallbacks"] == 1


def test_weights_only_and_full_checkpoints(tmp_path):
    trainer = Trainer()
    policy = Every(steps=2, what="weights") | Every(steps=6)
    with CheckpointManager(tmp_path, "r", save=policy) as mgr:
        trainer.train(12, on_step=lambda t, loss: mgr.save(t.step, t.state))
        mgr.wait()
        kinds = {c.step: c.kind for c in mgr.checkpoints()}
        assert kinds == {
            2: "weights",
            4: "weights",
            6: "full",
            8: "weights",
            10: "weights",
            12: "full",
        }
        ckpt = stepvault.open(tmp_path).checkpoint("r@10")
        assert all(n.startswith("model/") for n in ckpt.tensor_names())
        # resuming training needs a full checkpoint: "latest" skips weights-only ones
        other = Trainer(seed=3)
        state = other.state
        assert mgr.restore(state).step == 12
        other.load_from(state)
        assert_same_training_state(trainer, other)


def test_pins_survive_every_keep_policy(tmp_path):
    state = _state()
    with CheckpointManager(
        tmp_path, "r", keep=KeepLast(1), options=ManagerOptions(gc=GCOptions(grace_seconds=0))
    ) as mgr:
        mgr.save(1, state)
        mgr.wait()
        mgr.pin(1, note="release candidate")
        for step in (2, 3):
            mgr.save(step, state)
            mgr.wait()
        plan = mgr.retention_plan()
        assert plan.keep == [1, 3]
        reasons = {e.step: e.reasons for e in plan.entries}
        assert "pinned" in reasons[1]
        mgr.unpin(1)
        mgr.save(4, state)
        mgr.wait()
        assert [c.step for c in mgr.checkpoints()] == [4]


def test_pin_right_after_an_asynchronous_save_pins_it_once_committed(tmp_path):
    """``mgr.pin(step)`` right after ``mgr.save(step)`` raised CheckpointNotFoundError
    while the save was still in flight (async_save is the default)."""
    from stepvault.errors import CheckpointNotFoundError

    state = {"model": torch.nn.Linear(256, 256)}
    with CheckpointManager(tmp_path, "r", keep=KeepLast(1)) as mgr:
        mgr.prepare(state, wait=True)  # staging memory ready: the save is asynchronous
        handle = mgr.save(1, state)
        assert handle is not None and handle.asynchronous
        mgr.pin(1, note="right away")
        mgr.save(2, state)
        mgr.wait()
        with pytest.raises(CheckpointNotFoundError):
            mgr.pin(7)  # a step never saved is still an error
    assert stepvault.open(tmp_path).steps("r") == [1, 2]


def test_single_writer_lease(tmp_path):
    mgr = CheckpointManager(tmp_path, "r")
    with pytest.raises(LeaseHeldError, match="being written by"):
        CheckpointManager(tmp_path, "r")
    CheckpointManager(tmp_path, "other").close()  # other runs are independent
    mgr.close()
    CheckpointManager(tmp_path, "r").close()


def test_stale_lease_is_taken_over(tmp_path):
    mgr = CheckpointManager(tmp_path, "r")
    lease_path = tmp_path / "refs" / "leases" / "r.json"
    # forge a lease left by a dead process on this host
    record = json.loads(lease_path.read_text())
    mgr._p.lease.stop()
    record.update(pid=2**22 + 12345, token="dead")
    lease_path.write_text(json.dumps(record))
    CheckpointManager(tmp_path, "r").close()
    # and one from another host whose heartbeat is too old
    record.update(host="elsewhere", heartbeat=time.time() - 10_000, stale_after=60)
    lease_path.write_text(json.dumps(record))
    CheckpointManager(tmp_path, "r").close()


def test_gc_races_with_saves_of_another_run(tmp_path):
    """A run keeping only its last checkpoint (GC after every save) while another run saves
    deduplicated content concurrently: no object a committed checkpoint needs is lost."""
    errors = []
    shared = torch.randn(300_000)  # both runs carry this tensor: cross-run dedup

    def writer(run, keep):
        try:
            with CheckpointManager(
                tmp_path,
                run,
                keep=keep,
                options=ManagerOptions(gc=GCOptions(grace_seconds=1.0)),
                async_save=True,
            ) as mgr:
                for step in range(1, 15):
                    state = {"shared": shared, "own": torch.full((50_000,), float(step))}
                    mgr.save(step, state)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [
        threading.Thread(target=writer, args=("a", KeepLast(1))),
        threading.Thread(target=writer, args=("b", None)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    report = stepvault.ops.verify(tmp_path, deep=True)
    assert report.ok, report.to_json()
    assert stepvault.open(tmp_path).steps("a") == [14]
    assert len(stepvault.open(tmp_path).steps("b")) == 14


def test_retention_plan_dry_run_changes_nothing(tmp_path):
    state = _state()
    with CheckpointManager(tmp_path, "r") as mgr:  # no keep policy: nothing deleted
        for step in range(1, 6):
            mgr.save(step, state, metrics={"val_loss": 1.0 / step})
        mgr.wait()
        mgr.keep_policy = KeepLast(2)
        plan = mgr.retention_plan()
        assert plan.delete == [1, 2, 3]
        assert "last 2" in str(plan)
        assert [c.step for c in mgr.checkpoints()] == [1, 2, 3, 4, 5]


def test_events_and_stats(tmp_path):
    state = _state()
    with CheckpointManager(
        tmp_path, "r", keep=KeepLast(1), options=ManagerOptions(gc=GCOptions(grace_seconds=0))
    ) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        mgr.wait()
        mgr.restore(state)
        stats = mgr.stats()
    assert stats["saves"] == 2 and stats["failures"] == 0 and stats["restores"] == 1
    assert stats["restore_success_rate"] == 1.0 and stats["mean_stall_seconds"] >= 0
    assert stats["staging_bytes"] >= state["model"].weight.nbytes
    events = stepvault.open(tmp_path)
    from stepvault.catalog.events import read_events

    evs = read_events(events.store, "r")
    kinds = [e["event"] for e in evs]
    # Retention deletes the manifest at once; the sweep of its objects runs off the commit
    # path (here: at close, with no deletions enough to sweep before).
    assert kinds == ["save", "save", "delete", "restore", "gc"]
    save = evs[0]
    for key in (
        "step",
        "logical_bytes",
        "stored_bytes",
        "new_bytes",
        "stall_seconds",
        "write_seconds",
        "throughput_bytes_per_s",
        "user",
        "host",
        "time",
    ):
        assert key in save


def test_programmatic_preemption_saves_synchronously_and_exits(tmp_path):
    signal_policy = OnSignal(action="exit")
    state = _state()
    mgr = CheckpointManager(tmp_path, "r", save=Every(steps=100) | signal_policy)
    assert mgr.save(1, state) is None
    signal_policy.trigger()
    with pytest.raises(SystemExit) as exc:
        mgr.save(2, state)
    assert exc.value.code == 143
    assert stepvault.open(tmp_path).steps("r") == [2]  # committed before exiting
    CheckpointManager(tmp_path, "r").close()  # closed: lease released


def test_prometheus_metrics(tmp_path):
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    with CheckpointManager(tmp_path, "r", prometheus=registry) as mgr:
        mgr.save(5, _state())
        mgr.wait()
    assert registry.get_sample_value("stepvault_saves_total", {"run": "r", "kind": "full"}) == 1
    assert registry.get_sample_value("stepvault_latest_step", {"run": "r"}) == 5


def test_restoring_an_older_step_warns_that_newer_checkpoints_will_be_replaced(tmp_path):
    """``resume_from_checkpoint`` of an older step silently overwrote the newer ones as
    training reached them, and until then "latest" was the abandoned timeline's."""
    import warnings

    from stepvault.catalog.events import read_events

    state = {"model": torch.nn.Linear(4, 4)}
    with CheckpointManager(tmp_path, "r", async_save=False) as mgr:
        for step in (2, 4, 6):
            mgr.save(step, state)
    with CheckpointManager(tmp_path, "r", async_save=False) as mgr:
        with pytest.warns(RuntimeWarning, match=r"restored step 2, but the run has newer.*4, 6"):
            mgr.restore(state, step=2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the newest: nothing to say
            mgr.restore(state, step=6)
            mgr.restore(state)
    rewinds = [e for e in read_events(mgr.store, "r") if e["event"] == "rewind"]
    assert [(e["step"], e["newer"]) for e in rewinds] == [(2, [4, 6])]
