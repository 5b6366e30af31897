"""The store: layout of a stepvault repository on top of a :class:`Backend`.

::

    <root>/
      stepvault.json                       store format version and settings
      objects/<2 hex>/<hash>               content-addressed objects
      runs/<run>/run.json                  run metadata
      runs/<run>/checkpoints/<step>.json   committed manifests (the only source of truth)
      runs/<run>/checkpoints/<step>.sig    detached signature of a manifest (signed stores)
      refs/pins/  refs/holds/              checkpoints protected by users / by the registry
      refs/leases/<run>.json               the run's writer lease (store/lease.py)
      refs/fences/<run>/<epoch>.json       what was visible when lease epoch <epoch> began
      refs/registry/  events/              model registry and event log (upper layers)
      tmp/                                 in-flight writes; never read by restore

This layer moves opaque bytes; what an object or manifest *means* is the format layer's.

(Longer than most modules on purpose: :class:`Store` is the one place that knows the
layout above, so every key is built, read and fenced here and nowhere else.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    LockBrokenError,
    ManifestError,
    StepvaultError,
    StoreNotFoundError,
    StoreVersionError,
)
from .backend import Backend, Buffer
from .fencing import FenceRecords, fence_key, manifest_stamp, manifest_version, stamp_manifest
from .local import LocalBackend
from .names import validate_run_name, validate_step
from .signing import Signer, signer_from_env

#: Version of the store layout written by this code; readers refuse newer ones.
STORE_FORMAT_VERSION = 1
SETTINGS_KEY = "stepvault.json"
_HASH = re.compile(r"^[0-9a-f]{64}$")
_STEP_FILE = re.compile(r"^(0|[1-9][0-9]{0,17})\.json$")
_HOLD_FILE = re.compile(r"^(0|[1-9][0-9]{0,17})@(.+)\.json$")
_UNSET = object()
#: how long node memory reuses the hot store's fence records before listing them again
FENCE_MEMO_SECONDS = 5.0


class Fence(Protocol):
    """What a commit of a fenced run checks: the writer lease (:class:`~.lease.Lease`)."""

    def guard(self, what: str) -> AbstractContextManager[None]:
        """Held around making ``what`` visible; raises when this writer may not write."""
        ...

    def stamp(self) -> dict[str, Any] | None:
        """``{"epoch", "token"}`` recorded in the envelope of every manifest committed
        under this fence (FORMAT.md §8, "the fence rule"); None: no stamp."""
        ...


def backend_for(root: str | os.PathLike[str] | Backend, **storage_options: Any) -> Backend:
    """Pick the backend for ``root``: a Backend instance, a local path or ``file://`` URL
    (:class:`LocalBackend`), or any other fsspec URL such as ``s3://bucket/prefix`` or
    ``memory://name`` (:class:`~stepvault.store.fsspec_backend.FsspecBackend`;
    ``storage_options`` go to its filesystem)."""
    if isinstance(root, Backend):
        return root
    text = os.fspath(root)
    if text.startswith("file://"):
        text = text[len("file://") :]
    elif "://" in text:
        from .fsspec_backend import open_fsspec

        return open_fsspec(text, **storage_options)
    return LocalBackend(text)


class Store:
    """A stepvault repository: objects, manifests and settings on one backend."""

    def __init__(self, backend: Backend, settings: dict[str, Any]) -> None:
        self.backend = backend
        self.settings = settings
        self._signer: Signer | object | None = _UNSET
        #: run -> its writer's lease: every manifest commit and delete of that run through
        #: this store is checked against the lease's token, atomically with the rename or
        #: conditional write where the backend allows (set by the manager, store/lease.py)
        self.fences: dict[str, Fence] = {}
        #: where the fence records of this store's runs live, as ``(store, run)``: None for
        #: a store that holds its own (``refs/fences/``); a node-memory tier names the hot
        #: store and its run there, so a memory copy obeys the same rule as the disk
        self.fence_source: tuple[Store, str] | None = None
        #: node memory: the source's fence records by run, with when they were read
        self._fence_memo: dict[str, tuple[float, FenceRecords]] = {}
        #: fence records read so far, ``(run, epoch) -> record`` (immutable once written)
        self._fence_cache: dict[tuple[str, int], dict[str, Any]] = {}
        #: stamps of manifests known here, ``(run, step) -> stamp`` (this store's commits and
        #: envelopes read): a listing reads only the envelopes of steps it has not seen
        self._stamps: dict[tuple[str, int], dict[str, Any] | None] = {}
        #: manifest versions (envelope ``body_blake3``) read with those stamps
        self._versions: dict[tuple[str, int], str | None] = {}
        #: ``(run, step, reason)`` of late manifests this store's commits removed (the
        #: manager logs them as ``stale_commit_removed`` events)
        self.stale_removed: list[tuple[str, int, str]] = []

    # -- opening -------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str] | Backend | Store,
        *,
        create: bool = False,
        defaults: dict[str, Any] | None = None,
    ) -> Store:
        """Open the store at ``root``; with ``create=True`` initialise it when absent.

        ``defaults`` are settings recorded when the store is created (chunk size, codec...);
        an existing store keeps its recorded settings.
        """
        if isinstance(root, Store):
            return root  # already open (e.g. a tier's store handed to restore)
        backend = backend_for(root)
        try:
            raw = backend.read_bytes(SETTINGS_KEY)
        except NotADirectoryError:
            raise StoreNotFoundError(
                f"{backend.url} is a file (or lies under one), not a stepvault store: name "
                "the store's directory, or a new one for a new store"
            ) from None
        except FileNotFoundError:
            if not create:
                raise StoreNotFoundError(
                    f"no stepvault store at {backend.url} (missing {SETTINGS_KEY}); "
                    "save a checkpoint there first, or check the path"
                ) from None
            settings = {
                "format": "stepvault-store",
                "version": STORE_FORMAT_VERSION,
                "created": time.time(),
                **(defaults or {}),
            }
            data = (json.dumps(settings, indent=2, sort_keys=True) + "\n").encode()
            try:
                backend.put_atomic(SETTINGS_KEY, [data], overwrite=False)
                backend.sync()
            except FileExistsError:
                pass  # another process created it first; read theirs
            raw = backend.read_bytes(SETTINGS_KEY)
        settings = _parse_settings(raw, backend.url)
        return cls(backend, settings)

    # -- keys ----------------------------------------------------------------------------
    @staticmethod
    def object_key(digest: str) -> str:
        if not _HASH.match(digest):
            raise ValueError(f"not an object hash: {digest!r}")
        return f"objects/{digest[:2]}/{digest}"

    @staticmethod
    def manifest_key(run: str, step: int) -> str:
        return f"runs/{validate_run_name(run)}/checkpoints/{validate_step(step)}.json"

    # -- objects -------------------------------------------------------------------------
    def has_object(self, digest: str) -> bool:
        return self.backend.exists(self.object_key(digest))

    def put_object(self, digest: str, parts: Sequence[Buffer]) -> None:
        """Write an object durably under its content hash (idempotent)."""
        self.backend.put_atomic(self.object_key(digest), parts, overwrite=True, durable=True)

    def stage_object(self, digest: str, parts: Sequence[Buffer]) -> object:
        """Write an object that becomes visible only at :meth:`publish_objects`."""
        return self.backend.put_staged(self.object_key(digest), parts)

    def publish_objects(self, tokens: Sequence[object]) -> None:
        """Make staged objects durable, then visible; the names need :meth:`sync` after."""
        self.backend.publish(tokens)

    def discard_objects(self, tokens: Sequence[object]) -> None:
        """Drop staged objects of a save that failed."""
        self.backend.discard(tokens)

    def read_object(self, digest: str) -> bytes:
        return self.backend.read_bytes(self.object_key(digest))

    def map_object(self, digest: str) -> memoryview | None:
        return self.backend.map(self.object_key(digest))

    def object_size(self, digest: str) -> int:
        return self.backend.size(self.object_key(digest))

    def touch_object(self, digest: str) -> bool | None:
        """Refresh an object's mtime: a save reuses it, so GC's grace period must cover it.

        True when the object was there, False when absent, None when the backend cannot tell.
        """
        return self.backend.touch(self.object_key(digest))

    def object_mtime(self, digest: str) -> float:
        return self.backend.mtime(self.object_key(digest))

    def delete_object(self, digest: str) -> None:
        self.backend.delete(self.object_key(digest))

    def quarantine_object(self, digest: str) -> str:
        """Move a damaged object out of ``objects/`` so dedup never reuses it again.

        The bytes are kept under ``quarantine/<hash>`` for inspection; the next save that
        needs this content writes a fresh, good copy.
        """
        key = self.object_key(digest)
        target = f"quarantine/{digest}"
        try:
            data = self.backend.read_bytes(key)
        except FileNotFoundError:
            return target
        except OSError:  # not a regular file (a planted symlink): just remove the name
            self.backend.delete(key)
            return target
        self.backend.put_atomic(target, [data], overwrite=True)
        self.backend.delete(key)
        self.backend.sync()
        return target

    def iter_objects(self) -> Iterator[str]:
        """Every object hash present in the store (committed or not)."""
        for prefix in self.backend.list("objects"):
            if len(prefix) != 2:
                continue
            for name in self.backend.list(f"objects/{prefix}"):
                if _HASH.match(name) and name.startswith(prefix):
                    yield name

    def sync(self) -> None:
        self.backend.sync()

    # -- runs and manifests ----------------------------------------------------------------
    def list_runs(self) -> list[str]:
        runs = []
        for name in self.backend.list("runs"):
            try:
                validate_run_name(name)
            except ValueError:
                continue
            runs.append(name)
        return runs

    def list_steps(self, run: str) -> list[int]:
        """Committed steps of ``run`` in ascending order: every manifest present except the
        ones the fence rule refuses (:meth:`stale_commits`: landed after a takeover)."""
        steps = self.listed_steps(run)
        if not steps:
            return steps
        stale = self.stale_commits(run, steps)
        return [s for s in steps if s not in stale] if stale else steps

    def listed_steps(self, run: str) -> list[int]:
        """Every step with a manifest file, late ones included (what :meth:`list_steps`
        filters; for the owner's removal of late manifests and for diagnostics)."""
        names = self.backend.list(f"runs/{validate_run_name(run)}/checkpoints")
        return sorted(int(m.group(1)) for n in names if (m := _STEP_FILE.match(n)))

    # -- the fence rule (FORMAT.md §8): manifests that landed after a takeover -------------
    def fence_records(self, run: str) -> FenceRecords:
        """The fence records of ``run`` (of :attr:`fence_source` where set): one listing,
        and a read of each record not seen before (records never change)."""
        if self.fence_source is not None and self.fence_source[0] is not self:
            # Node memory: its listings run on every memory save, and must not add a
            # request to the hot store (S3) each time; a takeover is seen within seconds.
            source, source_run = self.fence_source
            memo = self._fence_memo.get(source_run)
            if memo is None or time.monotonic() - memo[0] > FENCE_MEMO_SECONDS:
                memo = self._fence_memo[source_run] = (
                    time.monotonic(),
                    source.fence_records(source_run),
                )
            return memo[1]
        names = self.backend.list(f"refs/fences/{validate_run_name(run)}")
        epochs = [int(m.group(1)) for n in names if (m := _STEP_FILE.match(n))]
        return FenceRecords(epochs, lambda epoch: self._fence_record(run, epoch))

    def _fence_record(self, run: str, epoch: int) -> dict[str, Any]:
        """One fence record (read once: records are never rewritten)."""
        record = self._fence_cache.get((run, epoch))
        if record is None:
            try:
                record = json.loads(self.backend.read_bytes(fence_key(run, epoch)))
            except (FileNotFoundError, ValueError):
                record = None
            if not isinstance(record, dict):
                # Gone or damaged: it lists nothing (stricter, never looser)
                record = {"epoch": epoch, "visible": [], "damaged": True}
            self._fence_cache[(run, epoch)] = record
        return record

    def stale_commits(self, run: str, steps: Sequence[int] | None = None) -> dict[int, str]:
        """``step -> reason`` for each manifest of ``run`` that the fence rule refuses: it
        was committed under a lease epoch that another writer had taken over, and it was not
        visible when that takeover happened (a late commit). Stores without fence records
        (no lease ever, older stores) have none: this costs one listing there."""
        fences = self.fence_records(run)
        if len(fences.epochs) < 2:
            # Every epoch writes its record before it commits: with one record (or none)
            # no manifest can carry an older epoch than it.
            return {}
        steps = self.listed_steps(run) if steps is None else list(steps)
        covered = set(fences.record(fences.current).get("visible") or [])
        for step in steps:
            if (run, step) in self._stamps or step in covered:
                continue
            # Only the envelope line (a few hundred bytes): the steps committed since the
            # newest takeover that this store has not seen yet.
            try:
                head = self.backend.read_range(self.manifest_key(run, step), 0, 4096)
            except OSError:
                continue  # unreadable: the listing's readers report it as they did
            self._stamps[(run, step)] = manifest_stamp(head)
            self._versions[(run, step)] = manifest_version(head)
        memory = self.fence_source is not None
        out = {}
        for step in steps:
            if (run, step) not in self._stamps:
                continue  # listed at the newest takeover (valid there), or unreadable
            stamp, version = self._stamps[(run, step)], self._versions.get((run, step))
            reason = fences.refusal(step, stamp, memory=memory, version=version)
            if reason is not None:
                out[step] = reason
        return out

    def _refusal_of(self, run: str, step: int, data: bytes) -> str | None:
        """Why the manifest ``data`` of ``run@step`` is not a checkpoint (fence rule)."""
        stamp = manifest_stamp(data)
        self._stamps[(run, step)] = stamp
        if stamp is None:
            return None
        fence = self.fences.get(run)
        own = getattr(fence, "stamp", None)
        if own is not None and getattr(fence, "lost", None) is None and own() == stamp:
            return None  # this writer's own commit (it still holds the lease it names)
        return self.fence_records(run).refusal(
            step, stamp, memory=self.fence_source is not None, version=manifest_version(data)
        )

    def _read_raw(self, run: str, steps: Sequence[int]) -> Iterator[tuple[int, bytes | OSError]]:
        folder = f"runs/{validate_run_name(run)}/checkpoints"
        names = [f"{validate_step(s)}.json" for s in steps]
        return zip(steps, self.backend.read_many(folder, names))

    def read_manifests(
        self, run: str, steps: Sequence[int]
    ) -> Iterator[tuple[int, bytes | CheckpointNotFoundError | ManifestError]]:
        """``(step, manifest bytes)`` for each step, in order; the error instead where a
        manifest cannot be read (as :meth:`read_manifest` would raise it)."""
        fences: FenceRecords | None = None
        for step, data in self._read_raw(run, steps):
            if isinstance(data, OSError):
                yield step, self._manifest_error(run, step, data)
                continue
            stamp = self._stamps[(run, step)] = manifest_stamp(data)
            if stamp is not None:
                fences = self.fence_records(run) if fences is None else fences
                reason = fences.refusal(
                    step,
                    stamp,
                    memory=self.fence_source is not None,
                    version=manifest_version(data),
                )
                if reason is not None:
                    yield step, self._late_error(run, step, reason)
                    continue
            yield step, data

    def read_manifest(self, run: str, step: int) -> bytes:
        """The manifest of ``run@step``; :class:`CheckpointNotFoundError` when there is none
        or the one there landed after a takeover (the fence rule: it is no checkpoint)."""
        try:
            data = self.backend.read_bytes(self.manifest_key(run, step))
        except OSError as exc:
            raise self._manifest_error(run, step, exc) from None
        reason = self._refusal_of(run, step, data)
        if reason is not None:
            raise self._late_error(run, step, reason)
        return data

    def _late_error(self, run: str, step: int, reason: str) -> CheckpointNotFoundError:
        return CheckpointNotFoundError(
            f"no committed checkpoint {run}@{step} in {self.backend.url}: the manifest there "
            f"{reason}; it is not part of the run (the owner removes it or commits that step anew)"
        )

    def _manifest_error(
        self, run: str, step: int, exc: OSError
    ) -> CheckpointNotFoundError | ManifestError:
        """What a failed manifest read means: absent, or unsafe to read."""
        if isinstance(exc, FileNotFoundError):
            return CheckpointNotFoundError(
                f"no committed checkpoint {run}@{step} in {self.backend.url}"
                f"{self.steps_hint(run, step)}"
            )
        # e.g. ELOOP: a symlink planted where a manifest belongs
        return ManifestError(f"{run}@{step}: manifest cannot be read safely: {exc}")

    def steps_hint(self, run: str, step: int) -> str:
        """`` (r has 1, 2, 5)``, and when ``step`` is older than the newest, that a keep
        policy may have deleted it since (a reader holds what it reads: ops.hold)."""
        try:
            steps = self.list_steps(run)
        except (OSError, StepvaultError):
            return ""
        if not steps:
            return f" (run {run!r} has no checkpoint there)"
        shown = ", ".join(map(str, steps[-10:]))
        more = f"{len(steps)} checkpoints, the newest: " if len(steps) > 10 else ""
        gone = (
            "; if it was there, a keep policy or gc has deleted it since (a reader holds "
            "what it reads with stepvault.ops.hold)"
            if steps[0] < step < steps[-1]
            else ""
        )
        return f" ({run} has {more}{shown}{gone})"

    def commit_manifest(self, run: str, step: int, data: bytes, *, overwrite: bool) -> None:
        """Make a checkpoint visible: every object must already be durable (call sync()).

        With a signer (:attr:`signer`, or ``$STEPVAULT_SIGNING_KEY``) the detached signature
        ``<step>.sig`` is written first, so a visible manifest of a signed run always has one.
        A run with a fence (:attr:`fences`: its writer's lease) commits only while that
        lease is still this writer's; else :class:`~stepvault.errors.LeaseLostError` and
        nothing is visible.
        """
        key = self.manifest_key(run, step)
        fence = self.fences.get(run)
        stamp = self._stamp_of(run)
        if overwrite and fence is not None:
            # Nothing to replace (one HEAD, or one stat): commit create-only, so that this
            # write, if it lands late (held up in a partition, or its writer frozen past a
            # takeover), can never replace the new owner's commit of the step (FORMAT.md
            # §8; the manager saves overwrite).
            overwrite = self.backend.exists(key)
        if stamp is not None:
            # The commit records its lease epoch: readers drop it if it lands after a
            # takeover (FORMAT.md §8, the fence rule).
            data = stamp_manifest(data, stamp)
        try:
            self._commit(run, step, key, data, fence, overwrite=overwrite)
        except CheckpointExistsError:
            # A manifest of this step that landed after this writer's takeover (the old
            # owner's commit in flight): not a checkpoint, so it must not block this one.
            if stamp is None or not self._remove_late(run, step):
                raise
            self._commit(run, step, key, data, fence, overwrite=overwrite)
        self._stamps[(run, step)] = manifest_stamp(data)
        self._versions[(run, step)] = manifest_version(data)

    def _stamp_of(self, run: str) -> dict[str, Any] | None:
        stamp = getattr(self.fences.get(run), "stamp", None)
        return stamp() if stamp is not None else None

    def stamped(self, run: str, data: bytes) -> bytes:
        """``data`` as :meth:`commit_manifest` will write it for ``run`` (with this writer's
        lease stamp): for a caller that needs the committed file's BLAKE3 before the commit
        (thinning rebinds attachment records to it)."""
        stamp = self._stamp_of(run)
        return stamp_manifest(data, stamp) if stamp is not None else data

    def _remove_late(self, run: str, step: int) -> bool:
        """Delete the manifest of ``run@step`` if the fence rule refuses it (under this
        writer's fence); True when it was removed."""
        try:
            data = self.backend.read_bytes(self.manifest_key(run, step))
        except OSError:
            return False
        reason = self._refusal_of(run, step, data)
        if reason is None:
            return False
        self.delete_manifest(run, step)
        self.stale_removed.append((run, step, reason))
        return True

    def remove_stale_commits(self, run: str) -> list[tuple[int, str]]:
        """The owner's clean-up: delete every manifest of ``run`` that the fence rule refuses
        (under this writer's fence); ``(step, reason)`` of each removed."""
        removed = []
        for step, reason in sorted(self.stale_commits(run).items()):
            with contextlib.suppress(FileNotFoundError):
                self.delete_manifest(run, step)
            self.stale_removed.append((run, step, reason))
            removed.append((step, reason))
        return removed

    def _commit(
        self, run: str, step: int, key: str, data: bytes, fence: Fence | None, *, overwrite: bool
    ) -> None:
        guard = fence.guard(f"the commit of {run}@{step}") if fence is not None else None
        signer = self.signer
        try:
            if guard is not None and signer is None:
                self.backend.put_fenced(key, [data], guard, overwrite=overwrite, durable=True)
            else:
                # Signed: the signature goes under the fence too, so a writer that lost the
                # run never replaces the new owner's signature of the same step.
                with guard if guard is not None else contextlib.nullcontext():
                    if signer is not None:
                        if not overwrite and self.backend.exists(key):
                            raise FileExistsError(key)
                        sig = json.dumps(signer.sign(data), sort_keys=True).encode()
                        self.backend.put_atomic(self.signature_key(run, step), [sig])
                    self.backend.put_atomic(key, [data], overwrite=overwrite, durable=True)
        except LockBrokenError:
            raise  # not "exists": the commit lock was broken under this writer (lease.py)
        except FileExistsError:
            raise CheckpointExistsError(
                f"checkpoint {run}@{step} already exists in {self.backend.url}; pass "
                "overwrite=True to replace it, or save under another step"
            ) from None
        self.backend.sync()

    def delete_manifest(self, run: str, step: int) -> None:
        fence = self.fences.get(run)  # a writer that lost the run deletes nothing of it
        with fence.guard(f"deleting {run}@{step}") if fence else contextlib.nullcontext():
            self.backend.delete(self.manifest_key(run, step))
        self._stamps.pop((run, step), None)
        self.backend.sync()
        self.backend.delete(self.signature_key(run, step))

    @staticmethod
    def signature_key(run: str, step: int) -> str:
        return f"runs/{validate_run_name(run)}/checkpoints/{validate_step(step)}.sig"

    @property
    def signer(self) -> Signer | None:
        """Signs every manifest this store commits: set it, or ``$STEPVAULT_SIGNING_KEY``."""
        if self._signer is _UNSET:
            self._signer = signer_from_env()
        return self._signer  # type: ignore[return-value]

    @signer.setter
    def signer(self, value: Signer | None) -> None:
        self._signer = value

    def read_signature(self, run: str, step: int) -> dict[str, Any] | None:
        """The detached signature record of ``run@step``, or None when it was not signed."""
        try:
            raw = self.backend.read_bytes(self.signature_key(run, step))
        except FileNotFoundError:
            return None
        try:
            record = json.loads(raw)
        except ValueError:
            return {"alg": "?", "damaged": True}
        return record if isinstance(record, dict) else {"alg": "?", "damaged": True}

    # -- holds: references from above (the registry) that protect a checkpoint -------------
    def hold(self, run: str, step: int, holder: str) -> None:
        """Protect ``run@step`` from retention and GC on behalf of ``holder`` (e.g. a model)."""
        self.read_manifest(run, step)  # must exist
        validate_run_name(holder)
        data = json.dumps({"run": run, "step": step, "holder": holder, "time": time.time()})
        self.backend.put_atomic(self._hold_key(run, step, holder), [data.encode()])

    def release(self, run: str, step: int, holder: str) -> None:
        """Drop ``holder``'s hold on ``run@step``."""
        self.backend.delete(self._hold_key(run, step, holder))

    def held_steps(self, run: str) -> dict[int, list[str]]:
        """Steps of ``run`` held by someone, with their holders."""
        out: dict[int, list[str]] = {}
        for name in self.backend.list(f"refs/holds/{validate_run_name(run)}"):
            m = _HOLD_FILE.match(name)
            if m:
                out.setdefault(int(m.group(1)), []).append(m.group(2))
        return out

    def protected_steps(self, run: str) -> set[int]:
        """Steps no keep policy or GC may delete: pinned by a user or held by the registry."""
        return set(self.pinned_steps(run)) | set(self.held_steps(run))

    @staticmethod
    def _hold_key(run: str, step: int, holder: str) -> str:
        return (
            f"refs/holds/{validate_run_name(run)}/{validate_step(step)}"
            f"@{validate_run_name(holder)}.json"
        )

    # -- pins ------------------------------------------------------------------------------
    def pin(self, run: str, step: int, note: str = "") -> None:
        """Protect ``run@step`` from every keep policy and GC until unpinned."""
        self.read_manifest(run, step)  # must exist
        data = json.dumps({"run": run, "step": step, "note": note, "time": time.time()}).encode()
        self.backend.put_atomic(
            f"refs/pins/{validate_run_name(run)}/{validate_step(step)}.json", [data]
        )

    def unpin(self, run: str, step: int) -> None:
        self.backend.delete(f"refs/pins/{validate_run_name(run)}/{validate_step(step)}.json")

    def pinned_steps(self, run: str) -> list[int]:
        names = self.backend.list(f"refs/pins/{validate_run_name(run)}")
        return sorted(int(m.group(1)) for n in names if (m := _STEP_FILE.match(n)))

    def read_run_info(self, run: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.backend.read_bytes(f"runs/{validate_run_name(run)}/run.json"))
        except FileNotFoundError:
            return None

    def ensure_run(self, run: str, info: dict[str, Any]) -> None:
        """Create ``runs/<run>/run.json`` once (the first writer wins)."""
        key = f"runs/{validate_run_name(run)}/run.json"
        if self.backend.exists(key):
            return
        data = (json.dumps(info, indent=2, sort_keys=True) + "\n").encode()
        try:
            self.backend.put_atomic(key, [data], overwrite=False)
        except FileExistsError:
            pass


def _parse_settings(raw: bytes, where: str) -> dict[str, Any]:
    try:
        settings = json.loads(raw)
        version = settings["version"]
        fmt = settings["format"]
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreNotFoundError(
            f"{where}/{SETTINGS_KEY} is not a stepvault settings file"
        ) from exc
    if fmt != "stepvault-store":
        raise StoreNotFoundError(f"{where}/{SETTINGS_KEY}: unexpected format {fmt!r}")
    if not isinstance(version, int) or version > STORE_FORMAT_VERSION:
        raise StoreVersionError(
            f"store at {where} has format version {version!r}, but this stepvault reads up to "
            f"version {STORE_FORMAT_VERSION}; upgrade stepvault (pip install -U stepvault)"
        )
    return settings
