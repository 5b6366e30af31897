"""Issue 27: a save with the mem tier hashes each chunk once (memory and disk share one set
of chunk digests) and reads back nothing it just committed."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

import stepvault
import stepvault.engine.writer as writer_module
from stepvault import CheckpointManager
from stepvault.engine import to_host, write_objects
from stepvault.format import parse_manifest
from stepvault.format.settings import DEFAULT_STORE_SETTINGS
from stepvault.ops.verify import verify_store
from stepvault.store import Store
from stepvault.tiers import CopyEvery

READS = ("read_bytes", "read_range", "read_many", "map")


class Probe:
    """Counts what the writer hashes (patched ``content_hash`` of the write path) and every
    read from the given stores' backends, while ``on``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lock = threading.Lock()
        self.on = False
        self.hashed: Counter[str] = Counter()  # digest -> times hashed
        self.hashed_bytes = 0
        self.reads: list[tuple[str, str]] = []
        real = writer_module.content_hash

        def counting(data):  # type: ignore[no-untyped-def]
            digest = real(data)
            if self.on:
                with self.lock:
                    self.hashed[digest] += 1
                    self.hashed_bytes += memoryview(data).nbytes
            return digest

        monkeypatch.setattr(writer_module, "content_hash", counting)
        self.monkeypatch = monkeypatch

    def watch(self, store: Store, name: str) -> None:
        backend = store.backend
        for meth in READS:
            real = getattr(backend, meth)

            def wrapped(key, *args, _real=real, _meth=meth, **kwargs):  # type: ignore[no-untyped-def]
                # Counted: what a save writes (objects, manifests). Not counted: the
                # fenced commit's lease check (refs/leases) and the tier mover, which
                # reads the run's records for its own plan on its own thread.
                data = str(key).startswith(("objects", "runs/r/checkpoints"))
                mover = threading.current_thread().name == "stepvault-tiers"
                if self.on and data and not mover:
                    with self.lock:
                        self.reads.append((name, f"{_meth} {key}"))
                return _real(key, *args, **kwargs)

            self.monkeypatch.setattr(backend, meth, wrapped)

    def reset(self) -> None:
        self.hashed.clear()
        self.hashed_bytes = 0
        self.reads.clear()


def _state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512),  # 512 KiB: several chunks at chunk_size=128 KiB
        torch.nn.ReLU(),
        torch.nn.Linear(512, 16),  # small tensors: bundled
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, frozen_first: bool) -> None:
    model[0].requires_grad_(not frozen_first)  # a frozen layer's chunks are unchanged
    loss = model(torch.randn(8, 256)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _hot(tmp_path: Path) -> Path:
    hot = tmp_path / "ck"
    settings = {**DEFAULT_STORE_SETTINGS, "chunk_size": 128 << 10, "small_tensor": 64 << 10}
    Store.open(hot, create=True, defaults=settings)
    return hot


@pytest.mark.parametrize("async_save", [True, False])
def test_a_mem_tier_save_hashes_each_chunk_once_and_reads_nothing_back(
    tmp_path, monkeypatch, async_save
):
    """Memory + disk: every chunk of every save hashed exactly once (the old code hashed it
    once per destination), no byte read from either store during the save, and both copies
    verify deeply and restore bitwise."""
    hot, mem = _hot(tmp_path), tmp_path / "shm"
    model, opt = _state()
    probe = Probe(monkeypatch)
    mgr = CheckpointManager(
        hot,
        "r",
        tiers={"mem": str(mem)},
        tier_policy=CopyEvery("hot", steps=2),  # odd steps in memory only
        async_save=async_save,
        lineage=False,
    )
    assert mgr.mem_tier is not None
    probe.watch(mgr.store, "hot")
    probe.watch(mgr.mem_tier.store, "mem")
    expected, seen, want = {}, {}, {}
    for step in range(1, 7):
        _step(model, opt, frozen_first=step >= 3)
        probe.reset()
        probe.on = True
        mgr.save(step, {"model": model, "opt": opt}, force=True)
        mgr.wait()
        probe.on = False
        expected[step] = {k: v.clone() for k, v in model.state_dict().items()}
        m = parse_manifest(mgr.mem_tier.store.read_manifest("r", step), f"r@{step}")
        assert len(m.objects) > 4  # bundles and a tensor cut in several chunks
        if step % 2 == 0:  # also on disk: the same objects, named by the same digests
            d = parse_manifest(mgr.store.read_manifest("r", step), f"r@{step}")
            assert set(d.objects) == set(m.objects)
        chunk_bytes = sum(o.raw_size for o in m.objects.values())
        event = [e for e in mgr.events() if e["event"] == "save"][-1]
        assert event["step"] == step
        seen[step] = {
            "times each chunk was hashed": sorted(set(probe.hashed.values())),
            "bytes hashed / chunk bytes": probe.hashed_bytes / chunk_bytes,
            "chunks not hashed or not stored": len(set(probe.hashed) ^ set(m.objects)),
            "event hashed_bytes": event.get("hashed_bytes"),
            "reads from either store": list(probe.reads),
        }
        want[step] = {
            "times each chunk was hashed": [1],
            "bytes hashed / chunk bytes": 1.0,
            "chunks not hashed or not stored": 0,
            "event hashed_bytes": chunk_bytes,
            "reads from either store": [],
        }
    assert seen == want
    assert mgr.store.list_steps("r") == [2, 4, 6]
    assert mgr.mem_tier.steps() == list(range(1, 7))
    for store in (mgr.store, mgr.mem_tier.store):
        report = verify_store(store, run="r", deep=True)
        assert report.ok and report.objects_checked > 0, report.to_json()
    for step in (4, 6):  # bitwise from each tier (the mem tier is an ordinary store)
        for tier in (mgr.mem_tier.path, hot):
            fresh, fresh_opt = _state(seed=1)
            info = stepvault.restore(
                tier, {"model": fresh, "opt": fresh_opt}, run="r", step=step, mem=False
            )
            assert info.step == step
            for k, v in fresh.state_dict().items():
                assert torch.equal(v, expected[step][k]), (step, tier, k)
    mgr.close()


def test_digests_are_refused_for_other_buffers(tmp_path):
    """Digests name the bytes they were computed from: another array (even equal in shape)
    cannot borrow them, so no object is ever named after bytes it does not hold."""
    from stepvault.engine.writer import ChunkDigests

    store = Store.open(tmp_path / "s", create=True, defaults=DEFAULT_STORE_SETTINGS)
    a = {"w": to_host(torch.ones(1000))}
    b = {"w": to_host(torch.zeros(1000))}
    digests = ChunkDigests(a)
    write_objects(store, a, codec="raw", digests=digests)
    with pytest.raises(ValueError, match="other arrays"):
        write_objects(store, b, codec="raw", digests=digests)
    _tensors, objects, _ = write_objects(store, dict(a), codec="raw", digests=digests)
    assert digests.reused_bytes == 4000 and digests.hashed_bytes == 4000
    assert len(objects) == 1
