"""Attachments: small files carried by a checkpoint (model config, tokenizer, hparams...).

Two places hold them (FORMAT.md §4 and §8):

* the manifest's optional ``attachments`` table, written at save time::

      "attachments": {"config.json": {"blake3": "<hex>", "size": 812}}

  Each file is one content-addressed object (§3) that is *also* listed in the manifest's
  ``objects`` table, so that every reader that knows nothing of attachments (an older
  stepvault) still keeps the object alive in garbage collection and checks it in verify;
* *attachment records* written after the fact (``stepvault attach``), one immutable file
  per call, carrying the content inline (see :func:`parse_record`): a committed manifest
  is never rewritten.

Names become file names when a checkpoint is exported, so they are flat and restricted.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Any

from ..errors import AttachmentError, ManifestError
from .hashing import content_hash

#: A name is one file name: no directories, no leading dot, no "..".
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+-]{0,127}\Z")
_HASH = re.compile(r"^[0-9a-f]{64}\Z")
#: Attachments are small files; weights belong in the state. Limits per file and per save.
MAX_ATTACHMENT_BYTES = 64 << 20
MAX_TOTAL_BYTES = 256 << 20
RECORD_FORMAT = "stepvault-attachments"
RECORD_VERSION = 1


def validate_attachment_name(name: Any) -> str:
    """Return ``name`` if it is a valid attachment name, else raise :class:`AttachmentError`."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise AttachmentError(
            f"invalid attachment name {name!r}: use one file name of 1-128 characters from "
            "letters, digits and '._+-' (no '/', no leading '.', no '..'), e.g. 'config.json'"
        )
    return name


@dataclass(frozen=True)
class AttachmentEntry:
    """One attached file as the manifest records it (``digest`` names its object)."""

    digest: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"blake3": self.digest, "size": self.size}


def parse_attachments(doc: Any, objects: dict[str, Any]) -> dict[str, AttachmentEntry]:
    """Check a manifest's ``attachments`` table against its ``objects`` table."""
    if doc is None:
        return {}
    if type(doc) is not dict:
        raise ManifestError("attachments must be an object")
    out: dict[str, AttachmentEntry] = {}
    for name, entry in doc.items():
        try:
            validate_attachment_name(name)
        except AttachmentError as exc:
            raise ManifestError(str(exc)) from None
        if type(entry) is not dict:
            raise ManifestError(f"attachment {name!r}: entry must be an object")
        digest, size = entry.get("blake3"), entry.get("size")
        if type(digest) is not str or not _HASH.match(digest) or digest not in objects:
            raise ManifestError(f"attachment {name!r}: names an unlisted object {digest!r}")
        if type(size) is not int or size != objects[digest].raw_size:
            raise ManifestError(f"attachment {name!r}: size {size!r} differs from its object")
        out[name] = AttachmentEntry(digest, size)
    return out


def check_sizes(files: dict[str, bytes]) -> None:
    """Refuse a file above :data:`MAX_ATTACHMENT_BYTES` or a set above :data:`MAX_TOTAL_BYTES`."""
    for name, data in files.items():
        if len(data) > MAX_ATTACHMENT_BYTES:
            raise AttachmentError(
                f"attachment {name!r} is {len(data)} bytes, above the {MAX_ATTACHMENT_BYTES} "
                "byte limit: attachments are small files; save large arrays in the state"
            )
    total = sum(len(d) for d in files.values())
    if total > MAX_TOTAL_BYTES:
        raise AttachmentError(
            f"attachments total {total} bytes, above the {MAX_TOTAL_BYTES} byte limit"
        )


def record_files(files: dict[str, bytes]) -> dict[str, dict[str, Any]]:
    """The ``files`` table of an attachment record: hash, size and base64 content."""
    return {
        name: {
            "blake3": content_hash(data),
            "size": len(data),
            "data": base64.b64encode(data).decode(),
        }
        for name, data in files.items()
    }


def parse_record(record: Any, where: str) -> dict[str, bytes]:
    """The verified files of an attachment record (``runs/<run>/attachments/<step>.<n>.json``).

    Record: ``{"format": "stepvault-attachments", "version": 1, "run", "step",
    "manifest_blake3", "files": {name: {"blake3", "size", "data"}}, "note", "time", "user",
    "host"[, "signature"]}``. Every file's content is checked against its hash and size.
    """
    if type(record) is not dict or record.get("format") != RECORD_FORMAT:
        raise AttachmentError(f"{where}: not a stepvault attachment record")
    version = record.get("version")
    if type(version) is not int or version > RECORD_VERSION:
        raise AttachmentError(
            f"{where}: attachment record version {version!r} is newer than this stepvault "
            f"reads ({RECORD_VERSION}); upgrade stepvault"
        )
    files = record.get("files")
    if type(files) is not dict:
        raise AttachmentError(f"{where}: damaged attachment record (no files table)")
    out: dict[str, bytes] = {}
    for name, entry in files.items():
        validate_attachment_name(name)
        try:
            data = base64.b64decode(entry["data"], validate=True)
            digest, size = entry["blake3"], entry["size"]
        except (KeyError, TypeError, ValueError) as exc:
            raise AttachmentError(f"{where}: damaged entry for {name!r}: {exc}") from None
        if len(data) != size or content_hash(data) != digest:
            raise AttachmentError(f"{where}: {name!r} does not match its hash (damaged or altered)")
        out[name] = data
    return out
