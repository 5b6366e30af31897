"""A per-run cache of checkpoint summaries, so that listing a long run is fast.

Listing a run used to parse every manifest in full (JSON body + schema: ~0.2 ms for a
manifest of 50 tensors, ~2 s for 10k checkpoints). The cache, ``runs/<run>/summaries.json``,
maps a manifest's *body checksum* (the ``body_blake3`` of its envelope) to the few numbers
a listing shows. It is only a cache, never a source of truth:

- every listing still reads every manifest and verifies its checksum; only a manifest
  whose checksum is intact *and* already summarised skips the full parse, so a damaged,
  replaced or new manifest is always parsed (and reported) as before;
- entries are keyed by content, so a stale entry cannot describe a different manifest;
- the file carries its own BLAKE3 checksum; a damaged or unreadable cache is ignored and
  rebuilt, and a store that cannot be written (read-only) simply gets no cache.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from .format.hashing import content_hash
from .format.manifest import MANIFEST_FORMAT_VERSION, MAX_MANIFEST_SIZE
from .store import Store, validate_run_name

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
)


def cache_key(run: str) -> str:
    return f"runs/{validate_run_name(run)}/summaries.json"


def verified_body_digest(data: bytes) -> str | None:
    """``body_blake3`` of a manifest whose envelope is well formed and whose body matches
    it (hashed here); None when anything is off — the full parse then says exactly what."""
    if len(data) > MAX_MANIFEST_SIZE:
        return None
    head, sep, body = data.partition(b"\n")
    if not sep:
        return None
    try:
        env = json.loads(head)
    except (ValueError, RecursionError):
        return None
    if type(env) is not dict or env.get("format") != "stepvault-manifest":
        return None
    version, digest = env.get("version"), env.get("body_blake3")
    if type(version) is not int or not 1 <= version <= MANIFEST_FORMAT_VERSION:
        return None
    if env.get("body_size") != len(body) or type(digest) is not str:
        return None
    return digest if content_hash(body) == digest else None


class SummaryCache:
    """The summaries of one run's manifests, keyed by body checksum."""

    def __init__(self, store: Store, run: str) -> None:
        self.store = store
        self.run = run
        self.key = cache_key(run)
        self._entries: dict[str, list[Any]] = {}
        self._used: set[str] = set()
        self._dirty = False
        with contextlib.suppress(Exception):  # a cache is never worth failing a listing
            self._entries = self._load()

    def _load(self) -> dict[str, list[Any]]:
        try:
            data = self.store.backend.read_bytes(self.key)
        except (FileNotFoundError, OSError):
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
        """Write the cache back if it changed (entries of deleted checkpoints dropped)."""
        if not self._dirty and self._used == set(self._entries):
            return
        entries = {d: self._entries[d] for d in sorted(self._used) if d in self._entries}
        # Not durable, and never an error: losing or failing to write the cache (a
        # read-only store, a crash) only costs the next listing a full parse.
        with contextlib.suppress(Exception):
            body = json.dumps(entries, separators=(",", ":"), allow_nan=False).encode()
            env = {
                "format": CACHE_FORMAT,
                "version": CACHE_VERSION,
                "run": self.run,
                "body_blake3": content_hash(body),
            }
            data = json.dumps(env, separators=(",", ":")).encode() + b"\n" + body
            self.store.backend.put_atomic(self.key, [data], overwrite=True, durable=False)


def _well_typed(s: dict[str, Any]) -> bool:
    ints = ("step", "logical_bytes", "stored_bytes", "new_bytes", "tensors")
    return (
        all(type(s[k]) is int and s[k] >= 0 for k in ints)
        and (s["epoch"] is None or type(s["epoch"]) is int)
        and type(s["created"]) in (int, float)
        and type(s["kind"]) is str
        and type(s["metrics"]) is dict
    )
