"""The store: layout of a stepvault repository on top of a :class:`Backend`.

::

    <root>/
      stepvault.json                       store format version and settings
      objects/<2 hex>/<hash>               content-addressed objects
      runs/<run>/run.json                  run metadata
      runs/<run>/checkpoints/<step>.json   committed manifests (the only source of truth)
      runs/<run>/checkpoints/<step>.sig    detached signature of a manifest (signed stores)
      refs/pins/  refs/holds/              checkpoints protected by users / by the registry
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
    ManifestError,
    StoreNotFoundError,
    StoreVersionError,
)
from .backend import Backend, Buffer
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


class Fence(Protocol):
    """What a commit of a fenced run checks: the writer lease (:class:`~.lease.Lease`)."""

    def guard(self, what: str) -> AbstractContextManager[None]:
        """Held around making ``what`` visible; raises when this writer may not write."""
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
        """Committed steps of ``run`` in ascending order."""
        names = self.backend.list(f"runs/{validate_run_name(run)}/checkpoints")
        return sorted(int(m.group(1)) for n in names if (m := _STEP_FILE.match(n)))

    def read_manifests(
        self, run: str, steps: Sequence[int]
    ) -> Iterator[tuple[int, bytes | CheckpointNotFoundError | ManifestError]]:
        """``(step, manifest bytes)`` for each step, in order; the error instead where a
        manifest cannot be read (as :meth:`read_manifest` would raise it)."""
        folder = f"runs/{validate_run_name(run)}/checkpoints"
        names = [f"{validate_step(s)}.json" for s in steps]
        for step, data in zip(steps, self.backend.read_many(folder, names)):
            yield step, self._manifest_error(run, step, data) if isinstance(data, OSError) else data

    def read_manifest(self, run: str, step: int) -> bytes:
        try:
            return self.backend.read_bytes(self.manifest_key(run, step))
        except OSError as exc:
            raise self._manifest_error(run, step, exc) from None

    def _manifest_error(
        self, run: str, step: int, exc: OSError
    ) -> CheckpointNotFoundError | ManifestError:
        """What a failed manifest read means: absent, or unsafe to read."""
        if isinstance(exc, FileNotFoundError):
            return CheckpointNotFoundError(
                f"no committed checkpoint {run}@{step} in {self.backend.url}"
            )
        # e.g. ELOOP: a symlink planted where a manifest belongs
        return ManifestError(f"{run}@{step}: manifest cannot be read safely: {exc}")

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
