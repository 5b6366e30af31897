"""Staging memory of asynchronous saves: prepared off the training thread (restore, a save
that is not due, prepare()), several saves in flight under staging_memory, released by
close(); the device-copy ordering of the GPU path (with fakes: no GPU is needed)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import stepvault
from stepvault import CheckpointManager
from stepvault.engine import staging_area
from stepvault.engine.background import BackgroundWriter
from stepvault.engine.device_copy import DeviceCopies
from stepvault.manager.options import ManagerOptions, StagingOptions, parse_size
from stepvault.policy import Every
from stepvault.store import Store

ROOT = Path(__file__).resolve().parents[1]


def _state(mb: float = 8, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    width = int((mb * (1 << 20) / 4) ** 0.5)
    return {"model": torch.nn.Linear(width, width, bias=False), "step": 0}


def _state_bytes(state: dict) -> int:
    return sum(p.nbytes for p in state["model"].parameters())


@pytest.fixture
def allocations(monkeypatch):
    """Every staging block allocated: (thread name, bytes)."""
    seen: list[tuple[str, int]] = []
    original = staging_area._host_block

    def recording(nbytes, pin_memory):
        seen.append((threading.current_thread().name, nbytes))
        return original(nbytes, pin_memory)

    monkeypatch.setattr(staging_area, "_host_block", recording)
    return seen


def _wait_ready(mgr: CheckpointManager, timeout: float = 20.0) -> None:
    t_end = time.monotonic() + timeout
    while not mgr.stats()["staging_ready"]:
        assert time.monotonic() < t_end, "staging buffers never became ready"
        time.sleep(0.005)


def _assert_off_thread(allocations, mgr, state) -> None:
    me = threading.current_thread().name
    assert allocations and all(name != me for name, _ in allocations), allocations
    assert all(name.startswith("stepvault-staging") for name, _ in allocations)
    areas = mgr._p.staging._areas
    assert areas and all(a.prepared_by.startswith("stepvault-staging") for a in areas)
    assert mgr.stats()["staging_bytes"] >= _state_bytes(state)


def test_prepare_allocates_and_faults_in_the_background(tmp_path, allocations):
    state = _state()
    with CheckpointManager(tmp_path, "r") as mgr:
        assert mgr.stats()["staging_bytes"] == 0 and not mgr.stats()["staging_ready"]
        mgr.prepare(state)  # returns at once; the work runs on the staging thread
        _wait_ready(mgr)
        _assert_off_thread(allocations, mgr, state)  # buffers exist before the due save
        n = len(allocations)
        handle = mgr.save(1, state)
        assert handle.asynchronous  # the first save already stages into ready buffers
        handle.result()
        assert len(allocations) == n  # the due save allocated nothing
    restored = _state(seed=1)
    stepvault.restore(tmp_path, restored, run="r")
    assert torch.equal(restored["model"].weight, state["model"].weight)


def test_restore_prepares_the_staging_for_the_first_save(tmp_path, allocations):
    state = _state()
    with CheckpointManager(tmp_path, "r") as mgr:
        assert mgr.restore(state) is None  # a fresh start still shows the state
        _wait_ready(mgr)
        _assert_off_thread(allocations, mgr, state)
        assert mgr.save(1, state).asynchronous
    allocations.clear()
    with CheckpointManager(tmp_path, "r") as mgr:  # a resume: the state as restored
        assert mgr.restore(state).step == 1
        _wait_ready(mgr)
        _assert_off_thread(allocations, mgr, state)
        assert mgr.save(2, state).asynchronous


def test_a_save_that_is_not_due_prepares_the_staging(tmp_path, allocations):
    state = _state()
    with CheckpointManager(tmp_path, "r", save=Every(steps=5)) as mgr:
        assert mgr.save(1, state) is None
        _wait_ready(mgr)
        _assert_off_thread(allocations, mgr, state)
        for step in range(2, 5):
            assert mgr.save(step, state) is None
        assert mgr.save(5, state).asynchronous
        assert len(allocations) == 1  # one area, allocated once


def test_a_save_due_before_the_buffers_are_ready_is_written_synchronously(
    tmp_path, allocations, monkeypatch
):
    gate = threading.Event()
    original = staging_area.StagingArea.prepare

    def slow_prepare(self, *a, **k):
        gate.wait(20)  # the preparation has not finished when the save is due
        return original(self, *a, **k)

    monkeypatch.setattr(staging_area.StagingArea, "prepare", slow_prepare)
    state = _state()
    with CheckpointManager(tmp_path, "r") as mgr:
        mgr.prepare(state)
        handle = mgr.save(1, state)
        assert not handle.asynchronous and handle.done()  # written, not staged
        assert handle.result().step == 1
        assert allocations == []  # nothing allocated on the training thread
        gate.set()
        _wait_ready(mgr)
        _assert_off_thread(allocations, mgr, state)
        assert mgr.save(2, state).asynchronous


def test_budget_allows_several_saves_in_flight_and_is_never_exceeded(
    tmp_path, allocations, monkeypatch
):
    gate = threading.Event()
    for method in ("put_object", "stage_object"):  # a save's new objects are staged
        original = getattr(Store, method)
        monkeypatch.setattr(
            Store, method, lambda self, d, p, f=original: (gate.wait(20), f(self, d, p))[1]
        )
    state = _state(4)
    size = _state_bytes(state)
    budget = int(3.5 * size)
    with CheckpointManager(
        tmp_path,
        "r",
        options=ManagerOptions(staging=StagingOptions(memory=budget, if_busy="skip")),
    ) as mgr:
        mgr.prepare(state, wait=True)
        handles = []
        for step in (1, 2, 3):
            with torch.no_grad():
                state["model"].weight.fill_(float(step))
            _wait_ready(mgr)  # a training step passes: the next area gets ready
            handles.append(mgr.save(step, state))
            assert mgr.stats()["staging_bytes"] <= budget
        assert all(h.asynchronous and not h.done() for h in handles)  # 3 in flight
        assert mgr.save(4, state) is None  # a 4th copy would pass the budget: skipped
        assert mgr.stats()["skipped_busy"] == 1
        gate.set()
        assert [h.result().step for h in handles] == [1, 2, 3]
        stats = mgr.stats()
        assert stats["staging_peak_bytes"] <= budget == stats["staging_budget_bytes"]
        assert len(allocations) == 3 and sum(n for _, n in allocations) <= budget
    for step in (1, 2, 3):  # each save kept its own copy of the state
        restored = _state(4, seed=9)
        stepvault.restore(tmp_path, restored, run="r", step=step)
        assert torch.all(restored["model"].weight == float(step))


def test_a_state_over_the_budget_is_saved_synchronously_with_a_warning(tmp_path, allocations):
    state = _state(2)
    with CheckpointManager(
        tmp_path, "r", options=ManagerOptions(staging=StagingOptions(memory="1MiB"))
    ) as mgr:
        mgr.prepare(state, wait=True)
        with pytest.warns(RuntimeWarning, match=r"StagingOptions\(memory="):
            first = mgr.save(1, state)
        second = mgr.save(2, state)
        assert not first.asynchronous and not second.asynchronous
        assert mgr.stats()["staging_bytes"] == 0 and allocations == []
        assert any(e["event"] == "staging_over_budget" for e in mgr.events())
    assert stepvault.ops.verify(tmp_path).ok


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc (Linux)")
def test_close_returns_staging_memory(tmp_path):
    state = _state(64)
    size = _state_bytes(state)
    mgr = CheckpointManager(tmp_path, "r")
    before = _rss()
    mgr.prepare(state, wait=True)
    assert _rss() - before > 0.9 * size  # the buffers are faulted in (resident)
    for step in (1, 2):
        mgr.save(step, state).result()
    mgr.close()
    assert mgr.stats()["staging_bytes"] == 0
    assert _rss() - before < 0.25 * size  # the one mapping went back to the system


def test_staging_memory_sizes_are_parsed_and_checked():
    assert parse_size("x", "8GB") == 8 * 10**9
    assert parse_size("x", "512MiB") == 512 << 20
    assert parse_size("x", "1.5 GiB") == 3 << 29
    assert parse_size("x", 4096) == 4096
    assert StagingOptions(memory="2KB").memory == 2000
    for bad in ("8 gigs", -1, True, "GB", 1.5):
        with pytest.raises(ValueError, match=r"staging memory must be .* such as '8GB'"):
            StagingOptions(memory=bad)


def test_background_writer_keeps_several_jobs_in_order():
    bg = BackgroundWriter(max_jobs=2)
    gate, order = threading.Event(), []
    try:
        bg.submit(lambda: (gate.wait(10), order.append(1)))
        bg.submit(lambda: order.append(2))
        assert bg.full
        with pytest.raises(RuntimeError, match="in flight"):
            bg.submit(lambda: None)
        gate.set()
        bg.wait()
        assert order == [1, 2] and not bg.busy
    finally:
        bg.shutdown()


def test_device_copies_are_enqueued_on_a_side_stream_and_guard_the_live_tensors(monkeypatch):
    """The ordering of the GPU path, with recording fakes for torch.cuda (no GPU here)."""
    log: list[str] = []

    class FakeStream:
        def __init__(self, name="side"):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name} waits for {other.name}")

        def wait_event(self, event):
            log.append(f"{self.name} waits for event")

    class FakeEvent:
        def record(self, stream):
            log.append(f"event recorded on {stream.name}")

        def synchronize(self):
            log.append("event synchronized")

    class FakeContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            log.append(f"enter {self.stream.name}")

        def __exit__(self, *exc):
            log.append(f"leave {self.stream.name}")

    class Tensor:
        def copy_(self, src, non_blocking=False):
            log.append(f"copy non_blocking={non_blocking}")

        def record_stream(self, stream):
            log.append(f"src used by {stream.name}")

    main = FakeStream("main")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: main)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", FakeContext)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    copies = DeviceCopies()
    copies.copy([])  # nothing on the device: no CUDA call at all
    assert log == [] and not copies.pending
    copies.copy([(Tensor(), Tensor())])
    assert log == [
        "side waits for main",  # the copy reads what training computed so far
        "enter side",
        "copy non_blocking=True",
        "src used by side",
        "leave side",
        "event recorded on side",
        "main waits for event",  # training's next kernels run after the copy
    ]
    assert copies.pending  # the training thread did not wait
    copies.wait()
    assert log[-1] == "event synchronized" and not copies.pending
    copies.wait()  # nothing pending: no second synchronize
    assert log.count("event synchronized") == 1


def test_bench_gpu_exits_cleanly_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--size-mb", "8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "no CUDA device" in out.stdout


def test_bench_gpu_runs_its_whole_sequence_on_cpu(tmp_path):
    """The GPU benchmark runs only where a GPU is lent; its CPU smoke run keeps it working."""
    table = tmp_path / "gpu.md"
    script = str(ROOT / "benchmarks" / "bench_gpu.py")
    args = ["--size-mb", "8", "--saves", "2", "--workdir", str(tmp_path), "--markdown", str(table)]
    out = subprocess.run(
        [sys.executable, script, "--device", "cpu", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    rows = {line.split("|")[1].strip() for line in table.read_text().splitlines() if "|" in line}
    for saver in ("stepvault async", "stepvault sync", "DCP async_save", "stepvault.restore"):
        assert saver in rows, saver
    assert [p.name for p in tmp_path.iterdir()] == ["gpu.md"]  # every checkpoint removed


def test_implicit_preparation_calls_no_state_dict_of_user_objects(tmp_path, allocations):
    """restore() and non-due saves read only modules, optimizers and tensors: a user
    object's state_dict() (a StatefulDataLoader draws a seed in it) runs at due saves only."""

    class Counter:
        def __init__(self):
            self.calls = 0
            self.n = 0

        def state_dict(self):
            self.calls += 1
            return {"n": self.n}

        def load_state_dict(self, sd):
            self.n = sd["n"]

    state = {**_state(), "counter": Counter()}
    with CheckpointManager(tmp_path, "r", save=Every(steps=3)) as mgr:
        assert mgr.restore(state) is None
        assert mgr.save(1, state) is None and mgr.save(2, state) is None
        _wait_ready(mgr)
        assert state["counter"].calls == 0
        _assert_off_thread(allocations, mgr, state)
        assert mgr.save(3, state).asynchronous  # the rest fit in the block's reserve
        assert state["counter"].calls == 1


def test_a_fresh_adam_run_prepares_again_once_its_moments_exist(tmp_path):
    """A fresh start's restore() sees AdamW without moments; the buffers prepared then are
    too small. A later save that is not due prepares again, so the first due save is
    still asynchronous."""
    import time

    from stepvault import CheckpointManager, Every

    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters())
    state = {"model": model, "optimizer": opt}
    with CheckpointManager(tmp_path, "r", save=Every(steps=3), lineage=False) as mgr:
        assert mgr.restore(state) is None  # fresh start: prepared without Adam's moments
        handles = {}
        for step in range(1, 4):
            model(torch.randn(2, 256)).sum().backward()
            opt.step()
            opt.zero_grad()
            if step == 3:  # the preparation a non-due save started has finished
                deadline = time.monotonic() + 30
                while not mgr.stats()["staging_ready"] and time.monotonic() < deadline:
                    time.sleep(0.01)
            handles[step] = mgr.save(step, state)
        assert handles[1] is None and handles[2] is None
        assert handles[3] is not None and handles[3].asynchronous
        mgr.wait()


def test_moments_that_appear_while_the_first_preparation_runs_are_prepared_too(
    tmp_path, monkeypatch
):
    """The restore() of a fresh run prepares for AdamW without moments; its preparation is
    still running (a loaded machine) when the first steps' non-due saves see the moments.
    Those requests are queued behind it, not dropped, so the first due save is still
    asynchronous (a CI run failed this way through the Accelerate checkpointer)."""
    release = threading.Event()
    original = staging_area.StagingArea.prepare
    calls = []

    def slow_first(self, *args, **kwargs):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            assert release.wait(30)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(staging_area.StagingArea, "prepare", slow_first)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters())
    state = {"model": model, "optimizer": opt}
    with CheckpointManager(tmp_path, "r", save=Every(steps=3), lineage=False) as mgr:
        assert mgr.restore(state) is None
        handles = {}
        for step in range(1, 4):
            model(torch.randn(2, 256)).sum().backward()
            opt.step()
            opt.zero_grad()
            if step == 3:
                release.set()
                mgr._p.staging.wait_prepared(30)
            handles[step] = mgr.save(step, state)
        assert handles[1] is None and handles[2] is None
        assert handles[3] is not None and handles[3].asynchronous
        assert len(calls) == 2  # the restore's preparation, then one for the moments
        assert mgr.wait().step == 3
