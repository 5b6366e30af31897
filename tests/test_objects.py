"""Object files under damage: truncation, bit flips, hostile headers, decompression bombs."""

from __future__ import annotations

import json
import struct
import tracemalloc

import numpy as np
import pytest
import torch
import zstandard
from blake3 import blake3
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from stepvault.errors import (
    CorruptObjectError,
    IntegrityError,
    StepvaultError,
    StoreVersionError,
    UnknownCodecError,
)
from stepvault.format.objects import (
    MAGIC,
    MAX_HEADER,
    MAX_RAW_SIZE,
    OBJECT_FORMAT_VERSION,
    decode_object,
    encode_object,
    parse_header,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALLOWED = (IntegrityError, StoreVersionError)
_PREFIX = struct.Struct("<4sHHI")


def object_file(obj) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in obj.parts)


def build(header: dict | bytes, payload: bytes = b"", *, magic=MAGIC, version=1, hlen=None):
    """An object file from a header (dict or raw JSON bytes) and a payload, by hand."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * ((-(_PREFIX.size + len(text))) % 64)
    size = len(text) if hlen is None else hlen
    return _PREFIX.pack(magic, version, 0, size) + text + payload


def zstd_frame_declaring(size: int, block: bytes = b"") -> bytes:
    """A hand-made single-segment zstd frame whose header declares ``size`` content bytes,
    followed by one last raw block holding ``block`` (so the frame really is tiny)."""
    fhd = 0xE0  # FCS field of 8 bytes, single segment, no checksum, no dictionary
    block_header = (1 | (0 << 1) | (len(block) << 3)).to_bytes(3, "little")
    return struct.pack("<IBQ", 0xFD2FB528, fhd, size) + block_header + block


def _weights(dtype: torch.dtype, n: int) -> bytes:
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(n, generator=gen) * 0.02).to(dtype).view(torch.uint8).numpy().tobytes()


# Small objects of every encoding, each with the codec it really ended up with.
SAMPLES = {
    "raw": (b"stepvault!" * 30, "raw", None),
    "zstd": ((np.arange(600, dtype="<i4") % 7).tobytes(), "zstd", "int32"),
    "float-bf16": (_weights(torch.bfloat16, 700), "float", "bfloat16"),
    "float-fp32": (_weights(torch.float32, 300), "float", "float32"),
    "float-fp16": ((np.arange(2000) % 5).astype("<f2").tobytes(), "float", "float16"),
}


def sample(name: str):
    raw, codec, dtype = SAMPLES[name]
    obj = encode_object(memoryview(raw), codec, dtype)
    assert obj.codec == codec, "the sample must exercise its codec, not the raw fallback"
    return raw, obj.digest, object_file(obj)


@pytest.mark.parametrize("name", SAMPLES)
def test_sample_objects_decode(name):
    raw, digest, f = sample(name)
    assert bytes(decode_object(f, digest)) == raw
    assert bytes(decode_object(memoryview(f), digest)) == raw
    assert bytes(decode_object(bytearray(f), digest)) == raw


@pytest.mark.parametrize("name", SAMPLES)
def test_every_truncation_is_corrupt(name):
    _, digest, f = sample(name)
    for n in range(len(f)):
        with pytest.raises(CorruptObjectError):
            decode_object(f[:n], digest)
        if n < parse_header(f).payload_offset:
            with pytest.raises(CorruptObjectError):
                parse_header(f[:n])


@pytest.mark.parametrize("name", SAMPLES)
def test_trailing_garbage_never_returns_wrong_data(name):
    raw, digest, f = sample(name)
    for extra in (b"\x00", b"garbage", bytes(64)):
        try:
            out = decode_object(f + extra, digest)
        except CorruptObjectError:
            continue
        assert bytes(out) == raw


@pytest.mark.parametrize("name", SAMPLES)
def test_payload_bit_flips_never_return_wrong_data(name):
    raw, digest, f = sample(name)
    start = parse_header(f).payload_offset
    raised = 0
    for pos in range(start, len(f)):
        for mask in (0x01, 0x80, 0xFF):
            bad = bytearray(f)
            bad[pos] ^= mask
            try:
                out = decode_object(bytes(bad), digest)
            except CorruptObjectError:
                raised += 1
                continue
            # A flip zstd provably ignores is fine: the data was verified against its hash.
            assert bytes(out) == raw
    flips = 3 * (len(f) - start)
    if name == "raw":
        assert raised == flips
    else:
        assert raised >= 0.9 * flips  # the rest decoded to the very same bytes


def test_verify_false_returns_the_stored_bytes():
    # verify=False skips the hash: the caller opted out, bytes come back as stored.
    raw, digest, f = sample("raw")
    bad = bytearray(f)
    bad[-1] ^= 1
    out = decode_object(bytes(bad), digest, verify=False)
    assert bytes(out)[:-1] == raw[:-1]
    with pytest.raises(CorruptObjectError, match="does not match its hash"):
        decode_object(bytes(bad), digest)


@pytest.mark.parametrize("name", SAMPLES)
def test_header_bit_flips_raise_stepvault_errors_or_return_verified_data(name):
    raw, digest, f = sample(name)
    for pos in range(parse_header(f).payload_offset):
        for mask in (0x01, 0x20, 0x80):
            bad = bytearray(f)
            bad[pos] ^= mask
            try:
                out = decode_object(bytes(bad), digest)
            except ALLOWED:
                continue
            assert bytes(out) == raw


def test_wrong_expected_digest():
    _, _, f = sample("raw")
    other = blake3(b"other").hexdigest()
    with pytest.raises(CorruptObjectError, match="different hash"):
        decode_object(f, other)


def test_bad_magic():
    _, digest, f = sample("zstd")
    for magic in (b"SVOC", b"\x00\x00\x00\x00", b"svob", b"PK\x03\x04"):
        with pytest.raises(CorruptObjectError, match="bad magic"):
            parse_header(magic + f[4:])
        with pytest.raises(CorruptObjectError, match="bad magic"):
            decode_object(magic + f[4:], digest)


def test_header_length_out_of_range():
    _, digest, f = sample("raw")
    hlen = parse_header(f).payload_offset - _PREFIX.size
    for bad_len in (len(f), len(f) - _PREFIX.size + 1, MAX_HEADER + 1, 2**32 - 1):
        bad = _PREFIX.pack(MAGIC, 1, 0, bad_len) + f[_PREFIX.size :]
        with pytest.raises(CorruptObjectError, match="header length out of range"):
            parse_header(bad)
        with pytest.raises(CorruptObjectError):
            decode_object(bad, digest)
    # A header longer than MAX_HEADER is refused even when the file is big enough.
    huge = build({"codec": "raw"}, bytes(MAX_HEADER + 64), hlen=MAX_HEADER + 1)
    with pytest.raises(CorruptObjectError, match="header length out of range"):
        parse_header(huge)
    # Shorter header length: JSON cut in the middle.
    bad = _PREFIX.pack(MAGIC, 1, 0, hlen // 2) + f[_PREFIX.size :]
    with pytest.raises(CorruptObjectError, match="damaged object header"):
        parse_header(bad)


@pytest.mark.parametrize("version", [OBJECT_FORMAT_VERSION + 1, 99, 0xFFFF])
def test_newer_object_version(version):
    _, digest, f = sample("zstd")
    bad = _PREFIX.pack(MAGIC, version, 0, parse_header(f).payload_offset - 12) + f[12:]
    with pytest.raises(StoreVersionError, match="upgrade stepvault"):
        parse_header(bad)
    with pytest.raises(StoreVersionError):
        decode_object(bad, digest)


def test_unknown_codec():
    raw = b"abc" * 100
    digest = blake3(raw).hexdigest()
    f = build({"codec": "lz4", "raw_size": len(raw), "raw_blake3": digest, "params": {}}, raw)
    assert parse_header(f).codec == "lz4"
    with pytest.raises(UnknownCodecError, match="lz4"):
        decode_object(f, digest)
    # Unknown inner stream codec of the float codec.
    fl = build(
        {
            "codec": "float",
            "raw_size": 4,
            "raw_blake3": digest,
            "params": {
                "dtype": "bfloat16",
                "streams": [{"codec": "brotli", "size": 2}, {"codec": "raw", "size": 2}],
            },
        },
        b"\x00" * 4,
    )
    with pytest.raises(UnknownCodecError, match="brotli"):
        decode_object(fl, digest)


@pytest.mark.parametrize(
    "header",
    [
        {"raw_size": 3, "raw_blake3": "x"},  # no codec
        {"codec": "raw", "raw_blake3": "x"},  # no raw_size
        {"codec": "raw", "raw_size": 3},  # no hash
        {"codec": 1, "raw_size": 3, "raw_blake3": "x"},
        {"codec": "raw", "raw_size": -1, "raw_blake3": "x"},
        {"codec": "raw", "raw_size": True, "raw_blake3": "x"},
        {"codec": "raw", "raw_size": 3.0, "raw_blake3": "x"},
        {"codec": "raw", "raw_size": "3", "raw_blake3": "x"},
        {"codec": "raw", "raw_size": MAX_RAW_SIZE + 1, "raw_blake3": "x"},
        {"codec": "raw", "raw_size": 10**30, "raw_blake3": "x"},
        {"codec": "raw", "raw_size": 3, "raw_blake3": 5},
        {"codec": "raw", "raw_size": 3, "raw_blake3": "x", "params": []},
        ["codec", "raw"],
        "codec",
        42,
        None,
    ],
)
def test_damaged_header_fields(header):
    with pytest.raises(CorruptObjectError, match="damaged object header"):
        parse_header(build(json.dumps(header).encode(), b"abc"))


@pytest.mark.parametrize(
    "text",
    [b"", b"{", b"\xff\xfe{}", b"{'codec': 'raw'}", b"[" * 50_000, b"{" + b'"a":{' * 12_000],
)
def test_unparseable_header_json(text):
    # Includes nesting deep enough to exhaust the JSON parser's recursion limit.
    with pytest.raises(CorruptObjectError, match="damaged object header"):
        parse_header(build(text))


def _bomb_object(raw_size: int, frame: bytes, codec: str = "zstd", params=None) -> bytes:
    header = {"codec": codec, "raw_size": raw_size, "raw_blake3": "0" * 64, "params": params or {}}
    return build(header, frame)


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize("declared", [1 << 40, MAX_RAW_SIZE, 1 << 63, 1025, 1023, 0])
def test_zstd_frame_declaring_another_size_is_refused_without_allocating(declared):
    frame = zstd_frame_declaring(declared)
    assert zstandard.frame_content_size(frame) == declared
    f = _bomb_object(1024, frame)

    def attempt():
        with pytest.raises(CorruptObjectError, match="declares"):
            decode_object(f, "0" * 64)

    assert _peak_bytes(attempt) < 1 << 20


def test_zstd_frame_with_more_content_than_declared():
    # The frame says 1024 bytes but its block holds 4096: refused, no overrun.
    frame = zstd_frame_declaring(1024, bytes(4096))
    f = _bomb_object(1024, frame)

    def attempt():
        with pytest.raises(CorruptObjectError):
            decode_object(f, "0" * 64)

    assert _peak_bytes(attempt) < 1 << 20


def test_zstd_frame_without_content_size_is_refused():
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(1024))
    assert zstandard.frame_content_size(frame) == -1
    with pytest.raises(CorruptObjectError):
        decode_object(_bomb_object(1024, frame), "0" * 64)


def test_float_stream_bomb_is_refused_without_allocating():
    params = {
        "dtype": "bfloat16",
        "streams": [{"codec": "zstd", "size": 16}, {"codec": "raw", "size": 512}],
    }
    f = _bomb_object(1024, zstd_frame_declaring(1 << 40) + bytes(512), "float", params)

    def attempt():
        with pytest.raises(CorruptObjectError, match="declares"):
            decode_object(f, "0" * 64)

    assert _peak_bytes(attempt) < 1 << 20


def test_header_raw_size_beyond_limit_is_refused():
    f = _bomb_object(MAX_RAW_SIZE + 1, zstd_frame_declaring(MAX_RAW_SIZE + 1))
    with pytest.raises(CorruptObjectError, match="raw_size"):
        decode_object(f, "0" * 64)


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"dtype": "float64", "streams": []},
        {"dtype": "bfloat16"},
        {"dtype": "bfloat16", "streams": "x"},
        {"dtype": "bfloat16", "streams": [{"codec": "raw", "size": 2}]},
        {"dtype": "bfloat16", "streams": [1, 2]},
        {"dtype": "bfloat16", "streams": [{"codec": "raw", "size": -1}, {"codec": "raw"}]},
        {"dtype": "bfloat16", "streams": [{"codec": "raw", "size": 99}] * 2},
        {
            "dtype": "bfloat16",
            "streams": [{"codec": "raw", "size": 1}, {"codec": "raw", "size": 1}],
        },
        {
            "dtype": "bfloat16",
            "streams": [{"codec": "raw", "size": 2}, {"codec": "raw", "size": 1}],
        },
        {"dtype": "float32", "streams": [{"codec": "raw", "size": 1}] * 4},
    ],
)
def test_damaged_float_params(params):
    # raw_size 4 = two bf16 elements, payload 4 bytes.
    f = build({"codec": "float", "raw_size": 4, "raw_blake3": "0" * 64, "params": params}, bytes(4))
    with pytest.raises(CorruptObjectError):
        decode_object(f, "0" * 64)


def test_float_codec_odd_raw_size():
    params = {"dtype": "float32", "streams": [{"codec": "raw", "size": 1}] * 4}
    f = build({"codec": "float", "raw_size": 5, "raw_blake3": "0" * 64, "params": params}, bytes(4))
    with pytest.raises(CorruptObjectError, match="whole number"):
        decode_object(f, "0" * 64)


# --- fuzzing ---------------------------------------------------------------------------


def _check_fuzz_result(buf: bytes, digest: str, original: bytes | None = None) -> None:
    try:
        header = parse_header(buf)
    except ALLOWED:
        pass
    else:
        assert header.payload_offset <= len(buf)
        assert 0 <= header.raw_size <= MAX_RAW_SIZE
    try:
        out = decode_object(buf, digest)
    except ALLOWED:
        return
    out = bytes(out)
    assert blake3(out).hexdigest() == digest
    if original is not None:
        assert out == original


@SETTINGS
@given(st.binary(max_size=512))
def test_fuzz_arbitrary_bytes(buf):
    _check_fuzz_result(buf, "0" * 64)
    _check_fuzz_result(MAGIC + buf, "0" * 64)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
stream_specs = st.fixed_dictionaries(
    {
        "codec": st.sampled_from(["raw", "zstd", "lz4", 1, None]),
        "size": st.one_of(st.integers(-2, 70), st.booleans(), json_values),
    }
)
hostile_headers = st.fixed_dictionaries(
    {
        "codec": st.one_of(st.sampled_from(["raw", "zstd", "float", "nope"]), json_values),
        "raw_size": st.one_of(st.integers(-2, 80), st.sampled_from([MAX_RAW_SIZE, 2**70])),
        "raw_blake3": st.sampled_from(["0" * 64, "x"]),
        "params": st.one_of(
            json_values,
            st.fixed_dictionaries(
                {
                    "dtype": st.one_of(
                        st.sampled_from(["float16", "bfloat16", "float32"]), json_values
                    ),
                    "streams": st.one_of(st.lists(stream_specs, max_size=5), json_values),
                }
            ),
        ),
    }
)
payloads = st.one_of(
    st.binary(max_size=80),
    st.lists(st.binary(max_size=40), max_size=4).map(
        lambda parts: b"".join(
            zstandard.ZstdCompressor(write_content_size=True).compress(p) for p in parts
        )
    ),
    st.integers(0, 80).map(lambda n: zstd_frame_declaring(n)),
)


@SETTINGS
@given(header=hostile_headers, payload=payloads)
def test_fuzz_hostile_headers(header, payload):
    buf = build(json.dumps(header).encode(), payload)
    _check_fuzz_result(buf, "0" * 64)
    # Naming the object by the hash of what it would decode to must not help an attacker:
    # either an error, or the bytes with exactly that hash.
    _check_fuzz_result(buf, blake3(payload).hexdigest())


@pytest.mark.parametrize("name", SAMPLES)
@settings(SETTINGS, max_examples=60)
@given(data=st.data())
def test_fuzz_mutated_objects(name, data):
    raw, digest, f = sample(name)
    buf = bytearray(f)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(buf) - 1))
        buf[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(buf))))
    if cut is not None:
        del buf[cut:]
    assume(bytes(buf) != f)
    _check_fuzz_result(bytes(buf), digest, raw)


def test_errors_are_stepvault_errors():
    assert issubclass(CorruptObjectError, IntegrityError)
    assert issubclass(UnknownCodecError, IntegrityError)
    assert issubclass(IntegrityError, StepvaultError)
    assert issubclass(StoreVersionError, StepvaultError)
