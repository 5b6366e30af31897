"""Per-run checkpoint summaries, so that listing a long run is fast.

Listing a run used to parse every manifest in full (JSON body + schema: ~0.2-0.5 ms for a
manifest of 50 tensors, seconds for 10k checkpoints). Two small files per run map a
manifest's *body checksum* (the ``body_blake3`` of its envelope) to the few numbers a
listing shows:

- ``runs/<run>/summaries.log``: one line appended by the writer right after it commits a
  manifest to a local store (so even the first listing of a long run needs no full parse);
- ``runs/<run>/summaries.json``: the compacted set, rewritten by a listing that found
  something new or stale (the log is then removed).

Both are only caches, never a source of truth:

- every listing still reads every manifest and verifies its checksum; only a manifest
  whose checksum is intact *and* already summarised skips the full parse, so a damaged,
  replaced or new manifest is always parsed (and reported) as before;
- entries are keyed by content, so a stale entry cannot describe a different manifest;
- each log line and the compacted file carry their own BLAKE3 checksum; anything damaged
  is ignored, and a store that cannot be written (read-only) simply gets no cache.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from ..engine.object_lists import manifest_envelope
from ..format.hashing import content_hash
from ..format.manifest import MANIFEST_FORMAT_VERSION, Manifest
from ..store import Store, validate_run_name
from ..store.local import LocalBackend

CACHE_FORMAT = "stepvault-summary-cache"
CACHE_VERSION = 1
#: Summary fields, in the order an entry stores them.
FIELDS = (
    "step",
    "epoch",
    "created",
    "kind",
    "metrics",
    "logical_bytes",
    "stored_bytes",
    "new_bytes",
    "tensors",
    "base_step",
)


def cache_key(run: str) -> str:
    return f"runs/{validate_run_name(run)}/summaries.json"


def log_key(run: str) -> str:
    return f"runs/{validate_run_name(run)}/summaries.log"


def summary_of(m: Manifest) -> dict[str, Any]:
    """What a listing shows of one checkpoint."""
    return {
        "step": m.step,
        "epoch": m.epoch,
        "created": m.created,
        "kind": m.kind,
        "metrics": dict(m.metrics),
        "logical_bytes": m.logical_bytes,
        "stored_bytes": m.stored_bytes,
        "new_bytes": int(m.stats.get("new_bytes", 0)),
        "tensors": len(m.tensors),
        "base_step": m.light["base_step"] if m.light else None,
    }


def verified_body_digest(data: bytes) -> str | None:
    """``body_blake3`` of a manifest whose envelope is well formed and whose body matches
    it (hashed here); None when anything is off — the full parse then says exactly what."""
    env = manifest_envelope(data)
    if env is None:
        return None
    version, digest = env.get("version"), env.get("body_blake3")
    if type(version) is not int or not 1 <= version <= MANIFEST_FORMAT_VERSION:
        return None
    body = data.partition(b"\n")[2]
    if env.get("body_size") != len(body) or type(digest) is not str:
        return None
    return digest if content_hash(body) == digest else None


def _entry_json(digest: str, entry: list[Any]) -> bytes:
    return json.dumps([digest, entry], separators=(",", ":"), allow_nan=False).encode()


def record_commit(store: Store, manifest: Manifest, data: bytes) -> None:
    """Append the summary of a just-committed manifest (``data`` as written) to its run's
    log. Never raises: a missing entry only costs a listing one full parse.

    Local stores only: on object stores an append is a read-modify-write of the whole log
    (extra requests on every save); there the listing's compacted file is the only cache.
    """
    if not isinstance(store.backend, LocalBackend):
        return
    with contextlib.suppress(Exception):
        digest = verified_body_digest(data)
        if digest is None:
            return
        summary = summary_of(manifest)
        payload = _entry_json(digest, [summary[f] for f in FIELDS])
        # "<blake3 of payload> <payload>": a reader checks the bytes as they are, without
        # re-encoding the entry (that re-encoding was half of absorbing a 10k-line log).
        line = content_hash(payload).encode() + b" " + payload + b"\n"
        store.backend.append(log_key(manifest.run), line)


class SummaryCache:
    """The summaries of one run's manifests, keyed by body checksum."""

    def __init__(self, store: Store, run: str) -> None:
        self.store = store
        self.run = run
        self._entries: dict[str, list[Any]] = {}
        self._used: set[str] = set()
        self._dirty = False
        self._had_log = False
        with contextlib.suppress(Exception):  # a cache is never worth failing a listing
            self._entries = self._load_compacted()
        with contextlib.suppress(Exception):
            self._load_log()

    def _load_compacted(self) -> dict[str, list[Any]]:
        try:
            data = self.store.backend.read_bytes(cache_key(self.run))
        except OSError:  # absent, or not a regular file
            return {}
        head, sep, body = data.partition(b"\n")
        env = json.loads(head)
        if (
            not sep
            or env.get("format") != CACHE_FORMAT
            or env.get("version") != CACHE_VERSION
            or env.get("run") != self.run
            or env.get("body_blake3") != content_hash(body)
        ):
            return {}
        entries = json.loads(body)
        return entries if type(entries) is dict else {}

    def _load_log(self) -> None:
        try:
            data = self.store.backend.read_bytes(log_key(self.run))
        except OSError:
            return
        self._had_log = True
        for line in data.splitlines():
            try:
                checksum, _, payload = line.partition(b" ")
                if content_hash(payload).encode() != checksum:
                    continue  # a torn or damaged line (or an older line format): ignored
                digest, entry = json.loads(payload)
                if type(digest) is str:
                    self._entries[digest] = entry
                    self._dirty = True  # compacted into summaries.json by save()
            except (ValueError, TypeError, RecursionError):
                continue

    def get(self, digest: str, step: int) -> dict[str, Any] | None:
        """The cached summary of the manifest with this body checksum (for ``step``)."""
        entry = self._entries.get(digest)
        if type(entry) is not list or len(entry) != len(FIELDS):
            return None
        summary = dict(zip(FIELDS, entry))
        if not _well_typed(summary) or summary["step"] != step:
            return None
        self._used.add(digest)
        return summary

    def put(self, digest: str, summary: dict[str, Any]) -> None:
        self._entries[digest] = [summary[f] for f in FIELDS]
        self._used.add(digest)
        self._dirty = True

    def save(self) -> None:
        """Write the compacted cache if it changed (entries of checkpoints that were not
        listed dropped) and remove the log it absorbed."""
        if not self._dirty and self._used == set(self._entries):
            return
        entries = {d: self._entries[d] for d in sorted(self._used) if d in self._entries}
        # Not durable, and never an error: losing or failing to write the cache (a
        # read-only store, a crash) only costs the next listing a full parse. A line a
        # writer appends between our read of the log and its removal is lost the same way.
        with contextlib.suppress(Exception):
            body = json.dumps(entries, separators=(",", ":"), allow_nan=False).encode()
            env = {
                "format": CACHE_FORMAT,
                "version": CACHE_VERSION,
                "run": self.run,
                "body_blake3": content_hash(body),
            }
            data = json.dumps(env, separators=(",", ":")).encode() + b"\n" + body
            self.store.backend.put_atomic(
                cache_key(self.run), [data], overwrite=True, durable=False
            )
            if self._had_log:
                self.store.backend.delete(log_key(self.run))


def _well_typed(s: dict[str, Any]) -> bool:
    ints = ("step", "logical_bytes", "stored_bytes", "new_bytes", "tensors")
    return (
        all(type(s[k]) is int and s[k] >= 0 for k in ints)
        and (s["epoch"] is None or type(s["epoch"]) is int)
        and type(s["created"]) in (int, float)
        and type(s["kind"]) is str
        and type(s["metrics"]) is dict
    )
