"""The pipelined restore (issue 31): reads run ahead of verification within the read-ahead
budget, every object is verified before anything is placed, and a failure stops the
pipeline without leaving threads or reads behind."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

import stepvault
from stepvault.core.opened import open_checkpoint
from stepvault.store import Store
from stepvault.store.fsspec_backend import open_fsspec


class CountingBackend:
    """A memory:// backend (downloads, no maps: every object's bytes are held until
    verified) that records the bytes of objects read so far."""

    def __init__(self, url: str) -> None:
        self.inner = open_fsspec(url)
        self.lock = threading.Lock()
        self.read = 0
        self.reads: list[int] = []  # bytes read before each object read started

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read_bytes(self, key: str) -> bytes:
        if key.startswith("objects/"):
            with self.lock:
                self.reads.append(self.read)
        data = self.inner.read_bytes(key)
        if key.startswith("objects/"):
            with self.lock:
                self.read += len(data)
        return data


UNIT = 64 << 10  # each tensor one object of 64 KiB in a store with small chunks


def _state(n: int = 24) -> dict:
    g = torch.Generator().manual_seed(0)
    return {f"t{i:02d}": torch.randn(UNIT // 4, generator=g) for i in range(n)}


def _small_chunks(root) -> None:
    from stepvault.format.settings import DEFAULT_STORE_SETTINGS

    settings = {**DEFAULT_STORE_SETTINGS, "chunk_size": UNIT, "small_tensor": UNIT // 2}
    Store.open(root, create=True, defaults=settings)


def _saved_and_opened() -> tuple:
    """A saved state in a memory:// store with small chunks, opened for reading (two
    verifier threads) through a CountingBackend: ``(state, backend, store, opened)``."""
    url = f"memory://sv-{uuid.uuid4().hex[:8]}"
    state = _state()
    _small_chunks(url)
    stepvault.save(url, state, run="r", step=1)
    backend = CountingBackend(url)
    store = Store(backend, Store.open(url).settings)  # type: ignore[arg-type]
    return state, backend, store, open_checkpoint(store, "r", 1, workers=2)


def test_a_tight_read_ahead_budget_completes_every_object_once_bitwise():
    """Reads run ahead of two verifiers within a budget of three objects, over a store
    that downloads (every byte held until verified). Before the budget was granted in
    order this deadlocked: later reads could fill it while the verifiers waited for an
    earlier object that could no longer be read."""
    state, backend, store, opened = _saved_and_opened()
    opened.reader.read_ahead = 3 * UNIT
    reported: list[int] = []
    done = threading.Thread(target=lambda: opened.verify_all(lambda d, t: reported.append(d)))
    done.start()
    done.join(timeout=120)
    assert not done.is_alive(), "the read pipeline deadlocked"
    objects = len(opened.manifest.objects)
    assert objects >= 20 and len(backend.reads) == objects  # each object read once
    assert reported == sorted(reported) and reported[-1] == sum(
        e.size for e in opened.manifest.objects.values()
    )
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    assert stepvault.restore(store, live, run="r").step == 1
    assert all(torch.equal(live[k], state[k]) for k in state)


def test_damage_stops_the_pipeline_and_places_nothing(tmp_path):
    state = _state(40)
    _small_chunks(tmp_path)
    stepvault.save(tmp_path, state, run="r", step=1)
    manifest = stepvault.open(tmp_path).manifest("r", 1)
    first = manifest.tensors["t00"].chunks[0][0]
    path = tmp_path / "objects" / first[:2] / first
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    before = threading.active_count()
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(stepvault.errors.IntegrityError):
        stepvault.restore(tmp_path, live, run="r", step=1, workers=2)
    assert all(float(v.abs().sum()) == 0 for v in live.values())
    assert threading.active_count() <= before  # readers and verifiers are gone


def test_reads_run_ahead_of_slow_verification_but_never_past_the_budget(monkeypatch):
    """The documented bound itself: with verification slowed down, the readers fill the
    read-ahead budget (they do run ahead) and never hold more than it: bytes read and not
    yet verified stay <= ``read_ahead``."""
    import time

    from stepvault.engine import fetch

    _, backend, _, opened = _saved_and_opened()
    limit = opened.reader.read_ahead = 4 * UNIT
    sizes = {d: e.size for d, e in opened.manifest.objects.items()}
    lock = threading.Lock()
    held, peak = [0], [0]
    real_read, real_fetch = backend.read_bytes, fetch.fetch_object

    def read_bytes(key: str) -> bytes:
        data = real_read(key)
        if key.startswith("objects/"):
            with lock:  # counted once read: the bytes now wait for a verifier
                held[0] += len(data)
                peak[0] = max(peak[0], held[0])
        return data

    def slow_fetch(store, digest, **kw):
        time.sleep(0.02)
        try:
            return real_fetch(store, digest, **kw)
        finally:
            with lock:
                held[0] -= sizes[digest]

    backend.read_bytes = read_bytes  # type: ignore[method-assign]
    monkeypatch.setattr(fetch, "fetch_object", slow_fetch)
    opened.verify_all()
    assert held[0] == 0
    assert 3 * UNIT <= peak[0] <= limit, (peak[0], limit)
