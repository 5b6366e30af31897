"""Issue 13 (restore half): verify-then-place on the parallel path, zero-copy loads
(``load(mmap=True)``) and ``restore(assign=True)``."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import flip_byte, object_path

import stepvault
from stepvault.engine import copying, fetch
from stepvault.errors import CorruptObjectError, IntegrityError
from stepvault.store import Store

CHUNK = 64 << 10  # small chunks: several objects per tensor, a "last chunk" to damage


def _store(root) -> Store:
    settings = {"chunk_size": CHUNK, "small_tensor": 16 << 10, "bundle_size": CHUNK}
    return Store.open(root, create=True, defaults={**settings, "codec": "raw"})


def _file_bytes(root, digest: str) -> bytes:
    with open(object_path(root, digest), "rb") as f:
        return f.read()


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(128, 256)  # 128 KiB weight: two chunks
        self.b = torch.nn.Linear(256, 64)
        self.register_buffer("scale", torch.ones(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * self.scale


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value.detach().clone()]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _snapshot(state):
    """Every tensor of the live modules and optimizers (parameters, moments), cloned."""
    return {k: _tensors(v.state_dict()) for k, v in state.items()}


def test_damaged_last_chunk_leaves_live_state_unchanged_on_parallel_path(tmp_path, monkeypatch):
    # Every host copy goes through the thread pool, in pieces, as a large restore does.
    monkeypatch.setattr(copying, "PARALLEL_FROM", 0)
    monkeypatch.setattr(copying, "PIECE", 16 << 10)
    _store(tmp_path)
    torch.manual_seed(0)
    saved = {"model": Net(), "opt": None}
    saved["opt"] = torch.optim.AdamW(saved["model"].parameters())
    saved["model"](torch.randn(4, 128)).sum().backward()
    saved["opt"].step()
    stepvault.save(tmp_path, saved, run="r", step=1)
    with torch.no_grad():
        for p in saved["model"].parameters():
            p.add_(1.0)
    saved["opt"].step()
    stepvault.save(tmp_path, saved, run="r", step=2)

    m2 = stepvault.open(tmp_path).manifest("r", 2)
    m1 = stepvault.open(tmp_path).manifest("r", 1)
    # The last object step 2 names (the last chunk read) and only step 2 has.
    last = [d for t in m2.tensors.values() for d, _, _ in t.chunks][-1]
    assert last not in set(m1.objects)
    flip_byte(object_path(tmp_path, last))

    torch.manual_seed(1)
    live = {"model": Net()}
    live["opt"] = torch.optim.AdamW(live["model"].parameters())
    live["model"](torch.randn(4, 128)).sum().backward()
    live["opt"].step()  # live moments that a failed restore must not touch either
    before = _snapshot(live)
    assert len(before["opt"]) == 3 * len(list(live["model"].parameters()))  # step, m, v
    with pytest.raises(IntegrityError):
        stepvault.restore(tmp_path, live, run="r", step=2)
    after = _snapshot(live)
    for key in before:
        assert len(before[key]) == len(after[key])
        for x, y in zip(before[key], after[key]):
            assert torch.equal(x, y) and x.dtype == y.dtype  # bitwise unchanged

    # "latest" falls back past the damaged step to step 1, as before.
    info = stepvault.restore(tmp_path, live, run="r")
    assert info.step == 1 and [s.step for s in info.skipped] == [2]
    assert torch.equal(
        live["model"].a.weight, stepvault.open(tmp_path).checkpoint("r", 1).tensor("model/a.weight")
    )


@pytest.fixture
def stored(tmp_path):
    _store(tmp_path)
    torch.manual_seed(0)
    state = {
        "big": torch.randn(100_000),  # 400 KB: several chunks (assembled into fresh memory)
        "one": torch.randn(8_000),  # 32 KB: one object of its own (mapped)
        "small": torch.randn(10),  # bundled with others (mapped inside the bundle)
        "ids": torch.arange(5),
    }
    stepvault.save(tmp_path, state, run="r", step=1)
    return tmp_path, state


def test_mmap_load_equals_regular_load_and_maps_single_object_tensors(stored):
    root, state = stored
    ckpt = stepvault.open(root).checkpoint("r", 1)
    mapped = ckpt.load(mmap=True)
    regular = stepvault.open(root).checkpoint("r", 1).load()
    for k, v in state.items():
        assert mapped[k].dtype == regular[k].dtype == v.dtype
        assert torch.equal(mapped[k], regular[k]) and torch.equal(mapped[k], v)
    # Zero-copy where the bytes are one raw object: the tensor's memory is that object's
    # mapping; the default load gives memory of its own (no file behind it).
    digest = ckpt.manifest.tensors["one"].chunks[0][0]
    assert _mapped_file(mapped["one"]).endswith(digest)
    assert _mapped_file(mapped["small"]).endswith(ckpt.manifest.tensors["small"].chunks[0][0])
    assert _mapped_file(regular["one"]) is None
    assert _mapped_file(mapped["big"]) is None  # several chunks: assembled, fresh memory


def _mapped_file(t: torch.Tensor) -> str | None:
    """The file mapped at ``t``'s memory (from /proc/self/maps), None for anonymous memory."""
    ptr = t.untyped_storage().data_ptr()
    with open(f"/proc/{os.getpid()}/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return fields[5] if len(fields) > 5 and fields[5].startswith("/") else None
    return None


def test_writing_a_mapped_tensor_never_changes_the_store(stored):
    root, state = stored
    ckpt = stepvault.open(root).checkpoint("r", 1)
    loaded = ckpt.load(mmap=True)
    digests = sorted(ckpt.manifest.objects)
    files = {d: _file_bytes(root, d) for d in digests}
    for t in loaded.values():
        t.add_(7)  # copy-on-write: private pages, the files stay as they were
    assert {d: _file_bytes(root, d) for d in digests} == files
    assert stepvault.ops.verify(root, deep=True).ok
    again = stepvault.open(root).checkpoint("r", 1).load(mmap=True)
    for k, v in state.items():
        assert torch.equal(again[k], v)


def test_mmap_load_never_hands_out_a_damaged_object(stored):
    root, _ = stored
    digest = stepvault.open(root).manifest("r", 1).tensors["one"].chunks[0][0]
    flip_byte(object_path(root, digest))
    ckpt = stepvault.open(root).checkpoint("r", 1)
    with pytest.raises(CorruptObjectError, match=r"does not match its (hash|checksum)"):
        ckpt.tensor("one", mmap=True)
    with pytest.raises(CorruptObjectError):
        stepvault.open(root).checkpoint("r", 1).load(mmap=True)
    # Tensors in other, sound objects are still readable on their own.
    assert ckpt.tensor("big", mmap=True).shape == (100_000,)


def test_restore_assign_gives_mapped_parameters_that_train(tmp_path):
    _store(tmp_path)
    torch.manual_seed(0)
    trained = Net()
    stepvault.save(tmp_path, {"model": trained}, run="r", step=1)
    files = {d: _file_bytes(tmp_path, d) for d in stepvault.open(tmp_path).manifest("r", 1).objects}

    model = Net()
    old_weight = model.b.weight
    stepvault.restore(tmp_path, {"model": model}, run="r", assign=True)
    assert model.b.weight is not old_weight  # assigned, not copied into
    assert isinstance(model.b.weight, torch.nn.Parameter) and model.b.weight.requires_grad
    for (k, v), (k2, w) in zip(model.state_dict().items(), trained.state_dict().items()):
        assert k == k2 and torch.equal(v, w)
    # b.weight (64 KB) is one object of its own: its memory is that object's mapping.
    assert "/objects/" in (_mapped_file(model.b.weight) or "")

    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # created after the restore
    before = model.b.weight.detach().clone()
    model(torch.randn(4, 128)).sum().backward()
    opt.step()
    assert not torch.equal(model.b.weight, before)  # the mapped parameter trained
    assert {d: _file_bytes(tmp_path, d) for d in files} == files
    assert stepvault.ops.verify(tmp_path, deep=True).ok


def test_restore_assign_keeps_tied_parameters_tied(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(300, 64)
            self.head = torch.nn.Linear(64, 300, bias=False)
            self.head.weight = self.emb.weight

    torch.manual_seed(0)
    stepvault.save(tmp_path, {"model": Tied()}, run="r", step=1)
    model = Tied()
    stepvault.restore(tmp_path, {"model": model}, run="r", assign=True)
    assert model.head.weight is model.emb.weight


def test_restore_assign_on_damage_changes_nothing(tmp_path):
    _store(tmp_path)
    torch.manual_seed(0)
    stepvault.save(tmp_path, {"model": Net()}, run="r", step=1)
    m = stepvault.open(tmp_path).manifest("r", 1)
    flip_byte(object_path(tmp_path, [d for t in m.tensors.values() for d, _, _ in t.chunks][-1]))
    model = Net()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    with pytest.raises(IntegrityError):
        stepvault.restore(tmp_path, {"model": model}, run="r", step=1, assign=True)
    assert all(p is q for p, q in zip(params, model.parameters()))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_manager_restore_passes_assign_through(tmp_path):
    torch.manual_seed(0)
    trained = Net()
    with stepvault.CheckpointManager(tmp_path, run="r", async_save=False) as mgr:
        mgr.save(1, {"model": trained}, force=True)
    model = Net()
    old = model.a.weight
    with stepvault.CheckpointManager(tmp_path, run="r") as mgr:
        info = mgr.restore({"model": model}, assign=True)
    assert info.step == 1 and model.a.weight is not old
    assert torch.equal(model.a.weight, trained.a.weight)


def _segments_store(root) -> Store:
    # One 16 MiB object per large tensor, small tensors bundled 4 MiB at a time, raw.
    settings = {"chunk_size": 16 << 20, "small_tensor": 1 << 20, "bundle_size": 4 << 20}
    return Store.open(root, create=True, defaults={**settings, "codec": "raw"})


def _segment_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        # 13 segments of 1 MiB, the last one short: a read shares its checks between threads
        "big": torch.randn(3_276_801, generator=g),
        # one float32 bundle: 700 kB tensors at offsets that are not segment multiples, so
        # "b1" spans the boundary between segments 0 and 1
        "b0": torch.randn(175_000, generator=g),
        "b1": torch.randn(175_000, generator=g),
        "b2": torch.randn(175_000, generator=g),
        # other dtypes (bundled per dtype): views of their stored bytes
        "i8": torch.randint(-128, 127, (700_000,), dtype=torch.int8, generator=g),
        "h": torch.randn(350_000, generator=g).to(torch.bfloat16),
    }


def _flip_raw(root, digest: str, raw_at: int) -> None:
    """Flip one bit of an object's raw (payload) byte ``raw_at``."""
    from stepvault.format.objects import parse_header

    path = object_path(root, digest)
    with open(path, "rb") as f:
        at = parse_header(f.read(1 << 16)).payload_offset + raw_at
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("segment", [0, 6, 12])
def test_a_large_one_tensor_read_finds_damage_in_any_segment_it_checks(
    tmp_path, monkeypatch, segment
):
    """A 13-segment tensor read with ``mmap=True``: its segment checks are shared between
    the calling thread and pool threads; damage in the first, a middle or the last
    (short) segment is found and named, whichever thread checked it."""
    # Helpers join whatever the machine's load (they stand aside when no core is idle).
    monkeypatch.setattr(fetch, "idle_cores", lambda: 4)
    _segments_store(tmp_path)
    state = _segment_state()
    stepvault.save(tmp_path, state, run="r", step=1)
    ckpt = stepvault.open(tmp_path).checkpoint("r", 1)
    assert torch.equal(ckpt.tensor("big", mmap=True), state["big"])
    (digest, off, length), *more = ckpt.manifest.tensors["big"].chunks
    assert not more and off == 0 and -(-length // (1 << 20)) == 13
    _flip_raw(tmp_path, digest, min(segment * (1 << 20) + 12345, length - 1))
    with pytest.raises(CorruptObjectError, match=f"checksum of segment {segment} differs"):
        stepvault.open(tmp_path).checkpoint("r", 1).tensor("big", mmap=True)
    with pytest.raises(IntegrityError):
        stepvault.open(tmp_path).checkpoint("r", 1).load(mmap=True)


def test_one_tensor_reads_of_a_bundle_check_the_segments_they_span(tmp_path):
    """Tensors in one bundle, one spanning a segment boundary, and bundles of other
    dtypes: each reads bitwise; damage in segment 1 refuses exactly the tensors whose
    bytes lie in it (the one spanning the boundary included) and no other."""
    _segments_store(tmp_path)
    state = _segment_state()
    stepvault.save(tmp_path, state, run="r", step=1)
    manifest = stepvault.open(tmp_path).manifest("r", 1)
    chunks = {k: manifest.tensors[k].chunks[0] for k in ("b0", "b1", "b2")}
    assert len({d for d, _, _ in chunks.values()}) == 1  # one bundle object
    _, off1, len1 = chunks["b1"]
    assert off1 < (1 << 20) < off1 + len1  # "b1" spans segments 0 and 1
    ckpt = stepvault.open(tmp_path).checkpoint("r", 1)
    for name in state:
        got = ckpt.tensor(name, mmap=True)
        assert got.dtype == state[name].dtype and torch.equal(got, state[name])
    digest = chunks["b1"][0]
    _flip_raw(tmp_path, digest, (1 << 20) + 10)  # in segment 1, inside "b1"
    in_segment_1 = {
        name for name, (_, off, n) in chunks.items() if off < (2 << 20) and off + n > (1 << 20)
    }
    assert "b1" in in_segment_1 and "b0" not in in_segment_1
    for name in chunks:
        ckpt = stepvault.open(tmp_path).checkpoint("r", 1)
        if name in in_segment_1:
            with pytest.raises(CorruptObjectError, match="checksum of segment 1 differs"):
                ckpt.tensor(name, mmap=True)
        else:
            assert torch.equal(ckpt.tensor(name, mmap=True), state[name])


def test_two_tensors_sharing_one_object_read_apart_and_are_refused_together(tmp_path):
    """Equal tensors are stored once (one object, two manifest entries): read one at a
    time with ``mmap=True`` from the same checkpoint they never alias, and damage in that
    object refuses both reads and a restore, which then changes no live tensor."""
    _segments_store(tmp_path)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(2_500_000, generator=g)  # 10 MB: 10 segments, one object
    state = {"a": w.clone(), "b": w.clone()}
    stepvault.save(tmp_path, state, run="r", step=1)
    manifest = stepvault.open(tmp_path).manifest("r", 1)
    assert manifest.tensors["a"].chunks == manifest.tensors["b"].chunks
    ckpt = stepvault.open(tmp_path).checkpoint("r", 1)
    a, b = ckpt.tensor("a", mmap=True), ckpt.tensor("b", mmap=True)
    assert torch.equal(a, w) and torch.equal(b, w)
    a[0] += 1.0  # writing one never shows in the other
    assert torch.equal(b, w)
    _flip_raw(tmp_path, manifest.tensors["a"].chunks[0][0], 9 * (1 << 20) + 7)
    for name in ("a", "b"):
        with pytest.raises(CorruptObjectError, match="checksum of segment 9 differs"):
            stepvault.open(tmp_path).checkpoint("r", 1).tensor(name, mmap=True)
    live = {"a": torch.zeros_like(w), "b": torch.zeros_like(w)}
    with pytest.raises(IntegrityError):
        stepvault.restore(tmp_path, live, run="r", step=1)
    assert not live["a"].any() and not live["b"].any()
