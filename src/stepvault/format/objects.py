"""Object files: a fixed prefix, a JSON header, then the codec payload.

::

    offset 0   4 bytes   magic  b"SVOB"
    offset 4   u16 LE    object format version (1)
    offset 6   u16 LE    reserved, 0
    offset 8   u32 LE    H = header length in bytes
    offset 12  H bytes   UTF-8 JSON header, padded with spaces so that 12 + H is a multiple of 64
    offset 12+H          payload (codec output); for codec "raw" the chunk bytes themselves

Header keys: ``codec`` (id), ``raw_size`` (bytes after decoding), ``raw_blake3`` (hex
BLAKE3 of the decoded bytes; also the object's name), ``params`` (codec parameters).
The 64-byte alignment lets raw payloads be memory-mapped as tensors without a copy.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptObjectError, StoreVersionError
from .codecs import get_codec
from .hashing import content_hash

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
class ObjectHeader:
    codec: str
    raw_size: int
    raw_blake3: str
    params: dict[str, Any]
    payload_offset: int


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
    raw: memoryview, codec_id: str, dtype: str | None, digest: str | None = None
) -> EncodedObject:
    """Encode one chunk; falls back to ``raw`` when the codec does not pay off."""
    raw = memoryview(raw).cast("B")
    digest = digest or content_hash(raw)
    payload: list[Any] = [raw]
    params: dict[str, Any] = {}
    if codec_id != "raw":
        payload, params = get_codec(codec_id).encode(raw, dtype)
        if sum(memoryview(p).nbytes for p in payload) > MIN_GAIN_RATIO * raw.nbytes:
            codec_id, payload, params = "raw", [raw], {}
    header = {"codec": codec_id, "raw_size": raw.nbytes, "raw_blake3": digest, "params": params}
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    pad = (-(_PREFIX.size + len(text))) % _ALIGN
    text += b" " * pad
    prefix = _PREFIX.pack(MAGIC, OBJECT_FORMAT_VERSION, 0, len(text))
    return EncodedObject(digest, codec_id, raw.nbytes, [prefix + text, *payload])


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
    return ObjectHeader(codec, raw_size, raw_hash, params, _PREFIX.size + hlen)


def decode_object(buf: memoryview | bytes, expected_digest: str, *, verify: bool = True):
    """Decode a whole object file; returns the raw bytes (a zero-copy view for ``raw``).

    With ``verify`` the decoded bytes are hashed and compared with ``expected_digest`` (the
    object's name): any damage raises :class:`CorruptObjectError`, never returns bad data.
    """
    view = memoryview(buf).cast("B")
    header = parse_header(view)
    if header.raw_blake3 != expected_digest:
        raise CorruptObjectError(
            f"object {expected_digest[:16]}… header names a different hash "
            f"({header.raw_blake3[:16]}…)"
        )
    codec = get_codec(header.codec)
    try:
        raw = codec.decode(view[header.payload_offset :], header.raw_size, header.params)
    except CorruptObjectError as exc:
        raise CorruptObjectError(f"object {expected_digest[:16]}…: {exc}") from exc
    except (ValueError, TypeError, KeyError) as exc:  # damaged params
        raise CorruptObjectError(f"object {expected_digest[:16]}…: cannot decode: {exc}") from exc
    raw = memoryview(raw).cast("B")
    if raw.nbytes != header.raw_size:
        raise CorruptObjectError(f"object {expected_digest[:16]}…: decoded size mismatch")
    if verify and content_hash(raw) != expected_digest:
        raise CorruptObjectError(
            f"object {expected_digest[:16]}… content does not match its hash (bit rot or tampering)"
        )
    return raw
