"""Object files: a fixed prefix, a JSON header, then the codec payload.

::

    offset 0   4 bytes   magic  b"SVOB"
    offset 4   u16 LE    object format version (1)
    offset 6   u16 LE    reserved, 0
    offset 8   u32 LE    H = header length in bytes
    offset 12  H bytes   UTF-8 JSON header, padded with spaces so that 12 + H is a multiple of 64
    offset 12+H          payload (codec output); for codec "raw" the chunk bytes themselves

Header keys: ``codec`` (id), ``raw_size`` (bytes after decoding), ``raw_blake3`` (hex
BLAKE3 of the decoded bytes; also the object's name), ``params`` (codec parameters) and,
optionally, ``sums`` (xxh3-128 of each segment of the decoded bytes: a read verifies with
these at a third of BLAKE3's CPU cost, a partial read only the segments it uses).
The 64-byte alignment lets raw payloads be memory-mapped as tensors without a copy.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptObjectError, MissingObjectError, StoreVersionError
from .codecs import get_codec
from .hashing import (
    SUM_ALG,
    SUM_SEGMENT,
    check_segments,
    content_hash,
    segment_sums,
    sums_available,
    sums_fit,
)
from .xor_codec import MAX_CHAIN, MissingBaseError, XorCodec, chain_of

#: ``base(digest, max_chain)``: the verified raw bytes of a delta object's base, decoded
#: with chains of at most ``max_chain`` links (the engine's fetch_object binds a store).
BaseReader = Callable[[str, int], memoryview]

MAGIC = b"SVOB"
OBJECT_FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHHI")
_ALIGN = 64
MAX_HEADER = 1 << 16
#: Upper bound on a chunk's decoded size: a damaged or hostile header cannot make a reader
#: allocate more than this.
MAX_RAW_SIZE = 1 << 32

#: A codec result is kept only if it is at most this fraction of the raw size.
MIN_GAIN_RATIO = 0.95


@dataclass(frozen=True)
class SegmentSums:
    """The ``sums`` header key: one ``alg`` checksum per ``segment`` bytes of raw data."""

    alg: str
    segment: int
    hex: str

    def usable(self) -> bool:
        """Whether this reader can check them (a known algorithm, ``xxhash`` installed)."""
        return self.alg == SUM_ALG and sums_available()

    def segments(self, off: int, length: int) -> range:
        """The indices of the segments that hold raw bytes ``off`` .. ``off + length``."""
        if length <= 0:
            return range(0)
        return range(off // self.segment, (off + length - 1) // self.segment + 1)


@dataclass(frozen=True)
class ObjectHeader:
    codec: str
    raw_size: int
    raw_blake3: str
    params: dict[str, Any]
    payload_offset: int
    sums: SegmentSums | None = None


@dataclass(frozen=True)
class EncodedObject:
    """An object ready to store: ``parts`` concatenated are the file content."""

    digest: str
    codec: str
    raw_size: int
    parts: list[Any]

    @property
    def size(self) -> int:
        return sum(memoryview(p).nbytes for p in self.parts)


def encode_object(
    raw: memoryview,
    codec_id: str,
    dtype: str | None,
    digest: str | None = None,
    *,
    sums: bool = True,
) -> EncodedObject:
    """Encode one chunk; falls back to ``raw`` when the codec does not pay off. ``sums``:
    record the segment checksums a read verifies with (when ``xxhash`` is installed)."""
    raw = memoryview(raw).cast("B")
    digest = digest or content_hash(raw)
    recorded = segment_sums(raw) if sums else None
    payload: list[Any] = [raw]
    params: dict[str, Any] = {}
    if codec_id != "raw":
        payload, params = get_codec(codec_id).encode(raw, dtype)
        if sum(memoryview(p).nbytes for p in payload) > MIN_GAIN_RATIO * raw.nbytes:
            codec_id, payload, params = "raw", [raw], {}
    return frame_object(digest, codec_id, raw.nbytes, params, payload, sums=recorded)


def frame_object(
    digest: str,
    codec_id: str,
    raw_size: int,
    params: dict[str, Any],
    payload: list[Any],
    *,
    sums: str | None = None,
) -> EncodedObject:
    """The object file (prefix, padded JSON header, payload) for an encoded chunk;
    ``sums``: the raw bytes' segment checksums (:func:`~.hashing.segment_sums`)."""
    header: dict[str, Any] = {
        "codec": codec_id,
        "raw_size": raw_size,
        "raw_blake3": digest,
        "params": params,
    }
    if sums is not None:
        header["sums"] = {"alg": SUM_ALG, "seg": SUM_SEGMENT, "hex": sums}
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    pad = (-(_PREFIX.size + len(text))) % _ALIGN
    text += b" " * pad
    prefix = _PREFIX.pack(MAGIC, OBJECT_FORMAT_VERSION, 0, len(text))
    return EncodedObject(digest, codec_id, raw_size, [prefix + text, *payload])


def parse_header(buf: memoryview | bytes) -> ObjectHeader:
    """Parse and sanity-check an object's prefix and header (not its payload)."""
    view = memoryview(buf).cast("B")
    if view.nbytes < _PREFIX.size:
        raise CorruptObjectError(f"object truncated: {view.nbytes} bytes, no header")
    magic, version, _reserved, hlen = _PREFIX.unpack(view[: _PREFIX.size])
    if magic != MAGIC:
        raise CorruptObjectError("not a stepvault object (bad magic)")
    if version > OBJECT_FORMAT_VERSION:
        raise StoreVersionError(
            f"object format version {version} is newer than this stepvault reads "
            f"({OBJECT_FORMAT_VERSION}); upgrade stepvault"
        )
    if hlen > MAX_HEADER or _PREFIX.size + hlen > view.nbytes:
        raise CorruptObjectError("object header length out of range (truncated or damaged)")
    try:
        header = json.loads(bytes(view[_PREFIX.size : _PREFIX.size + hlen]))
        codec = header["codec"]
        raw_size = header["raw_size"]
        raw_hash = header["raw_blake3"]
        params = header.get("params", {})
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CorruptObjectError(f"damaged object header: {exc}") from exc
    if not isinstance(codec, str) or not isinstance(params, dict):
        raise CorruptObjectError("damaged object header: bad codec or params")
    if (
        isinstance(raw_size, bool)
        or not isinstance(raw_size, int)
        or not 0 <= raw_size <= MAX_RAW_SIZE
    ):
        raise CorruptObjectError("damaged object header: bad raw_size")
    if not isinstance(raw_hash, str):
        raise CorruptObjectError("damaged object header: bad raw_blake3")
    return ObjectHeader(
        codec, raw_size, raw_hash, params, _PREFIX.size + hlen, _parse_sums(header, raw_size)
    )


def _parse_sums(header: dict[str, Any], raw_size: int) -> SegmentSums | None:
    """The optional ``sums`` key, checked for shape (a damaged one is damage, not absence)."""
    if "sums" not in header:
        return None
    sums = header["sums"]
    try:
        alg, segment, hexes = sums["alg"], sums["seg"], sums["hex"]
    except (KeyError, TypeError) as exc:
        raise CorruptObjectError(f"damaged object header: bad sums ({exc})") from exc
    if (
        not isinstance(alg, str)
        or isinstance(segment, bool)
        or not isinstance(segment, int)
        or segment < 1
        or not isinstance(hexes, str)
        or (alg == SUM_ALG and not sums_fit(hexes, segment, raw_size))
    ):
        raise CorruptObjectError("damaged object header: bad sums")
    return SegmentSums(alg, segment, hexes)


def decode_object(
    buf: memoryview | bytes,
    expected_digest: str,
    *,
    verify: bool = True,
    base: BaseReader | None = None,
    max_chain: int = MAX_CHAIN,
    fast: bool = False,
):
    """Decode a whole object file; returns the raw bytes (a zero-copy view for ``raw``).

    With ``verify`` the decoded bytes are hashed and compared with ``expected_digest`` (the
    object's name): any damage raises :class:`CorruptObjectError`, never returns bad data.
    ``fast``: check the header's segment checksums instead of BLAKE3 when the object has
    usable ones (the name is still compared with the header's ``raw_blake3``, so a swapped
    object is found either way); BLAKE3 otherwise.
    A delta (``xor``) object reads its base through ``base``; without one, or when the
    base is missing, :class:`~stepvault.format.xor_codec.MissingBaseError`.
    """
    view = memoryview(buf).cast("B")
    header = parse_header(view)
    if header.raw_blake3 != expected_digest:
        raise CorruptObjectError(
            f"object {expected_digest[:16]}… header names a different hash "
            f"({header.raw_blake3[:16]}…)"
        )
    codec = get_codec(header.codec)
    # A base's own errors (missing, damaged: they name that object) pass through unwrapped.
    base_raw = (
        _read_base(expected_digest, header, base, max_chain)
        if isinstance(codec, XorCodec)
        else None
    )
    try:
        if isinstance(codec, XorCodec) and base_raw is not None:
            raw = codec.decode_with_base(
                view[header.payload_offset :], header.raw_size, header.params, base_raw
            )
        else:
            raw = codec.decode(view[header.payload_offset :], header.raw_size, header.params)
    except CorruptObjectError as exc:
        raise CorruptObjectError(f"object {expected_digest[:16]}…: {exc}") from exc
    except (ValueError, TypeError, KeyError) as exc:  # damaged params
        raise CorruptObjectError(f"object {expected_digest[:16]}…: cannot decode: {exc}") from exc
    raw = memoryview(raw).cast("B")
    if raw.nbytes != header.raw_size:
        raise CorruptObjectError(f"object {expected_digest[:16]}…: decoded size mismatch")
    if verify and fast and header.sums is not None and header.sums.usable():
        bad = check_segments(raw, header.sums.hex, header.sums.segment)
        if bad is not None:
            raise CorruptObjectError(
                f"object {expected_digest[:16]}… content does not match its hash (the xxh3-128 "
                f"checksum of segment {bad} differs: bit rot or tampering)"
            )
        return raw
    if verify and content_hash(raw) != expected_digest:
        raise CorruptObjectError(
            f"object {expected_digest[:16]}… content does not match its hash (bit rot or tampering)"
        )
    return raw


def _read_base(
    digest: str, header: ObjectHeader, base: BaseReader | None, max_chain: int
) -> memoryview:
    """The verified bytes of a delta object's base (errors name both objects)."""
    try:
        chain = chain_of(header.params)
    except CorruptObjectError as exc:
        raise CorruptObjectError(f"object {digest[:16]}…: {exc}") from exc
    if len(chain) > max_chain:
        # Each base must have a shorter chain than the delta naming it: no loops.
        raise CorruptObjectError(
            f"object {digest[:16]}…: xor chain of {len(chain)} links where at most "
            f"{max_chain} may follow (damaged header)"
        )
    if base is None:
        err = MissingBaseError(
            f"object {digest[:16]}… is an xor delta against {chain[0][:16]}…; decode it "
            "through a store that holds its base"
        )
        err.digest = digest
        raise err
    try:
        return memoryview(base(chain[0], len(chain) - 1)).cast("B")
    except MissingObjectError as exc:
        err = MissingBaseError(
            f"object {digest[:16]}… is an xor delta whose base {chain[0][:16]}… cannot be "
            f"read ({exc}); this copy is unusable: restore reads another tier's copy or "
            "falls back to another checkpoint ('stepvault verify --deep' lists such objects)"
        )
        err.digest = digest
        raise err from None
