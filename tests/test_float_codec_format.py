"""The float codec against FORMAT.md 3.2, across encoder versions and block boundaries.

The codec's encoder may change how it computes and compresses the streams, never what the
streams are: objects written by an older encoder must decode (fixtures in
``tests/data/float_codec_v1``), and what the current encoder writes must decode with the
specification's own formulas (so older readers decode it too).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zstandard
from blake3 import blake3

from stepvault.format import codecs
from stepvault.format.codecs import get_codec
from stepvault.format.dtypes import dtype_info
from stepvault.format.objects import decode_object, encode_object, parse_header

FIXTURES = Path(__file__).parent / "data" / "float_codec_v1"
INDEX = json.loads((FIXTURES / "index.json").read_text())
FLOAT_DTYPES = ("bfloat16", "float16", "float32")
WORD = {2: np.dtype("<u2"), 4: np.dtype("<u4")}

# ±0, ±inf, quiet/signalling NaNs with payloads and both signs, subnormals, extremes, 1.0.
SPECIALS = {
    "float16": [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE00, 0xFFFF, 0x0001,
                0x03FF, 0x8001, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00],
    "bfloat16": [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFC0, 0xFFFF, 0x0001,
                 0x007F, 0x8001, 0x807F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80],
    "float32": [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,
                0xFFC00000, 0xFFFFFFFF, 0x7FC0DEAD, 0x00000001, 0x007FFFFF, 0x80000001,
                0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0x3F800000],
}  # fmt: skip


def spec_streams(u: np.ndarray, dtype: str) -> list[bytes]:
    """FORMAT.md 3.2, written out plainly: exponent bytes, then the byte planes of rest."""
    exp_bits, man_bits = dtype_info(dtype).float_bits
    width = u.dtype.itemsize * 8
    v = u.astype(np.uint64)
    exponent = (v >> man_bits) & ((1 << exp_bits) - 1)
    rest = (v & ((1 << man_bits) - 1)) | (((v >> (width - 1)) & 1) << man_bits)
    k = (man_bits + 1 + 7) // 8
    planes = [((rest >> (8 * i)) & 0xFF).astype(np.uint8).tobytes() for i in range(k)]
    return [exponent.astype(np.uint8).tobytes(), *planes]


def spec_decode(payload: bytes, raw_size: int, params: dict) -> bytes:
    """Decode a float payload with the specification's formulas (an independent reader)."""
    dtype = params["dtype"]
    exp_bits, man_bits = dtype_info(dtype).float_bits
    word = WORD[dtype_info(dtype).itemsize]
    width = word.itemsize * 8
    count = raw_size // word.itemsize
    streams, offset = [], 0
    for spec in params["streams"]:
        chunk = payload[offset : offset + spec["size"]]
        offset += spec["size"]
        if spec["codec"] == "zstd":
            chunk = zstandard.ZstdDecompressor().decompress(chunk, max_output_size=count)
        assert len(chunk) == count
        streams.append(np.frombuffer(chunk, np.uint8).astype(np.uint64))
    assert offset == len(payload)
    exponent, planes = streams[0], streams[1:]
    rest = np.zeros(count, np.uint64)
    for i, plane in enumerate(planes):
        rest |= plane << np.uint64(8 * i)
    sign = (rest >> np.uint64(man_bits)) & np.uint64(1)
    u = (sign << np.uint64(width - 1)) | (exponent << np.uint64(man_bits))
    u |= rest & np.uint64((1 << man_bits) - 1)
    assert exp_bits + man_bits + 1 == width
    return u.astype(word).tobytes()


def words(dtype: str, n: int, seed: int) -> np.ndarray:
    """``n`` words of ``dtype``: weight-like values, specials and arbitrary bit patterns."""
    word = WORD[dtype_info(dtype).itemsize]
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal(n) * 0.02).astype(np.float32).view(np.uint32)
    if word.itemsize == 2:  # bfloat16 = upper half of fp32; float16 via numpy
        weights = (
            (weights >> 16)
            if dtype == "bfloat16"
            else ((rng.standard_normal(n) * 0.02).astype(np.float16).view(np.uint16))
        )
    u = weights.astype(word)
    pick = rng.random(n)
    u[pick < 0.1] = rng.choice(np.array(SPECIALS[dtype], dtype=word), size=int((pick < 0.1).sum()))
    anything = pick > 0.95
    u[anything] = rng.integers(0, 1 << (8 * word.itemsize), int(anything.sum())).astype(word)
    return u


def payload_of(parts: list) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in parts)


@pytest.mark.parametrize("name", sorted(INDEX))
def test_objects_written_by_the_first_encoder_still_decode(name):
    entry = INDEX[name]
    blob = (FIXTURES / f"{name}.svob").read_bytes()
    raw = (FIXTURES / f"{name}.raw").read_bytes()
    assert len(raw) == entry["raw_size"] and blake3(raw).hexdigest() == entry["digest"]
    header = parse_header(blob)
    assert header.codec == entry["codec"] == "float"
    assert [s["codec"] for s in header.params["streams"]] == entry["streams"]
    out = decode_object(blob, entry["digest"])  # verifies BLAKE3 of the result as well
    assert bytes(out) == raw
    # The current encoder writes the same chunk differently, but to the same bytes back.
    dtype = header.params["dtype"]
    obj = encode_object(memoryview(raw), "float", dtype)
    assert obj.digest == entry["digest"]
    assert bytes(decode_object(payload_of(obj.parts), obj.digest)) == raw


def test_fixtures_cover_zstd_and_raw_streams_for_every_dtype():
    for dtype in FLOAT_DTYPES:
        kinds = {c for name, e in INDEX.items() if name.startswith(dtype) for c in e["streams"]}
        assert kinds == {"zstd", "raw"}, dtype


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(
    "n",
    [0, 1, 2, 3, 1001, codecs._BLOCK - 1, codecs._BLOCK, codecs._BLOCK + 1, 2 * codecs._BLOCK + 7],
)
def test_streams_match_the_specification_across_block_boundaries(dtype, n):
    u = words(dtype, n, seed=n)
    exp_bits, man_bits = dtype_info(dtype).float_bits
    streams = codecs._split_float(u, exp_bits, man_bits)
    assert [s.tobytes() for s in streams] == spec_streams(u, dtype)
    back = codecs._join_float(streams, u.dtype, exp_bits, man_bits)
    assert back.dtype == u.dtype and back.tobytes() == u.tobytes()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("n", [0, 1, 7, 4099, codecs._BLOCK + 3])
def test_current_payload_decodes_with_the_specification(dtype, n):
    u = words(dtype, n, seed=1000 + n)
    raw = u.tobytes()
    codec = get_codec("float")
    parts, params = codec.encode(memoryview(raw), dtype)
    params = json.loads(json.dumps(params))
    payload = payload_of(parts)
    assert spec_decode(payload, len(raw), params) == raw  # what an older reader does
    out = codec.decode(memoryview(payload), len(raw), params)
    assert bytes(memoryview(out).cast("B")) == raw


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_every_special_value_in_every_block_position(dtype):
    # Specials at the first, last and boundary positions of the split/join blocks.
    word = WORD[dtype_info(dtype).itemsize]
    n = codecs._BLOCK + len(SPECIALS[dtype])
    u = np.zeros(n, word)
    sp = np.array(SPECIALS[dtype], dtype=word)
    u[: len(sp)] = sp
    u[codecs._BLOCK - len(sp) // 2 : codecs._BLOCK - len(sp) // 2 + len(sp)] = sp
    u[-len(sp) :] = sp[::-1]
    raw = u.tobytes()
    obj = encode_object(memoryview(raw), "float", dtype)
    assert obj.codec == "float"
    assert bytes(decode_object(payload_of(obj.parts), obj.digest)) == raw


def test_unaligned_input_buffer():
    # A chunk view that does not start at a word boundary of its buffer.
    u = words("float32", 5001, seed=3)
    buf = bytearray(1 + u.nbytes)
    buf[1:] = u.tobytes()
    raw = memoryview(buf)[1:]
    codec = get_codec("float")
    parts, params = codec.encode(raw, "float32")
    out = codec.decode(memoryview(payload_of(parts)), raw.nbytes, params)
    assert bytes(memoryview(out).cast("B")) == bytes(raw)
