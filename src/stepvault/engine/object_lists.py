"""Object lists recorded at commit, so that GC's mark does not parse every manifest.

The mark phase of a sweep needs every object each committed manifest names. Parsing a
manifest in full (JSON body, schema checks, tensor tables) costs ~0.2-0.5 ms for 50
tensors, seconds for a store of 10k checkpoints. The writer already holds that list when
it commits, so it records it, keyed by the manifest's *body checksum* (``body_blake3`` of
its envelope, the first line of the manifest):

- ``runs/<run>/objects.log``: one line appended right after each commit to a local store,
  ``"<blake3 of payload> <payload>"`` with payload ``[body_blake3, [object, ...]]``;
- ``runs/<run>/objects.json``: the compacted map, rewritten by a sweep that found
  manifests missing from it (the log is then removed). On object stores, where an append
  is a read-modify-write, this compacted file is the only record.

Only a cache, never a source of truth: the mark still lists every run and reads every
manifest (a manifest it cannot read stops the sweep, as before); it takes the recorded list
only when the manifest's envelope names a checksum the list was recorded for, so a
rewritten, thinned or unknown manifest is parsed as before. Every log line and the
compacted file carry their own checksum; anything damaged is ignored.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from typing import Any

from ..format.hashing import content_hash
from ..format.manifest import MAX_MANIFEST_SIZE, Manifest
from ..store import Store, validate_run_name
from ..store.local import LocalBackend

LIST_FORMAT = "stepvault-object-lists"
LIST_VERSION = 1


def log_key(run: str) -> str:
    return f"runs/{validate_run_name(run)}/objects.log"


def compacted_key(run: str) -> str:
    return f"runs/{validate_run_name(run)}/objects.json"


def manifest_envelope(data: bytes) -> dict[str, Any] | None:
    """The envelope (first line) of a manifest, parsed without its body; None when it is
    not one (the caller then parses the manifest in full, which says what is off)."""
    if len(data) > MAX_MANIFEST_SIZE:
        return None
    head, sep, _ = data.partition(b"\n")
    if not sep:
        return None
    try:
        env = json.loads(head)
    except (ValueError, RecursionError):
        return None
    if type(env) is not dict or env.get("format") != "stepvault-manifest":
        return None
    return env


def envelope_digest(data: bytes) -> str | None:
    """The ``body_blake3`` a manifest's envelope names (body neither parsed nor hashed)."""
    env = manifest_envelope(data)
    digest = env.get("body_blake3") if env is not None else None
    return digest if type(digest) is str else None


def _line(digest: str, objects: Iterable[str]) -> bytes:
    payload = json.dumps([digest, sorted(objects)], separators=(",", ":")).encode()
    return content_hash(payload).encode() + b" " + payload + b"\n"


def record_objects(store: Store, manifest: Manifest, data: bytes) -> None:
    """Append the object list of a just-committed manifest (``data`` as written) to its
    run's log. Never raises: a missing line only costs the next sweep one full parse.
    Stores without a cheap append (object stores) record nothing here."""
    if not isinstance(store.backend, LocalBackend):
        return  # an append is a read-modify-write there: it would grow with the run
    with contextlib.suppress(Exception):
        digest = envelope_digest(data)
        if digest is None:
            return
        # Exactly the serialised ``objects`` table: attachment objects are merged into it.
        named = {**manifest.attachment_objects, **manifest.objects}
        store.backend.append(log_key(manifest.run), _line(digest, named))


def load_object_lists(store: Store, run: str) -> tuple[dict[str, list[str]], bool]:
    """The recorded lists of ``run`` (body checksum -> objects), and whether a log was
    absorbed (then :func:`save_object_lists` should compact)."""
    lists: dict[str, list[str]] = {}
    with contextlib.suppress(Exception):  # a cache is never worth failing a sweep
        data = store.backend.read_bytes(compacted_key(run))
        head, sep, body = data.partition(b"\n")
        env = json.loads(head)
        if (
            sep
            and env.get("format") == LIST_FORMAT
            and env.get("version") == LIST_VERSION
            and env.get("run") == run
            and env.get("body_blake3") == content_hash(body)
        ):
            entries = json.loads(body)
            if type(entries) is dict:
                lists = entries
    had_log = False
    with contextlib.suppress(Exception):
        data = store.backend.read_bytes(log_key(run))
        had_log = True
        for line in data.splitlines():
            checksum, _, payload = line.partition(b" ")
            if content_hash(payload).encode() != checksum:
                continue  # a torn or damaged line: ignored
            with contextlib.suppress(ValueError, TypeError, RecursionError):
                digest, objects = json.loads(payload)
                if type(digest) is str and type(objects) is list:
                    lists[digest] = objects
    return {d: o for d, o in lists.items() if _well_formed(o)}, had_log


def _well_formed(objects: object) -> bool:
    return type(objects) is list and all(type(o) is str for o in objects)


def save_object_lists(store: Store, run: str, lists: dict[str, list[str]], had_log: bool) -> None:
    """Write the compacted lists of ``run`` (the manifests it holds now) and remove the log
    it absorbed. Not durable and never an error: losing it costs the next sweep parses."""
    with contextlib.suppress(Exception):
        body = json.dumps(lists, separators=(",", ":"), sort_keys=True).encode()
        env = {
            "format": LIST_FORMAT,
            "version": LIST_VERSION,
            "run": run,
            "body_blake3": content_hash(body),
        }
        data = json.dumps(env, separators=(",", ":")).encode() + b"\n" + body
        store.backend.put_atomic(compacted_key(run), [data], overwrite=True, durable=False)
        if had_log:
            store.backend.delete(log_key(run))
