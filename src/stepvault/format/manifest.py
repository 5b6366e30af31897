"""Manifests: the committed description of one checkpoint (versioned JSON with a checksum).

A manifest file has two lines::

    {"format":"stepvault-manifest","version":1,"body_blake3":"<hex>","body_size":N}\\n
    <body: N bytes of UTF-8 JSON>

The envelope's hash covers the body bytes exactly as stored, so any reader can check a
manifest without re-serialising JSON. The body schema is documented in FORMAT.md and
checked by :func:`parse_manifest` before anything else looks at it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, overload

from ..errors import InvalidNameError, ManifestError, StoreVersionError
from ..store.names import validate_run_name
from .attachments import AttachmentEntry, parse_attachments
from .dtypes import dtype_info
from .hashing import content_hash
from .objects import MAX_RAW_SIZE

MANIFEST_FORMAT_VERSION = 1
#: Envelope version of a light checkpoint's manifest (it has a ``light`` section, FORMAT.md
#: §12): a reader of version 1 refuses it ("upgrade stepvault") instead of misreading it.
LIGHT_MANIFEST_VERSION = 2
_HASH = re.compile(r"^[0-9a-f]{64}$")
#: Manifests larger than this are refused (a manifest of 100k tensors is ~15 MB).
MAX_MANIFEST_SIZE = 1 << 28


@dataclass
class TensorEntry:
    """One tensor or numpy array: dtype, shape and the byte ranges that hold it."""

    dtype: str
    shape: list[int]
    chunks: list[tuple[str, int, int]]  # (object hash, offset in decoded object, length)
    kind: str = "tensor"  # "tensor" (torch) or "ndarray" (numpy)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_info(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "chunks": [list(c) for c in self.chunks],
        }


@dataclass
class ObjectEntry:
    codec: str
    size: int  # stored bytes (header + payload)
    raw_size: int

    def to_json(self) -> dict[str, Any]:
        return {"codec": self.codec, "size": self.size, "raw_size": self.raw_size}


@dataclass
class Manifest:
    """In-memory form of a manifest body."""

    run: str
    step: int
    created: float
    epoch: int | None = None
    kind: str = "full"
    parent_step: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    metadata: Any = None  # safe-encoded JSON value
    state: Any = None  # safe-encoded JSON value referencing tensors by name
    state_kinds: dict[str, str] = field(default_factory=dict)
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    objects: dict[str, ObjectEntry] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    #: checkpoints written by several ranks (torch.distributed.checkpoint): see FORMAT.md
    sharded: dict[str, Any] | None = None
    #: BLAKE3 of the run's lineage record (``runs/<run>/lineage/<hash>.json``), if recorded
    lineage: str | None = None
    #: small files saved with the checkpoint (FORMAT.md §4); their objects are in ``objects``
    attachments: dict[str, AttachmentEntry] = field(default_factory=dict)
    #: table entries of the attachment objects, merged into ``objects`` when serialised
    attachment_objects: dict[str, ObjectEntry] = field(default_factory=dict, repr=False)
    #: a light checkpoint's base and per-tensor encodings (FORMAT.md §12); None otherwise
    light: dict[str, Any] | None = None

    @property
    def logical_bytes(self) -> int:
        total = sum(t.nbytes for t in self.tensors.values())
        if self.sharded:
            for e in self.sharded["entries"].values():
                if e["type"] == "tensor":
                    item = dtype_info(e["dtype"]).itemsize
                    total += sum(math.prod(sh["sizes"]) * item for sh in e["shards"])
        return total

    @property
    def stored_bytes(self) -> int:
        # With the attachments' objects: the committed manifest lists them in ``objects``,
        # so a manifest being written (kept apart) and the same one read back say the same
        # (listings cached at commit showed 276 B less than ``show`` of the same checkpoint).
        return sum(o.size for o in {**self.attachment_objects, **self.objects}.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "step": self.step,
            "epoch": self.epoch,
            "created": self.created,
            "kind": self.kind,
            "parent_step": self.parent_step,
            "metrics": self.metrics,
            "metadata": self.metadata,
            "state_kinds": self.state_kinds,
            "state": self.state,
            "tensors": {k: v.to_json() for k, v in self.tensors.items()},
            "objects": {
                k: v.to_json() for k, v in {**self.attachment_objects, **self.objects}.items()
            },
            "stats": self.stats,
            "environment": self.environment,
            **({"sharded": self.sharded} if self.sharded is not None else {}),
            **({"lineage": self.lineage} if self.lineage is not None else {}),
            **(
                {"attachments": {k: v.to_json() for k, v in self.attachments.items()}}
                if self.attachments
                else {}
            ),
            **({"light": self.light} if self.light is not None else {}),
        }


def serialize_manifest(manifest: Manifest) -> bytes:
    """Envelope line + JSON body, as written to ``runs/<run>/checkpoints/<step>.json``."""
    body = json.dumps(manifest.to_json(), separators=(",", ":"), allow_nan=False).encode()
    envelope = {
        "format": "stepvault-manifest",
        "version": MANIFEST_FORMAT_VERSION if manifest.light is None else LIGHT_MANIFEST_VERSION,
        "body_blake3": content_hash(body),
        "body_size": len(body),
    }
    return json.dumps(envelope, separators=(",", ":")).encode() + b"\n" + body


def parse_manifest(data: bytes, where: str = "manifest") -> Manifest:
    """Check a manifest's envelope, checksum and schema; return it or raise ManifestError."""
    if len(data) > MAX_MANIFEST_SIZE:
        raise ManifestError(f"{where}: manifest of {len(data)} bytes exceeds the limit")
    head, sep, body = data.partition(b"\n")
    if not sep:
        raise ManifestError(f"{where}: truncated manifest (no envelope line)")
    try:
        env = json.loads(head)
        fmt, version = env["format"], env["version"]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise ManifestError(f"{where}: damaged manifest envelope") from exc
    if fmt != "stepvault-manifest":
        raise ManifestError(f"{where}: not a stepvault manifest (format {fmt!r})")
    if type(version) is not int or version < 1:
        raise ManifestError(f"{where}: damaged manifest envelope (version {version!r})")
    if version > LIGHT_MANIFEST_VERSION:
        raise StoreVersionError(
            f"{where}: manifest version {version!r} is newer than this stepvault reads "
            f"({LIGHT_MANIFEST_VERSION}); upgrade stepvault"
        )
    if env.get("body_size") != len(body):
        raise ManifestError(
            f"{where}: manifest body is {len(body)} bytes, envelope says {env.get('body_size')}"
            " (truncated?)"
        )
    if env.get("body_blake3") != content_hash(body):
        raise ManifestError(f"{where}: manifest checksum mismatch (damaged or altered)")
    try:
        doc = json.loads(body)
        return _from_json(doc)
    except ManifestError as exc:
        raise ManifestError(f"{where}: {exc}") from None
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
        raise ManifestError(f"{where}: manifest violates the schema: {exc!r}") from exc


@overload
def _int(v: Any, what: str, *, nullable: Literal[False] = ..., minimum: int = ...) -> int: ...
@overload
def _int(v: Any, what: str, *, nullable: bool, minimum: int = ...) -> int | None: ...
def _int(v: Any, what: str, *, nullable: bool = False, minimum: int = 0) -> int | None:
    if v is None and nullable:
        return None
    if type(v) is not int or v < minimum:
        raise ManifestError(f"{what} must be an int >= {minimum}, got {v!r}")
    return v


def _from_json(doc: dict[str, Any]) -> Manifest:
    if type(doc) is not dict:
        raise ManifestError("manifest body is not an object")
    objects: dict[str, ObjectEntry] = {}
    for digest, o in doc["objects"].items():
        if not _HASH.match(digest):
            raise ManifestError(f"bad object hash {digest!r}")
        raw_size = _int(o["raw_size"], "object raw_size")
        if raw_size > MAX_RAW_SIZE:
            raise ManifestError(f"object {digest[:16]}… raw_size {raw_size} exceeds the limit")
        if type(o["codec"]) is not str:
            raise ManifestError("object codec must be a str")
        objects[digest] = ObjectEntry(o["codec"], _int(o["size"], "object size"), raw_size)
    tensors: dict[str, TensorEntry] = {}
    for name, t in doc["tensors"].items():
        if not name or "\x00" in name:
            raise ManifestError(f"bad tensor name {name!r}")
        shape = t["shape"]
        if type(shape) is not list or len(shape) > 64:
            raise ManifestError(f"tensor {name!r}: bad shape")
        for d in shape:
            _int(d, f"tensor {name!r} dimension")
        kind = t.get("kind", "tensor")
        if kind not in ("tensor", "ndarray"):
            raise ManifestError(f"tensor {name!r}: unknown kind {kind!r}")
        try:
            itemsize = dtype_info(t["dtype"]).itemsize
        except ValueError as exc:
            raise ManifestError(f"tensor {name!r}: {exc}") from None
        chunks, total = [], 0
        for c in t["chunks"]:
            if type(c) is not list or len(c) != 3:
                raise ManifestError(f"tensor {name!r}: bad chunk entry")
            digest, off, length = c
            obj = objects.get(digest)
            if obj is None:
                raise ManifestError(f"tensor {name!r}: chunk names unlisted object {digest!r}")
            _int(off, "chunk offset")
            _int(length, "chunk length")
            if off + length > obj.raw_size:
                raise ManifestError(f"tensor {name!r}: chunk range beyond its object")
            chunks.append((digest, off, length))
            total += length
        # Checked with the chunk total, so an absurd shape cannot pass without absurd chunks.
        if math.prod(shape) * itemsize != total:
            raise ManifestError(
                f"tensor {name!r}: shape {shape} x {t['dtype']} needs "
                f"{math.prod(shape) * itemsize} bytes, chunks hold {total}"
            )
        tensors[name] = TensorEntry(t["dtype"], shape, chunks, kind)
    metrics = doc.get("metrics") or {}
    if type(metrics) is not dict:
        raise ManifestError("metrics must be an object")
    epoch = _int(doc.get("epoch"), "epoch", nullable=True)
    sharded = doc.get("sharded")
    if sharded is not None:
        _check_sharded(sharded, objects)
    lineage = doc.get("lineage")
    if lineage is not None and (type(lineage) is not str or not _HASH.match(lineage)):
        raise ManifestError(f"bad lineage reference {lineage!r}")
    return Manifest(
        run=_run_name(doc["run"]),
        step=_int(doc["step"], "step"),
        created=float(doc["created"]),
        epoch=epoch,
        kind=str(doc.get("kind", "full")),
        parent_step=_int(doc.get("parent_step"), "parent_step", nullable=True),
        metrics=metrics,
        metadata=doc.get("metadata"),
        state=doc.get("state"),
        state_kinds=dict(doc.get("state_kinds") or {}),
        tensors=tensors,
        objects=objects,
        stats=dict(doc.get("stats") or {}),
        environment=dict(doc.get("environment") or {}),
        sharded=sharded,
        lineage=lineage,
        attachments=parse_attachments(doc.get("attachments"), objects),
        light=_check_light(doc.get("light"), tensors),
    )


def _check_light(light: Any, tensors: dict[str, TensorEntry]) -> dict[str, Any] | None:
    """The ``light`` section, schema-checked (its encodings are checked when decoded)."""
    if light is None:
        return None
    if type(light) is not dict or type(light.get("tensors")) is not dict:
        raise ManifestError("light section must hold a 'tensors' object")
    _int(light.get("base_step"), "light base_step")
    for name, e in light["tensors"].items():
        if name not in tensors or type(e) is not dict:
            raise ManifestError(f"light entry {name!r} names no tensor of the manifest")
        if e.get("encoding") not in ("delta", "base"):
            raise ManifestError(f"light entry {name!r}: unknown encoding {e.get('encoding')!r}")
    return light


def _check_sharded(sharded: Any, objects: dict[str, ObjectEntry]) -> None:
    """Schema and consistency checks of the ``sharded`` section (before any allocation)."""
    if type(sharded) is not dict or type(sharded.get("entries")) is not dict:
        raise ManifestError("sharded section must hold an 'entries' object")
    paths = sharded.get("paths", {})
    if type(paths) is not dict:
        raise ManifestError("sharded.paths must be an object")
    for fqn, e in sharded["entries"].items():
        if type(e) is not dict or e.get("type") not in ("tensor", "value"):
            raise ManifestError(f"sharded entry {fqn!r}: bad type")
        if e["type"] == "value":
            continue
        try:
            itemsize = dtype_info(e["dtype"]).itemsize
        except ValueError as exc:
            raise ManifestError(f"sharded entry {fqn!r}: {exc}") from None
        size = e.get("size")
        if type(size) is not list or len(size) > 64:
            raise ManifestError(f"sharded entry {fqn!r}: bad size")
        for d in size:
            _int(d, f"sharded entry {fqn!r} dimension")
        for sh in e.get("shards", []):
            offsets, sizes = sh.get("offsets"), sh.get("sizes")
            if (
                type(offsets) is not list
                or type(sizes) is not list
                or not (len(offsets) == len(sizes) == len(size))
            ):
                raise ManifestError(f"sharded entry {fqn!r}: bad shard box")
            for o, n, d in zip(offsets, sizes, size):
                _int(o, "shard offset")
                _int(n, "shard size")
                if o + n > d:
                    raise ManifestError(f"sharded entry {fqn!r}: shard beyond the tensor")
            total = 0
            for c in sh.get("chunks", []):
                if type(c) is not list or len(c) != 3 or c[0] not in objects:
                    raise ManifestError(f"sharded entry {fqn!r}: bad chunk reference")
                _int(c[1], "chunk offset")
                _int(c[2], "chunk length")
                if c[1] + c[2] > objects[c[0]].raw_size:
                    raise ManifestError(f"sharded entry {fqn!r}: chunk range beyond its object")
                total += c[2]
            if total != math.prod(sizes) * itemsize:
                raise ManifestError(f"sharded entry {fqn!r}: shard bytes do not match its box")


def _run_name(value: Any) -> str:
    try:
        return validate_run_name(value)
    except InvalidNameError as exc:
        raise ManifestError(f"bad run name in manifest: {exc}") from None


def _bad(what: str):
    raise ManifestError(f"manifest field {what!r} has the wrong type")
