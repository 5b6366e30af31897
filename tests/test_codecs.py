"""Codecs (raw, zstd, float) and the object encoder: bit-exact round trips for every dtype."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from blake3 import blake3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepvault.errors import UnknownCodecError
from stepvault.format.codecs import (
    CODEC_CHOICES,
    CODECS,
    FloatCodec,
    choose_codec,
    get_codec,
)
from stepvault.format.dtypes import DTYPES, dtype_from_numpy, dtype_info
from stepvault.format.encoding import torch_dtype
from stepvault.format.objects import (
    MIN_GAIN_RATIO,
    decode_object,
    encode_object,
    parse_header,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: For tests parametrized over all ~19 dtypes x codecs: fewer examples each.
PER_DTYPE = settings(SETTINGS, max_examples=12)

#: Every format dtype this torch can hold.
TORCH_DTYPE_NAMES = [name for name in DTYPES if hasattr(torch, name)]
FLOAT_DTYPES = list(FloatCodec.SUPPORTED)

# Bit patterns worth having in every float test: signed zeros, infinities, quiet and
# signalling NaNs with several payloads and both signs, subnormals, extremes.
SPECIAL_BITS = {
    "float16": [
        0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0x7DFF, 0xFE00, 0xFFFF, 0x7FFF,
        0x0001, 0x03FF, 0x8001, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00,
    ],
    "bfloat16": [
        0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0x7FBF, 0xFFC0, 0xFFFF, 0x7FFF,
        0x0001, 0x007F, 0x8001, 0x807F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80,
    ],
    "float32": [
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,
        0x7FBFFFFF, 0xFFC00000, 0xFFFFFFFF, 0x7FFFFFFF, 0x7FC0DEAD, 0x00000001,
        0x007FFFFF, 0x80000001, 0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000,
    ],
}  # fmt: skip
_WORD = {2: (np.uint16, torch.uint16), 4: (np.uint32, torch.uint32)}


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The exact bytes of a tensor (little-endian host), for any dtype."""
    if t.numel() == 0:
        return b""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(raw, dtype: torch.dtype) -> torch.Tensor:
    data = bytearray(raw)
    if not data:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype)


def object_file(obj) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in obj.parts)


def codec_roundtrip(codec_id: str, raw: bytes, dtype: str | None) -> tuple[bytes, dict]:
    """Encode with ``codec_id`` (no fallback), JSON-round-trip the params, decode."""
    codec = get_codec(codec_id)
    parts, params = codec.encode(memoryview(raw), dtype)
    payload = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    params = json.loads(json.dumps(params))  # params travel in the JSON header
    out = codec.decode(memoryview(payload), len(raw), params)
    return bytes(memoryview(out).cast("B")), params


@st.composite
def tensors(draw, dtype_name: str, max_len: int = 300) -> torch.Tensor:
    """Tensors of ``dtype_name`` with arbitrary bit patterns (valid bools for bool)."""
    dtype = torch_dtype(dtype_name)
    if dtype_name == "bool":
        return torch.tensor(draw(st.lists(st.booleans(), max_size=max_len)), dtype=torch.bool)
    itemsize = dtype_info(dtype_name).itemsize
    n = draw(st.integers(0, max_len))
    raw = draw(st.binary(min_size=n * itemsize, max_size=n * itemsize))
    return tensor_from_bytes(raw, dtype)


@st.composite
def float_tensors(draw, dtype_name: str, max_len: int = 400) -> torch.Tensor:
    """Float tensors mixing special values, arbitrary bit patterns and weight-like values."""
    itemsize = dtype_info(dtype_name).itemsize
    np_word, torch_word = _WORD[itemsize]
    bits = st.one_of(
        st.sampled_from(SPECIAL_BITS[dtype_name]),
        st.integers(0, (1 << (8 * itemsize)) - 1),
    )
    words = draw(st.lists(bits, max_size=max_len))
    t = (
        torch.from_numpy(np.array(words, dtype=np_word))
        .view(torch_word)
        .view(torch_dtype(dtype_name))
    )
    if draw(st.booleans()):
        # Low-entropy exponents (the float codec's real use case) around the special values.
        seed = draw(st.integers(0, 2**32 - 1))
        gen = torch.Generator().manual_seed(seed)
        n = draw(st.integers(0, max_len))
        weights = (torch.randn(n, generator=gen) * 0.02).to(torch_dtype(dtype_name))
        t = torch.cat([weights, t])
    return t


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and tensor_bytes(a) == tensor_bytes(b)


# --- codec level -------------------------------------------------------------------------


def test_registry_and_choices():
    assert set(CODECS) == {"raw", "zstd", "float", "xor"}  # xor: deltas of cold tiers
    for cid in CODECS:
        assert get_codec(cid).id == cid
    for bad in ("lz4", "", "RAW", None, 3, ["raw"]):
        with pytest.raises(UnknownCodecError):
            get_codec(bad)
    assert CODEC_CHOICES == ("raw", "zstd", "float", "auto")
    for dt in FLOAT_DTYPES:
        assert choose_codec("auto", dt) == "float"
        assert choose_codec("float", dt) == "float"
    for dt in ("float64", "int32", "bool", "complex64", "float8_e4m3fn", None):
        assert choose_codec("auto", dt) == "zstd"
        assert choose_codec("float", dt) == "zstd"
        assert choose_codec("raw", dt) == "raw"
        assert choose_codec("zstd", dt) == "zstd"
    with pytest.raises(ValueError, match="codec must be one of"):
        choose_codec("lz4", "float32")


@pytest.mark.parametrize("dtype_name", TORCH_DTYPE_NAMES)
@pytest.mark.parametrize("codec_id", ["raw", "zstd"])
@PER_DTYPE
@given(data=st.data())
def test_generic_codecs_roundtrip_every_dtype(codec_id, dtype_name, data):
    t = data.draw(tensors(dtype_name))
    raw = tensor_bytes(t)
    out, params = codec_roundtrip(codec_id, raw, dtype_name)
    assert out == raw
    assert params == {}
    back = tensor_from_bytes(out, t.dtype)
    assert bits_equal(back, t)


@pytest.mark.parametrize("dtype_name", FLOAT_DTYPES)
@settings(SETTINGS, max_examples=80)
@given(data=st.data())
def test_float_codec_roundtrip_bit_exact(dtype_name, data):
    t = data.draw(float_tensors(dtype_name))
    raw = tensor_bytes(t)
    out, params = codec_roundtrip("float", raw, dtype_name)
    assert out == raw
    back = tensor_from_bytes(out, t.dtype)
    assert bits_equal(back, t)
    # NaNs stay NaNs at the same places, zeros keep their sign.
    assert torch.equal(torch.isnan(back), torch.isnan(t))
    assert torch.equal(torch.signbit(back), torch.signbit(t))
    # The stream table: exponent + sign/mantissa byte planes, sizes matching the payload.
    _, man_bits = dtype_info(dtype_name).float_bits
    assert params["dtype"] == dtype_name
    assert len(params["streams"]) == 1 + (man_bits + 1 + 7) // 8
    for spec in params["streams"]:
        assert spec["codec"] in ("raw", "zstd")
        if spec["codec"] == "raw":
            assert spec["size"] == t.numel()


@pytest.mark.parametrize("dtype_name", FLOAT_DTYPES)
def test_float_codec_every_special_value(dtype_name):
    itemsize = dtype_info(dtype_name).itemsize
    np_word, _ = _WORD[itemsize]
    words = np.array(SPECIAL_BITS[dtype_name] * 50, dtype=np_word)
    raw = words.tobytes()
    out, _ = codec_roundtrip("float", raw, dtype_name)
    assert np.array_equal(np.frombuffer(out, dtype=np_word), words)


def test_float_codec_all_float16_and_bfloat16_bit_patterns():
    words = np.arange(1 << 16, dtype=np.uint16)
    for dtype_name in ("float16", "bfloat16"):
        out, _ = codec_roundtrip("float", words.tobytes(), dtype_name)
        assert np.array_equal(np.frombuffer(out, dtype=np.uint16), words)


def test_float_codec_refuses_unsupported_input():
    codec = get_codec("float")
    for dt in ("float64", "int32", "bool", None, "float8_e4m3fn"):
        with pytest.raises(ValueError, match="float codec supports"):
            codec.encode(memoryview(bytes(16)), dt)
    with pytest.raises(ValueError, match="whole elements"):
        codec.encode(memoryview(bytes(7)), "float32")


# --- through the object format -----------------------------------------------------------


@pytest.mark.parametrize("dtype_name", TORCH_DTYPE_NAMES)
@pytest.mark.parametrize("codec_id", ["raw", "zstd", "auto"])
@PER_DTYPE
@given(data=st.data())
def test_objects_roundtrip_every_dtype(codec_id, dtype_name, data):
    t = data.draw(tensors(dtype_name))
    raw = tensor_bytes(t)
    chosen = choose_codec(codec_id, dtype_name)
    obj = encode_object(memoryview(raw), chosen, dtype_name)
    assert obj.digest == blake3(raw).hexdigest()
    assert obj.raw_size == len(raw)
    assert obj.codec in (chosen, "raw")
    f = object_file(obj)
    assert len(f) == obj.size
    header = parse_header(f)
    assert header.codec == obj.codec
    assert header.raw_size == len(raw)
    assert header.raw_blake3 == obj.digest
    assert header.payload_offset % 64 == 0  # raw payloads map as aligned tensors
    if obj.codec != "raw":
        assert obj.size - header.payload_offset <= MIN_GAIN_RATIO * len(raw)
    else:
        assert f[header.payload_offset :] == raw
    for verify in (True, False):
        out = decode_object(f, obj.digest, verify=verify)
        assert bytes(out) == raw
    assert bits_equal(tensor_from_bytes(bytes(out), t.dtype), t)


@pytest.mark.parametrize("dtype_name", FLOAT_DTYPES)
@SETTINGS
@given(data=st.data())
def test_float_objects_roundtrip(dtype_name, data):
    t = data.draw(float_tensors(dtype_name))
    raw = tensor_bytes(t)
    obj = encode_object(memoryview(raw), "float", dtype_name)
    assert obj.codec in ("float", "raw")
    f = object_file(obj)
    out = decode_object(f, obj.digest)
    assert bytes(out) == raw
    assert bits_equal(tensor_from_bytes(bytes(out), t.dtype), t)


@pytest.mark.parametrize("codec_id", ["zstd", "float"])
@SETTINGS
@given(raw=st.binary(min_size=64, max_size=4096).map(lambda b: b[: len(b) // 4 * 4]))
def test_incompressible_bytes_fall_back_to_raw(codec_id, raw):
    # Short arbitrary byte strings cannot be compressed by 5% (hypothesis' repetitive
    # blobs aside): the object then stores the bytes themselves.
    obj = encode_object(memoryview(raw), codec_id, "float32")
    f = object_file(obj)
    header = parse_header(f)
    if obj.codec == "raw":
        assert header.params == {}
        assert f[header.payload_offset :] == raw
    else:
        assert obj.size - header.payload_offset <= MIN_GAIN_RATIO * len(raw)
    assert bytes(decode_object(f, obj.digest)) == raw


@pytest.mark.parametrize("codec_id", ["zstd", "float"])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16", "float32"])
def test_random_bytes_come_back_as_raw(codec_id, dtype_name):
    raw = np.random.default_rng(1234).bytes(1 << 16)
    obj = encode_object(memoryview(raw), codec_id, dtype_name)
    assert obj.codec == "raw"
    f = object_file(obj)
    header = parse_header(f)
    assert header.codec == "raw"
    assert header.params == {}
    assert obj.size == header.payload_offset + len(raw)
    assert f[header.payload_offset :] == raw
    assert bytes(decode_object(f, obj.digest)) == raw


def test_compressible_data_is_compressed():
    raw = bytes(1 << 16)
    obj = encode_object(memoryview(raw), "zstd", None)
    assert obj.codec == "zstd"
    assert obj.size < 1024
    assert bytes(decode_object(object_file(obj), obj.digest)) == raw


def test_raw_decode_is_zero_copy():
    raw = bytes(range(256)) * 4
    obj = encode_object(memoryview(raw), "raw", "uint8")
    buf = bytearray(object_file(obj))
    out = decode_object(buf, obj.digest)
    assert bytes(out) == raw
    offset = parse_header(buf).payload_offset
    buf[offset] ^= 0xFF  # the returned view shares the caller's buffer
    assert out[0] == raw[0] ^ 0xFF


def test_empty_chunks_roundtrip():
    for codec_id in ("raw", "zstd", "float"):
        obj = encode_object(memoryview(b""), codec_id, "float32")
        f = object_file(obj)
        assert bytes(decode_object(f, obj.digest)) == b""


def test_explicit_digest_is_trusted_by_encoder_and_checked_by_decoder():
    raw = b"x" * 100
    digest = blake3(raw).hexdigest()
    obj = encode_object(memoryview(raw), "raw", None, digest)
    assert obj.digest == digest
    assert bytes(decode_object(object_file(obj), digest)) == raw


def test_noncontiguous_tensor_bytes_roundtrip():
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8).t()
    raw = tensor_bytes(t)
    obj = encode_object(memoryview(raw), "float", "float32")
    out = tensor_from_bytes(bytes(decode_object(object_file(obj), obj.digest)), torch.float32)
    assert torch.equal(out.reshape(8, 8), t.contiguous())


# --- compression ratio (sizes, never time) ------------------------------------------------


def _weight_like(dtype: torch.dtype, n: int = 1 << 18) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(n, generator=gen) * 0.02).to(dtype)


@pytest.mark.parametrize(
    ("dtype_name", "limit"),
    [("bfloat16", 0.75), ("float32", 0.9), ("float16", 0.95)],
)
def test_float_codec_ratio_on_weight_like_tensor(dtype_name, limit):
    t = _weight_like(torch_dtype(dtype_name))
    raw = tensor_bytes(t)
    obj = encode_object(memoryview(raw), "float", dtype_name)
    assert obj.codec == "float"
    ratio = obj.size / obj.raw_size  # header included
    assert ratio < limit
    header = parse_header(object_file(obj))
    # The exponent stream is where the gain is.
    assert header.params["streams"][0]["codec"] == "zstd"
    assert header.params["streams"][0]["size"] < 0.5 * t.numel()
    # And it beats plain zstd on the same bytes.
    zobj = encode_object(memoryview(raw), "zstd", dtype_name)
    assert obj.size < zobj.size
    assert bytes(decode_object(object_file(obj), obj.digest)) == raw


def test_dtype_table_consistency():
    for name, info in DTYPES.items():
        assert dtype_info(name) is info
        if info.numpy:
            assert np.dtype(info.numpy).itemsize == info.itemsize
            assert dtype_from_numpy(np.dtype(info.numpy)) == name
            assert dtype_from_numpy(np.dtype(info.numpy).newbyteorder(">")) == name
        if info.float_bits:
            exp_bits, man_bits = info.float_bits
            assert 1 + exp_bits + man_bits == 8 * info.itemsize
        if hasattr(torch, name):
            assert torch_dtype(name).itemsize == info.itemsize
    assert dtype_from_numpy(np.dtype(object)) is None
    assert dtype_from_numpy(np.dtype("U3")) is None
    with pytest.raises(ValueError, match="unsupported dtype"):
        dtype_info("float128")
    with pytest.raises(ValueError, match="unsupported dtype"):
        dtype_info(["float32"])
