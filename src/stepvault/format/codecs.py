"""Chunk codecs: ``raw``, ``zstd`` and the lossless ``float`` codec.

A codec turns the raw bytes of a chunk into payload bytes and back, bit-exactly. Each is a
small object with an id and a JSON-able parameter dict that is recorded in the object
header (the numcodecs/zarr model), so a reader needs nothing but the header to decode.

The ``float`` codec uses the observation behind ZipNN: in trained weights the exponent of
a float takes few distinct values (low entropy) while sign and mantissa are close to
random. It regroups every element into an *exponent byte stream* and *sign+mantissa byte
streams*, then entropy-codes each stream separately. Only the exponent stream usually
shrinks, but it shrinks a lot; streams that do not shrink are stored raw.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import zstandard

from ..errors import CorruptObjectError, UnknownCodecError
from .dtypes import dtype_info

_local = threading.local()

#: zstd parameters for the float codec's byte streams, measured on real weights (MiniLM,
#: one thread; bench_core.py section 6). The streams are order-0 sources: an exponent byte
#: takes a few dozen values with ~2.7 bits of entropy and few useful repeats, so nearly all
#: of the gain is zstd's Huffman literal coder and match finding is mostly cost (a chance
#: 7-byte match even codes larger as a sequence than as literals). The smallest hash table
#: (64 entries) makes such matches rare, so the fast strategy skips ahead through literal
#: runs: 2.6x faster than level 1 on the exponent stream, and smaller (0.331 vs 0.364 of its
#: size). Runs and short periods are still found (repeat offsets). Not found any more:
#: repeats farther back than the last few dozen positions (level 1 found them up to 512 KiB
#: back); long distance matching would find them but costs +40% of the exponent pass.
#: Window 2^17 keeps zstd's largest block (128 KiB, one Huffman table each); smaller windows
#: shrink the blocks, which is slower and larger. A zstd frame decodes whatever parameters
#: wrote it, so these can change without a format change.
_STREAM_PARAMS = dict(
    strategy=zstandard.STRATEGY_FAST,
    window_log=17,
    hash_log=6,
    chain_log=6,
    search_log=1,
    min_match=7,
    target_length=0,  # >0 would turn Huffman literals off under the fast strategy
    write_content_size=True,
)


def _compressor(kind: str) -> zstandard.ZstdCompressor:
    # Compressor objects are not thread-safe: one per thread and kind, made once (creating
    # one allocates its context, which would be a visible cost on small chunks).
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    comp = cache.get(kind)
    if comp is None:
        if kind == "stream":
            params = zstandard.ZstdCompressionParameters(**_STREAM_PARAMS)
            comp = zstandard.ZstdCompressor(compression_params=params)
        else:
            comp = zstandard.ZstdCompressor(level=3, write_content_size=True)
        cache[kind] = comp
    return comp


def _zstd_decompress(payload: memoryview | bytes, expected: int) -> bytes:
    # Refuse frames that do not declare exactly the size we expect: a hostile object cannot
    # make us allocate more than its header's raw_size (decompression bombs).
    try:
        declared = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as exc:
        raise CorruptObjectError(f"damaged zstd frame: {exc}") from exc
    if declared != expected:
        raise CorruptObjectError(f"zstd frame declares {declared} bytes, header expects {expected}")
    try:
        out = zstandard.ZstdDecompressor().decompress(payload, max_output_size=expected)
    except zstandard.ZstdError as exc:
        raise CorruptObjectError(f"damaged zstd frame: {exc}") from exc
    if len(out) != expected:
        raise CorruptObjectError(f"zstd frame gave {len(out)} bytes, expected {expected}")
    return out


class Codec:
    """Base class: ``encode(raw, dtype) -> (payload parts, params)`` and ``decode``."""

    id: str = ""

    def encode(self, raw: memoryview, dtype: str | None) -> tuple[list[Any], dict[str, Any]]:
        raise NotImplementedError

    def decode(self, payload: memoryview, raw_size: int, params: dict[str, Any]) -> Any:
        raise NotImplementedError


class RawCodec(Codec):
    """Payload is the raw bytes; decoding is zero-copy (the payload view is returned)."""

    id = "raw"

    def encode(self, raw, dtype):
        return [raw], {}

    def decode(self, payload, raw_size, params):
        if payload.nbytes != raw_size:
            raise CorruptObjectError(f"raw payload has {payload.nbytes} bytes, expected {raw_size}")
        return payload


class ZstdCodec(Codec):
    """Payload is one zstd frame (level 3) with its content size."""

    id = "zstd"

    def encode(self, raw, dtype):
        return [_compressor("generic").compress(raw)], {}

    def decode(self, payload, raw_size, params):
        return _zstd_decompress(payload, raw_size)


#: Elements per block of the stream split/join: the block's temporaries (two word arrays of
#: 0.5-1 MiB) stay in cache and are reused, where whole-chunk temporaries would be fresh
#: memory (page faults) and a trip to DRAM per numpy operation.
_BLOCK = 1 << 18


def _layout(word: np.dtype, man_bits: int) -> tuple[int, int, int, int]:
    """(word bits, rest bytes k, shift s of the top rest byte, sign position p in it)."""
    width = word.itemsize * 8
    k = (man_bits + 1 + 7) // 8
    s = 8 * (k - 1)
    return width, k, s, man_bits - s


def _split_float(u: np.ndarray, exp_bits: int, man_bits: int) -> list[np.ndarray]:
    """Regroup unsigned words into [exponent bytes, sign+mantissa byte planes (LSB first)].

    Same result as ``exponent = (u >> M) & (2^E-1)`` and the byte planes of
    ``rest = (u & (2^M-1)) | (sign << M)`` (FORMAT.md 3.2), computed block by block with
    word-sized shifts/masks (x86 has no SIMD byte shifts) and narrowing casts into the
    output planes. The rest bytes below the top one are plain bytes of ``u``.
    """
    n = u.size
    width, k, s, p = _layout(u.dtype, man_bits)
    exponent = np.empty(n, np.uint8)
    planes = [np.empty(n, np.uint8) for _ in range(k)]
    m = min(n, _BLOCK)
    t, t2 = np.empty(m, u.dtype), np.empty(m, u.dtype)
    for a in range(0, n, _BLOCK):
        b = min(n, a + _BLOCK)
        ub, tb, t2b = u[a:b], t[: b - a], t2[: b - a]
        np.right_shift(ub, man_bits, out=tb)
        if exp_bits < 8:  # the sign sits right above the exponent: mask it off
            np.bitwise_and(tb, (1 << exp_bits) - 1, out=tb)
        np.copyto(exponent[a:b], tb, casting="unsafe")  # keeps the low byte
        for i in range(k - 1):
            src = ub if i == 0 else np.right_shift(ub, 8 * i, out=tb)
            np.copyto(planes[i][a:b], src, casting="unsafe")
        # Top rest byte: mantissa bits s..M-1 below bit p, the sign at bit p.
        if s:
            np.right_shift(ub, s, out=tb)
            np.bitwise_and(tb, (1 << p) - 1, out=tb)
        else:
            np.bitwise_and(ub, (1 << p) - 1, out=tb)
        np.right_shift(ub, width - 1 - p, out=t2b)
        np.bitwise_and(t2b, 1 << p, out=t2b)
        np.bitwise_or(tb, t2b, out=tb)
        np.copyto(planes[-1][a:b], tb, casting="unsafe")
    return [exponent, *planes]


def _join_float(streams: list[np.ndarray], dtype: np.dtype, exp_bits: int, man_bits: int):
    """Inverse of :func:`_split_float`: the unsigned words, as a new array."""
    exponent, planes = streams[0], streams[1:]
    n = exponent.size
    width, k, s, p = _layout(dtype, man_bits)
    u = np.empty(n, dtype)
    m = min(n, _BLOCK)
    t, t2 = np.empty(m, dtype), np.empty(m, dtype)
    top = planes[-1]
    for a in range(0, n, _BLOCK):
        b = min(n, a + _BLOCK)
        ub, tb, t2b = u[a:b], t[: b - a], t2[: b - a]
        np.copyto(ub, exponent[a:b])
        np.left_shift(ub, man_bits, out=ub)
        np.copyto(tb, top[a:b])
        np.left_shift(tb, width - 1 - p, out=t2b)  # sign bit (bit p) to the top of the word
        np.bitwise_and(t2b, 1 << (width - 1), out=t2b)
        np.bitwise_or(ub, t2b, out=ub)
        np.bitwise_and(tb, (1 << p) - 1, out=tb)
        if s:
            np.left_shift(tb, s, out=tb)
        np.bitwise_or(ub, tb, out=ub)
        for i in range(k - 1):
            np.copyto(tb, planes[i][a:b])
            if i:
                np.left_shift(tb, 8 * i, out=tb)
            np.bitwise_or(ub, tb, out=ub)
    return u


_WORD = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


class FloatCodec(Codec):
    """Lossless float codec for float16, bfloat16 and float32 (exponent/mantissa split)."""

    id = "float"
    SUPPORTED = ("float16", "bfloat16", "float32")

    def encode(self, raw, dtype):
        if dtype not in self.SUPPORTED:
            raise ValueError(f"float codec supports {self.SUPPORTED}, not {dtype!r}")
        info = dtype_info(dtype)
        exp_bits, man_bits = info.float_bits
        if raw.nbytes % info.itemsize:
            raise ValueError("float codec needs whole elements")
        u = np.frombuffer(raw, dtype=_WORD[info.itemsize])
        parts, streams = [], []
        comp = _compressor("stream")
        for stream in _split_float(u, exp_bits, man_bits):
            # Every stream gets its zstd pass, even the near-random sign+mantissa bytes: on
            # those zstd's fast strategy runs at ~4 GB/s (it skips ahead when nothing
            # matches and gives up on Huffman per block), and a sample would miss tensors
            # whose low mantissa bytes repeat (MiniLM fp32: 0.964 and 0.983 on two planes).
            packed = comp.compress(stream.data)
            if len(packed) < stream.nbytes:
                parts.append(packed)
                streams.append({"codec": "zstd", "size": len(packed)})
            else:
                parts.append(stream.data)
                streams.append({"codec": "raw", "size": stream.nbytes})
        return parts, {"dtype": dtype, "streams": streams}

    def decode(self, payload, raw_size, params):
        dtype = params.get("dtype")
        if dtype not in self.SUPPORTED:
            raise CorruptObjectError(f"float codec: unsupported dtype {dtype!r}")
        info = dtype_info(dtype)
        exp_bits, man_bits = info.float_bits
        if raw_size % info.itemsize:
            raise CorruptObjectError("float codec: raw size is not a whole number of elements")
        count = raw_size // info.itemsize
        specs = params.get("streams")
        expected_streams = 1 + (man_bits + 1 + 7) // 8
        if not isinstance(specs, list) or len(specs) != expected_streams:
            raise CorruptObjectError("float codec: wrong stream table")
        streams, offset = [], 0
        for spec in specs:
            size = spec.get("size") if isinstance(spec, dict) else None
            if not isinstance(size, int) or size < 0 or offset + size > payload.nbytes:
                raise CorruptObjectError("float codec: stream size out of range")
            chunk = payload[offset : offset + size]
            offset += size
            if spec.get("codec") == "zstd":
                data = _zstd_decompress(chunk, count)
            elif spec.get("codec") == "raw":
                if size != count:
                    raise CorruptObjectError("float codec: raw stream has the wrong size")
                data = chunk
            else:
                raise UnknownCodecError(f"float codec: unknown stream codec {spec.get('codec')!r}")
            streams.append(np.frombuffer(data, dtype=np.uint8))
        if offset != payload.nbytes:
            raise CorruptObjectError("float codec: trailing bytes after the last stream")
        word = _WORD[info.itemsize]
        return memoryview(_join_float(streams, word, exp_bits, man_bits)).cast("B")


CODECS: dict[str, Codec] = {c.id: c for c in (RawCodec(), ZstdCodec(), FloatCodec())}

#: Names accepted by the ``codec`` setting: a codec id, or ``auto`` (float codec for
#: fp16/bf16/fp32 chunks, zstd for everything else, raw when it does not pay off).
CODEC_CHOICES = ("raw", "zstd", "float", "auto")


def get_codec(codec_id: str) -> Codec:
    """The codec registered under ``codec_id``; :class:`UnknownCodecError` otherwise."""
    try:
        return CODECS[codec_id]
    except (KeyError, TypeError):
        raise UnknownCodecError(
            f"unknown codec {codec_id!r} (this stepvault knows {', '.join(CODECS)}); the object "
            "was written by a newer stepvault or is damaged"
        ) from None


def choose_codec(setting: str, dtype: str | None) -> str:
    """Codec id to try for a chunk of ``dtype`` under the store/save ``setting``."""
    if setting not in CODEC_CHOICES:
        raise ValueError(f"codec must be one of {CODEC_CHOICES}, got {setting!r}")
    if setting == "auto":
        return "float" if dtype in FloatCodec.SUPPORTED else "zstd"
    if setting == "float" and dtype not in FloatCodec.SUPPORTED:
        return "zstd"
    return setting
