"""The lossless ``xor`` delta codec: a chunk stored as the XOR against a *base* object.

Between two nearby training steps most bits of a float do not change: the sign, the
exponent and the top mantissa bits of a weight or an Adam moment stay put, only the low
mantissa bits move. XOR-ing a chunk with the same chunk of the previous checkpoint turns
those unchanged bits into zeros, and the byte grouping of the ``float`` codec (exponent
bytes, sign+mantissa byte planes, FORMAT.md §3.2) puts the zeros into streams that zstd
codes to almost nothing (ZipLLM's BitX; this project's measurement in BENCHMARKS.md).

The object names its base by content hash in its header (``params.chain``: the base
first, then the base's own bases, nearest first), so a reader needs only the header and
the base's bytes. Decoding is exact: the decoded bytes are hashed like every object's.
The chain length is bounded by the writer (a plain object every ``k`` links) and by the
reader (:data:`MAX_CHAIN`, and each base must have a strictly shorter chain), so a
damaged or hostile header can neither loop nor make a restore replay a long chain.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from ..errors import CorruptObjectError, MissingBaseError
from .codecs import CODECS, Codec, FloatCodec, get_codec

XOR_ID = "xor"
#: A plain (full) object at least every this many links, unless the setting says otherwise.
DEFAULT_CHAIN_LIMIT = 8
#: The longest chain a reader follows (a writer's ``k`` may not exceed it).
MAX_CHAIN = 64
_HASH = re.compile(r"^[0-9a-f]{64}\Z")
_SETTING = re.compile(r"^xor(?::(?P<k>[0-9]{1,3}))?\Z")


def chain_limit(setting: str) -> int | None:
    """``k`` of a delta codec setting (``"xor"`` or ``"xor:K"``), None for other settings."""
    m = _SETTING.match(setting) if isinstance(setting, str) else None
    if m is None:
        return None
    k = int(m.group("k") or DEFAULT_CHAIN_LIMIT)
    if not 1 <= k <= MAX_CHAIN:
        raise ValueError(f"xor codec: chain limit must be 1..{MAX_CHAIN}, got {k} in {setting!r}")
    return k


def chain_of(params: dict[str, Any]) -> list[str]:
    """The base chain recorded in an xor object's params, checked (CorruptObjectError)."""
    chain = params.get("chain")
    if (
        not isinstance(chain, list)
        or not 1 <= len(chain) <= MAX_CHAIN
        or not all(isinstance(h, str) and _HASH.match(h) for h in chain)
    ):
        raise CorruptObjectError("xor codec: damaged base chain in the header")
    return chain


def _xor(a: memoryview | bytes, b: memoryview | bytes) -> np.ndarray:
    x = np.frombuffer(a, dtype=np.uint8)
    y = np.frombuffer(b, dtype=np.uint8)
    if x.size % 8 == 0:  # word-wide XOR: the same result, fewer numpy element steps
        return np.bitwise_xor(x.view(np.uint64), y.view(np.uint64)).view(np.uint8)
    return np.bitwise_xor(x, y)


def encode_xor(
    raw: memoryview, base_raw: memoryview, chain: list[str], dtype: str | None
) -> tuple[list[Any], dict[str, Any]]:
    """Payload parts and params of ``raw`` as a delta against ``base_raw`` (same size).

    The XOR is byte-grouped with the ``float`` codec for fp16/bf16/fp32 chunks, otherwise
    zstd-coded; the inner codec is ``raw`` when neither shrinks it.
    """
    if base_raw.nbytes != raw.nbytes:
        raise ValueError("xor codec: the base must have the same size as the chunk")
    delta = memoryview(_xor(raw, base_raw).data).cast("B")
    inner = "float" if dtype in FloatCodec.SUPPORTED else "zstd"
    try:
        parts, inner_params = get_codec(inner).encode(delta, dtype)
    except ValueError:  # not whole elements (a bundle of several tensors): plain bytes
        inner = "zstd"
        parts, inner_params = get_codec(inner).encode(delta, dtype)
    if sum(memoryview(p).nbytes for p in parts) >= delta.nbytes:
        inner, parts, inner_params = "raw", [delta], {}
    return parts, {"chain": list(chain), "inner": inner, "inner_params": inner_params}


class XorCodec(Codec):
    """``decode_with_base`` undoes :func:`encode_xor`; plain ``decode`` needs a base."""

    id = XOR_ID
    needs_base = True

    def encode(self, raw, dtype):
        raise ValueError("the xor codec needs a base: use encode_xor (tier copies do)")

    def decode(self, payload, raw_size, params):
        raise MissingBaseError(
            "xor delta object decoded without access to its base; read it through a store "
            "(stepvault.engine.fetch_object resolves the base)"
        )

    def decode_with_base(
        self, payload: memoryview, raw_size: int, params: dict[str, Any], base_raw: memoryview
    ) -> memoryview:
        inner = params.get("inner")
        if (
            not isinstance(inner, str)
            or inner == XOR_ID
            or not isinstance(params.get("inner_params"), dict)
        ):
            raise CorruptObjectError("xor codec: damaged inner codec")
        if base_raw.nbytes != raw_size:
            raise CorruptObjectError(
                f"xor codec: base has {base_raw.nbytes} bytes, the chunk {raw_size}"
            )
        delta = get_codec(inner).decode(payload, raw_size, params["inner_params"])
        delta = memoryview(delta).cast("B")
        if delta.nbytes != raw_size:
            raise CorruptObjectError("xor codec: inner payload decodes to the wrong size")
        return memoryview(_xor(delta, base_raw).data).cast("B")


CODECS[XOR_ID] = XorCodec()
