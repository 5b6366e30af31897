"""The lossless xor delta codec of cold tiers: bitwise round trips, chain bounds, missing
bases (clear errors, restore through another tier's copy), GC keeping every base a kept
delta needs (randomized, seeded), and a tier move restored from the cold tier alone."""

from __future__ import annotations

import random

import pytest
import torch

import stepvault
from stepvault import ops
from stepvault.engine import fetch_object
from stepvault.engine.gc import sweep
from stepvault.errors import CorruptObjectError, UnknownCodecError
from stepvault.format import codecs as codecs_mod
from stepvault.format import parse_manifest
from stepvault.format.codecs import choose_codec
from stepvault.format.encoding import torch_dtype_name
from stepvault.format.hashing import content_hash
from stepvault.format.objects import decode_object, encode_object, frame_object, parse_header
from stepvault.format.xor_codec import MissingBaseError, chain_limit, chain_of, encode_xor
from stepvault.store import Store
from stepvault.tiers import Tiers, TierSpec, add_tier, copy_checkpoint
from stepvault.tiers.config import TierError

SMALL = {"chunk_size": 16384, "small_tensor": 2048, "bundle_size": 8192}


def raw_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def delta_object(new: torch.Tensor, base: torch.Tensor, chain_tail=()):
    raw, base_raw = raw_of(new), raw_of(base)
    bdigest = content_hash(base_raw)
    parts, params = encode_xor(raw, base_raw, [bdigest, *chain_tail], torch_dtype_name(new.dtype))
    digest = content_hash(raw)
    obj = frame_object(digest, "xor", raw.nbytes, params, parts)
    return digest, b"".join(bytes(memoryview(p).cast("B")) for p in obj.parts), bdigest


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8]
)
def test_xor_object_round_trips_bitwise(dtype):
    g = torch.Generator().manual_seed(1)
    if dtype.is_floating_point:
        base = torch.randn(5000, generator=g).to(dtype)
        new = (base.float() - 1e-3 * torch.randn(5000, generator=g)).to(dtype)
        new[7] = float("nan")  # odd values survive bit for bit
        new[8] = float("-inf")
    else:
        base = torch.randint(-100, 100, (5000,), generator=g).to(dtype)
        new = base.clone()
        new[::97] += 1
    digest, data, bdigest = delta_object(new, base)
    name = torch_dtype_name(dtype)
    plain = encode_object(raw_of(new), choose_codec("auto", name), name)
    assert len(data) < plain.size  # unchanged bits cost almost nothing
    base_bytes = bytes(raw_of(base))

    def base_reader(d, max_chain):
        assert d == bdigest and max_chain == 0
        return memoryview(base_bytes)

    out = decode_object(data, digest, base=base_reader)
    assert bytes(out) == bytes(raw_of(new))
    # No base: a clear error naming the delta and its base, never wrong bytes.
    with pytest.raises(MissingBaseError, match="xor delta against") as err:
        decode_object(data, digest)
    assert err.value.digest == digest
    # A wrong base decodes to other bytes: the hash check refuses them.
    other = bytes(raw_of(torch.zeros_like(base)))
    with pytest.raises(CorruptObjectError, match="does not match its hash"):
        decode_object(data, digest, base=lambda d, m: memoryview(other))


def test_a_header_cannot_make_a_reader_follow_a_loop():
    base = torch.arange(4096, dtype=torch.float32)
    new = base + 1
    digest, data, _ = delta_object(new, base)
    # A hostile header naming itself as its own base: each base must have a shorter chain.
    h = parse_header(data)
    params = dict(h.params, chain=[digest])
    looped = frame_object(digest, "xor", h.raw_size, params, [data[h.payload_offset :]])
    blob = b"".join(bytes(memoryview(p)) for p in looped.parts)

    def reader(d, max_chain):
        return decode_object(blob, d, base=reader, max_chain=max_chain)

    with pytest.raises(CorruptObjectError, match="at most 0 may follow"):
        decode_object(blob, digest, base=reader)


def test_a_reader_without_the_xor_codec_fails_clearly(monkeypatch):
    digest, data, _ = delta_object(torch.ones(1024), torch.zeros(1024))
    # What a stepvault that predates the codec does: the registry lacks it.
    monkeypatch.delitem(codecs_mod.CODECS, "xor")
    with pytest.raises(UnknownCodecError, match=r"unknown codec 'xor'.*newer stepvault"):
        decode_object(data, digest, base=lambda d, m: memoryview(bytes(4096)))


def test_tier_codec_setting_is_checked(tmp_path):
    assert chain_limit("xor") == 8 and chain_limit("xor:3") == 3 and chain_limit("auto") is None
    hot = Store.open(tmp_path / "hot", create=True)
    add_tier(hot, TierSpec("cold", str(tmp_path / "c"), codec="xor:4"))
    with pytest.raises(TierError, match="xor:K"):
        add_tier(hot, TierSpec("bad", str(tmp_path / "b"), codec="xor:0"))
    with pytest.raises(TierError, match="xor:K"):
        add_tier(hot, TierSpec("bad", str(tmp_path / "b"), codec="xor:100"))


# ------------------------------------------------------------------ real AdamW training


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(48, 64)
        self.b = torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _flat(net, opt) -> dict[str, torch.Tensor]:
    flat = {f"model/{k}": v.detach().clone() for k, v in net.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            flat[f"optim/{i}/{k}"] = v.detach().clone()
    return flat


def stores(tmp_path, codec="xor:3"):
    hot = Store.open(tmp_path / "hot", create=True, defaults=SMALL)
    add_tier(hot, TierSpec("cold", str(tmp_path / "cold"), codec=codec))
    return hot, Tiers.of(hot)


def save_run(hot, tiers, steps, dtype=torch.float32, tier="cold"):
    """Train, save every step to hot and copy it to ``tier``; the exact states by step."""
    exact = {}
    torch.manual_seed(5)
    net = Net().to(dtype)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x, y = torch.randn(32, 48, dtype=dtype), torch.randn(32, 8, dtype=dtype)
    for step in range(1, steps + 1):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x).float(), y.float()).backward()
        opt.step()
        stepvault.save(hot, {"model": net, "optim": opt}, run="r", step=step)
        copy_checkpoint(hot, tiers[tier], "r", step, codec=tiers.spec(tier).codec)
        exact[step] = _flat(net, opt)
    return exact


def cold_tensors(store: Store, step: int) -> dict[str, torch.Tensor]:
    ck = stepvault.open(store).checkpoint("r", step)
    return {k: ck.tensor(k) for k in ck.tensor_names()}


def chains(store: Store, step: int) -> dict[str, int]:
    """Object -> chain length (0: plain) of the objects the tensors of ``step`` use."""
    m = parse_manifest(store.read_manifest("r", step), f"r@{step}")
    out = {}
    for entry in m.tensors.values():
        for digest, _, _ in entry.chunks:
            head = parse_header(store.read_object(digest))
            out[digest] = len(head.params["chain"]) if head.codec == "xor" else 0
    return out


def flat_restore(root, step):
    """Restore ``r@step`` into a fresh model+optimizer, as a user would, and flatten it."""
    torch.manual_seed(99)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    stepvault.restore(root, {"model": net, "optim": opt}, run="r", step=step)
    return _flat(net, opt)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
        if a[k].numel()
    )


def test_tier_move_with_xor_then_restore_from_the_cold_tier_only(tmp_path):
    hot, tiers = stores(tmp_path, "xor:3")
    exact = save_run(hot, tiers, 10)
    cold = tiers["cold"]
    first = chains(cold, 1)
    assert set(first.values()) == {0}  # the first checkpoint has no base: all plain
    depth = {s: max(chains(cold, s).values()) for s in range(2, 11)}
    assert all(1 <= d <= 3 for d in depth.values())  # deltas from the 2nd on, chain <= K
    assert 0 in chains(cold, 5).values()  # the bound reached: plain objects again
    # Every manifest lists the bases its deltas need (GC marks from manifests).
    for s in range(1, 11):
        m = parse_manifest(cold.read_manifest("r", s), f"r@{s}")
        for digest in m.objects:
            head = parse_header(cold.read_object(digest))
            if head.codec == "xor":
                assert set(head.params["chain"]) <= set(m.objects)
    # Smaller than the best plain encoding of the same checkpoints.
    plain_root = tmp_path / "plain"
    plain = Store.open(plain_root, create=True, defaults=SMALL)
    for s in range(1, 11):
        copy_checkpoint(hot, plain, "r", s, codec="auto")
    assert ops.usage(tmp_path / "cold").stored_bytes < ops.usage(plain_root).stored_bytes
    assert ops.verify(tmp_path / "cold", deep=True).ok
    # The cold tier alone (no hot store at all), the first save and the tenth.
    for s in (1, 2, 5, 10):
        assert same(flat_restore(tmp_path / "cold", s), exact[s]), s
    assert same(cold_tensors(cold, 10), cold_tensors(hot, 10))


def test_bf16_training_states_round_trip_through_an_xor_tier(tmp_path):
    hot, tiers = stores(tmp_path, "xor")
    save_run(hot, tiers, 4, dtype=torch.bfloat16)
    cold = tiers["cold"]
    assert max(chains(cold, 4).values()) >= 1
    for s in (1, 4):
        a, b = cold_tensors(cold, s), cold_tensors(hot, s)
        assert same(a, b)


def test_a_missing_base_is_reported_and_another_tiers_copy_is_used(tmp_path):
    hot = Store.open(tmp_path / "hot", create=True, defaults=SMALL)
    add_tier(hot, TierSpec("deltas", str(tmp_path / "c1"), codec="xor"))
    add_tier(hot, TierSpec("plain", str(tmp_path / "c2"), codec="auto"))
    tiers = Tiers.of(hot)
    exact = save_run(hot, tiers, 2, tier="deltas")
    copy_checkpoint(hot, tiers["plain"], "r", 2, codec="auto")
    d = tiers["deltas"]
    delta = next(h for h, n in chains(d, 2).items() if n)
    base = parse_header(d.read_object(delta)).params["chain"][0]
    # Hot empty (evicted everywhere), the base gone from the delta tier.
    for s in (1, 2):
        hot.delete_manifest("r", s)
    sweep(hot, grace_seconds=0)
    d.delete_object(base)
    with pytest.raises(MissingBaseError, match=r"whose base .* cannot be read"):
        fetch_object(d, delta)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    info = stepvault.restore(tmp_path / "hot", {"model": net, "optim": opt}, run="r", step=2)
    # Reported (and that copy set aside), then the same step read from the other tier.
    assert info.step == 2 and "base" in info.skipped[0].reason
    assert same(_flat(net, opt), exact[2])


def test_gc_keeps_every_base_a_kept_delta_needs_randomized(tmp_path):
    rng = random.Random(1234)
    hot, tiers = stores(tmp_path, "xor:3")
    cold = tiers["cold"]
    torch.manual_seed(3)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x, y = torch.randn(32, 48), torch.randn(32, 8)
    exact: dict[int, dict] = {}
    for step in range(1, 19):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        stepvault.save(hot, {"model": net, "optim": opt}, run="r", step=step)
        copy_checkpoint(hot, cold, "r", step, codec="xor:3")
        exact[step] = cold_tensors(hot, step)
        # Drop random older checkpoints from the cold tier, then sweep with no grace.
        for old in cold.list_steps("r")[:-1]:
            if rng.random() < 0.35:
                cold.delete_manifest("r", old)
        report = sweep(cold, grace_seconds=0)
        assert not report.unreadable_manifests
        for kept in cold.list_steps("r"):
            assert same(cold_tensors(cold, kept), exact[kept]), (step, kept)
    assert ops.verify(tmp_path / "cold", deep=True).ok
    assert any(n for s in cold.list_steps("r") for n in chains(cold, s).values())


def test_a_byte_for_byte_copy_that_reuses_deltas_lists_their_bases(tmp_path):
    hot, tiers = stores(tmp_path, "xor")
    cold = tiers["cold"]
    save_run(hot, tiers, 3)
    # Another run with the very same state as r@3 (e.g. a fork): copied as stored.
    ck = stepvault.open(hot).checkpoint("r", 3)
    same_state = {k: ck.tensor(k) for k in ck.tensor_names()}
    stepvault.save(hot, {"state": same_state}, run="fork", step=3)
    fork = parse_manifest(hot.read_manifest("fork", 3), "fork@3")
    reused = [d for d in fork.objects if cold.has_object(d)]
    assert any(parse_header(cold.read_object(d)).codec == "xor" for d in reused)
    copy_checkpoint(hot, cold, "fork", 3, codec="keep")
    listed = parse_manifest(cold.read_manifest("fork", 3), "fork@3").objects
    assert set(fork.objects) < set(listed)  # the bases of the reused deltas came along
    # The original run gone from the tier: GC keeps what the fork's deltas need.
    for s in cold.list_steps("r"):
        cold.delete_manifest("r", s)
    assert sweep(cold, grace_seconds=0).deleted  # something was collected...
    ck2 = stepvault.open(cold).checkpoint("fork", 3)
    got = {k: ck2.tensor(k) for k in ck2.tensor_names()}
    # ...but no base it needs (names gain the "state/" prefix of the fork's save)
    assert same(got, {f"state/{k.replace('/', '%2F')}": v for k, v in same_state.items()})


def test_a_save_straight_into_a_delta_tier_lists_the_bases_it_reuses(tmp_path):
    hot, tiers = stores(tmp_path, "xor")
    cold = tiers["cold"]
    save_run(hot, tiers, 3)
    # The same state as r@3 saved straight into the cold tier's store (not a tier copy):
    # its chunks are r@3's delta objects there, reused by content hash.
    ck = stepvault.open(hot).checkpoint("r", 3)
    same_state = {k: ck.tensor(k) for k in ck.tensor_names()}
    stepvault.save(tmp_path / "cold", {"state": same_state}, run="direct", step=1)
    direct = parse_manifest(cold.read_manifest("direct", 1), "direct@1").objects
    deltas = [d for d, e in direct.items() if e.codec == "xor"]
    assert deltas  # the save did reuse deltas...
    chain = {h for d in deltas for h in chain_of(parse_header(cold.read_object(d)).params)}
    assert chain and chain <= set(direct)  # ...and its table lists every base they need
    for s in cold.list_steps("r"):
        cold.delete_manifest("r", s)
    assert sweep(cold, grace_seconds=0).deleted
    ck2 = stepvault.open(cold).checkpoint("direct", 1)
    got = {k: ck2.tensor(k) for k in ck2.tensor_names()}
    assert same(got, {f"state/{k.replace('/', '%2F')}": v for k, v in same_state.items()})
