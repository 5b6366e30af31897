"""Writing and reading attachments: small files stored with a checkpoint.

At save time (``stepvault.save(..., attachments=...)``, ``CheckpointManager.save``) each
file becomes one content-addressed object, written once per distinct content (a config that
never changes costs nothing in the next checkpoint), and is named in the manifest.

After the fact (``stepvault attach RUN@STEP FILE``) a committed manifest is never rewritten:
its hash is what annotations, signatures and registry versions refer to. An *attachment
record* ``runs/<run>/attachments/<step>.<n>.json`` is created instead (exclusively, never
overwritten, bound to the manifest's BLAKE3 like an annotation), carrying the files inline
so that no garbage collector — including one of an older stepvault that only marks the
objects manifests name — can remove their content. A later record's file wins over an
earlier one and over the manifest's file of the same name.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..engine.fetch import fetch_object
from ..errors import CheckpointNotFoundError
from ..format.attachments import (
    RECORD_FORMAT,
    RECORD_VERSION,
    AttachmentEntry,
    AttachmentError,
    check_sizes,
    parse_record,
    record_files,
    validate_attachment_name,
)
from ..format.hashing import content_hash
from ..format.manifest import Manifest, ObjectEntry, parse_manifest
from ..format.objects import encode_object
from ..store import Store
from ..store.names import validate_run_name, validate_step
from ..store.signing import Signer
from .annotations import _user, manifest_id
from .numbered import put_numbered

AttachmentSource = bytes | bytearray | memoryview | str | os.PathLike
_RECORD = re.compile(r"^(0|[1-9][0-9]{0,17})\.([1-9][0-9]{0,8})\.json$")


def read_sources(attachments: Mapping[str, AttachmentSource]) -> dict[str, bytes]:
    """The bytes of each attachment: given as bytes, or as the path of a file to read now.

    Read at the call, so a file changed afterwards does not change what is saved.
    """
    if not isinstance(attachments, Mapping):
        raise AttachmentError(
            "attachments must map file names to bytes or paths, e.g. "
            "{'config.json': b'{...}'} or {'config.json': 'out/config.json'}"
        )
    files: dict[str, bytes] = {}
    for name, source in attachments.items():
        validate_attachment_name(name)
        if isinstance(source, bytes | bytearray | memoryview):
            files[name] = bytes(source)
        elif isinstance(source, str | os.PathLike):
            try:
                with open(source, "rb") as f:
                    files[name] = f.read()
            except OSError as exc:
                raise AttachmentError(
                    f"attachment {name!r}: cannot read {source!r}: {exc}"
                ) from None
        else:
            raise AttachmentError(
                f"attachment {name!r}: expected bytes or a file path, got {type(source).__name__}"
            )
    check_sizes(files)
    return files


def store_attachments(
    store: Store, files: Mapping[str, bytes]
) -> tuple[dict[str, AttachmentEntry], dict[str, ObjectEntry]]:
    """Write each file as a verified object (skipped when already stored); return the
    manifest's attachment table and the object entries it needs."""
    entries: dict[str, AttachmentEntry] = {}
    objects: dict[str, ObjectEntry] = {}
    for name, data in files.items():
        digest = content_hash(data)
        obj = encode_object(memoryview(data), "zstd", None, digest)
        if store.has_object(digest):
            # Reused: touched so that a concurrent GC's grace period protects it until the
            # manifest that names it is committed (the same rule as reused chunks).
            store.touch_object(digest)
            size = store.object_size(digest)
        else:
            store.put_object(digest, obj.parts)
            size = obj.size
        entries[name] = AttachmentEntry(digest, len(data))
        objects[digest] = ObjectEntry(obj.codec, size, len(data))
    return entries, objects


def add_attachments(
    store: Store, manifest: Manifest, attachments: Mapping[str, AttachmentSource] | None
) -> None:
    """Store ``attachments`` and name them in ``manifest`` (before it is committed)."""
    if not attachments:
        return
    entries, objects = store_attachments(store, read_sources(attachments))
    manifest.attachments = {**manifest.attachments, **entries}
    manifest.attachment_objects = {**manifest.attachment_objects, **objects}


@dataclass(frozen=True)
class Attachment:
    """One file of a checkpoint, as ``show``/``diff``/export see it."""

    name: str
    digest: str
    size: int
    #: ``"checkpoint"`` (saved with it) or the record key of a later ``stepvault attach``
    origin: str
    _store: Store
    _inline: bytes | None = None

    def read(self) -> bytes:
        """The file's bytes, verified against its hash."""
        if self._inline is not None:
            return self._inline
        return bytes(fetch_object(self._store, self.digest))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "blake3": self.digest, "size": self.size, "origin": self.origin}


def _record_keys(store: Store, run: str, step: int) -> list[str]:
    names = store.backend.list(f"runs/{validate_run_name(run)}/attachments")
    found = sorted(
        (int(m.group(2)), n) for n in names if (m := _RECORD.match(n)) and int(m.group(1)) == step
    )
    return [f"runs/{run}/attachments/{n}" for _, n in found]


def checkpoint_attachments(
    store: Store, run: str, step: int, manifest_data: bytes | None = None
) -> dict[str, Attachment]:
    """Every attachment of ``run@step``: the manifest's, then later records' (which win).

    A record made for another manifest of the same step (the step was saved again since)
    does not apply. A damaged record raises :class:`AttachmentError`, never is skipped
    silently: an export must not quietly fall back to an older file.
    """
    data = manifest_data if manifest_data is not None else store.read_manifest(run, step)
    manifest = parse_manifest(data, f"{run}@{step}")
    out = {
        name: Attachment(name, e.digest, e.size, "checkpoint", store)
        for name, e in manifest.attachments.items()
    }
    mid = manifest_id(data)
    for key in _record_keys(store, run, step):
        try:
            record = json.loads(store.backend.read_bytes(key))
        except FileNotFoundError:
            continue
        except ValueError:
            raise AttachmentError(f"{key}: damaged attachment record (not JSON)") from None
        if type(record) is not dict or record.get("manifest_blake3") != mid:
            continue
        for name, content in parse_record(record, key).items():
            out[name] = Attachment(name, content_hash(content), len(content), key, store, content)
    return out


def attach_after(
    store: Store,
    run: str,
    step: int,
    attachments: Mapping[str, AttachmentSource],
    *,
    note: str = "",
    signer: Signer | None = None,
) -> dict[str, Any]:
    """Attach files to the committed checkpoint ``run@step`` without touching its manifest;
    return the record written (its ``files`` without the inline content)."""
    validate_run_name(run)
    validate_step(step)
    files = read_sources(attachments)
    if not files:
        raise AttachmentError("nothing to attach: name at least one file")
    try:
        mid = manifest_id(store.read_manifest(run, step))
    except CheckpointNotFoundError as exc:
        raise AttachmentError(f"cannot attach to {run}@{step}: {exc}") from None
    record: dict[str, Any] = {
        "format": RECORD_FORMAT,
        "version": RECORD_VERSION,
        "run": run,
        "step": step,
        "manifest_blake3": mid,
        "files": record_files(files),
        "note": note,
        "time": time.time(),
        "user": _user(),
        "host": socket.gethostname(),
    }
    signer = signer if signer is not None else store.signer
    if signer is not None:
        record = signer.sign_record(record)
    data = json.dumps(record, sort_keys=True).encode()
    numbers = lambda: len(_record_keys(store, run, step)) + 1  # noqa: E731 (1..n, no gaps)
    key = put_numbered(store, f"runs/{run}/attachments", step, data, numbers)
    if key is None:
        raise AttachmentError(f"could not attach to {run}@{step}: too many concurrent attachments")
    files = record["files"].items()
    shown = {k: {kk: vv for kk, vv in v.items() if kk != "data"} for k, v in files}
    return {**{k: v for k, v in record.items() if k != "files"}, "files": shown, "key": key}


def diff_attachments(
    before: Mapping[str, Attachment], after: Mapping[str, Attachment]
) -> list[dict[str, Any]]:
    """Per file name: ``added``, ``removed``, ``changed`` or ``same`` (by content hash)."""
    rows = []
    for name in sorted({*before, *after}):
        a, b = before.get(name), after.get(name)
        if a is None:
            status = "added"
        elif b is None:
            status = "removed"
        else:
            status = "same" if a.digest == b.digest else "changed"
        rows.append(
            {
                "name": name,
                "status": status,
                "before": a.to_json() if a else None,
                "after": b.to_json() if b else None,
            }
        )
    return rows
