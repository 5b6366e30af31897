"""The model registry: named models, numbered versions, aliases, promote and rollback.

A *version* links a model name to one exact checkpoint (run, step and the BLAKE3 of its
manifest) and, optionally, to its exported weights. An *alias* (``candidate``, ``stable``,
``fallback``, or any name) points at one version; moving it is a *promotion*, and
``rollback`` moves it back to the version it held before. Every move is a record of its own,
so the full history is kept and can be audited.

Layout (every file is created exclusively, never rewritten)::

    refs/registry/<model>/versions/<n>.json   {model, version, run, step, manifest_blake3,
                                               export, note, time, user, host[, signature]}
    refs/registry/<model>/moves/<seq>.json    {model, seq, alias, action, version, previous,
                                               prev_blake3, note, time, user, host[, signature]}

``prev_blake3`` is the BLAKE3 of the previous move file, so the history is a hash chain:
a deleted, edited or reordered move is detected by :meth:`Registry.check` (signatures
additionally prove who wrote each record). A chain alone cannot show that its *newest*
moves were deleted, so every move also rewrites ``refs/registry/<model>/head.json``
(``{model, seq, blake3}`` of the newest move, signed like the rest): a head naming a move
that is gone, or another file than the one there, means the history was cut or edited.
Registering a version places a *hold* on its checkpoint (``refs/holds/``), which keeps it
safe from every keep policy and from GC.

(Longer than most modules on purpose: versions, aliases and their signed history are one
record format with one set of invariants, kept in one place.)
"""

from __future__ import annotations

import getpass
import json
import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

from ..catalog.annotations import manifest_id
from ..catalog.events import log_event
from ..errors import CheckpointNotFoundError, RegistryError, StepvaultError
from ..store import Store, validate_run_name
from ..store.signing import Signer, Verifier
from ..tiers.config import HOT
from ..tiers.view import TieredView, read_view

#: The suggested trio; any valid name works.
SUGGESTED_ALIASES = ("candidate", "stable", "fallback")
_NUMBERED = re.compile(r"^([1-9][0-9]{0,8})\.json$")
_VERSION_REF = re.compile(r"^v([1-9][0-9]{0,8})$")


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return str(os.getuid()) if hasattr(os, "getuid") else "?"


def validate_model_name(name: str) -> str:
    """A model name follows the run-name rules (it becomes a directory name)."""
    return validate_run_name(name)


def validate_alias(alias: str) -> str:
    """Aliases follow the run-name rules and must not look like a version (``v3``) or step."""
    validate_run_name(alias)
    if alias.isdigit() or _VERSION_REF.match(alias) or alias == "latest":
        raise RegistryError(
            f"alias {alias!r} would be ambiguous with a step or a version number; pick a name "
            f"such as {', '.join(SUGGESTED_ALIASES)}"
        )
    return alias


@dataclass(frozen=True)
class ModelVersion:
    """One registered version of a model."""

    model: str
    version: int
    run: str
    step: int
    manifest_blake3: str
    created: float
    export: dict[str, Any] | None = None
    note: str = ""
    user: str = ""
    host: str = ""

    @property
    def ref(self) -> str:
        return f"{self.run}@{self.step}"

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class AliasMove:
    """One change of an alias: promote, rollback or remove."""

    model: str
    seq: int
    alias: str
    action: str
    version: int | None  # holder after the move
    previous: int | None  # holder before the move
    time: float
    note: str = ""
    user: str = ""
    host: str = ""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _version_from(record: dict[str, Any]) -> ModelVersion:
    return ModelVersion(
        model=record["model"],
        version=int(record["version"]),
        run=record["run"],
        step=int(record["step"]),
        manifest_blake3=record["manifest_blake3"],
        created=float(record["time"]),
        export=record.get("export"),
        note=record.get("note", ""),
        user=record.get("user", ""),
        host=record.get("host", ""),
    )


def _move_from(record: dict[str, Any]) -> AliasMove:
    return AliasMove(
        model=record["model"],
        seq=int(record["seq"]),
        alias=record["alias"],
        action=record["action"],
        version=record.get("version"),
        previous=record.get("previous"),
        time=float(record["time"]),
        note=record.get("note", ""),
        user=record.get("user", ""),
        host=record.get("host", ""),
    )


class Registry:
    """Models, versions and aliases in a store (``Registry(root)`` or ``Registry(store)``)."""

    def __init__(self, root: str | os.PathLike[str] | Store, *, signer: Signer | None = None):
        self.store = root if isinstance(root, Store) else Store.open(root)
        self.signer = signer if signer is not None else self.store.signer

    # ---------------------------------------------------------------- reading
    def _prefix(self, model: str) -> str:
        return f"refs/registry/{validate_model_name(model)}"

    def _numbers(self, key: str) -> list[int]:
        return sorted(
            int(m.group(1)) for n in self.store.backend.list(key) if (m := _NUMBERED.match(n))
        )

    def _read(self, key: str) -> tuple[bytes, dict[str, Any]]:
        data = self.store.backend.read_bytes(key)
        try:
            record = json.loads(data)
        except ValueError:
            raise StepvaultError(f"registry record {key} is damaged (not JSON)") from None
        if not isinstance(record, dict):
            raise StepvaultError(f"registry record {key} is damaged (not an object)")
        return data, record

    def models(self) -> list[str]:
        """Every registered model name."""
        out = []
        for name in self.store.backend.list("refs/registry"):
            try:
                out.append(validate_model_name(name))
            except ValueError:
                continue
        return sorted(out)

    def versions(self, model: str) -> list[ModelVersion]:
        """Every version of ``model``, oldest first."""
        prefix = f"{self._prefix(model)}/versions"
        return [_version_from(self._read(f"{prefix}/{n}.json")[1]) for n in self._numbers(prefix)]

    def version(self, model: str, version: int) -> ModelVersion:
        """Version ``version`` of ``model``."""
        try:
            _, record = self._read(f"{self._prefix(model)}/versions/{int(version)}.json")
        except FileNotFoundError:
            known = [v.version for v in self.versions(model)]
            raise RegistryError(
                f"model {model!r} has no version {version} (versions: {known or 'none'})"
            ) from None
        return _version_from(record)

    def history(self, model: str, alias: str | None = None) -> list[AliasMove]:
        """Every alias move of ``model`` (of one ``alias`` if given), oldest first."""
        prefix = f"{self._prefix(model)}/moves"
        moves = [_move_from(self._read(f"{prefix}/{n}.json")[1]) for n in self._numbers(prefix)]
        return [m for m in moves if alias is None or m.alias == alias]

    def _stacks(self, model: str) -> dict[str, list[int]]:
        """Replay the moves: promote pushes, rollback pops, remove clears."""
        stacks: dict[str, list[int]] = {}
        for m in self.history(model):
            stack = stacks.setdefault(m.alias, [])
            if m.action == "promote" and m.version is not None:
                stack.append(m.version)
            elif m.action == "rollback" and stack:
                stack.pop()
            elif m.action == "remove":
                stack.clear()
        return stacks

    def aliases(self, model: str) -> dict[str, int]:
        """Current holder (version number) of each alias of ``model``."""
        return {a: s[-1] for a, s in sorted(self._stacks(model).items()) if s}

    def resolve(self, spec: str) -> ModelVersion:
        """``MODEL@ALIAS``, ``MODEL@vN`` or ``MODEL`` (its newest version) → the version."""
        model, _, which = spec.partition("@")
        if model not in self.models():
            raise RegistryError(
                f"no model {model!r} in the registry of {self.store.backend.url} "
                f"(models: {', '.join(self.models()) or 'none'}); register one with "
                "'stepvault promote MODEL RUN@STEP --alias candidate'"
            )
        if not which:
            versions = self.versions(model)
            if not versions:
                raise RegistryError(f"model {model!r} has no versions yet")
            return versions[-1]
        m = _VERSION_REF.match(which)
        if m:
            return self.version(model, int(m.group(1)))
        held = self.aliases(model)
        if which not in held:
            raise RegistryError(
                f"model {model!r} has no alias {which!r} (aliases: "
                f"{', '.join(f'{a}=v{v}' for a, v in held.items()) or 'none'})"
            )
        return self.version(model, held[which])

    # ---------------------------------------------------------------- writing
    def _signed(self, record: dict[str, Any]) -> bytes:
        if self.signer is not None:
            record = self.signer.sign_record(record)
        return json.dumps(record, sort_keys=True).encode()

    def _stamp(self) -> dict[str, Any]:
        return {"time": time.time(), "user": _user(), "host": socket.gethostname()}

    def _checkpoints(self) -> Store:
        """The checkpoints on every tier (hot, then cold): a checkpoint moved to the archive
        is registered, promoted and verified like one on local disk."""
        return read_view(self.store)

    def _hold(self, run: str, step: int, holder: str) -> None:
        """Hold ``run@step`` in the hot store (where retention, GC and ``stepvault holds``
        look) and in every cold tier that holds its manifest (where that tier's own
        retention looks; a later tier copy carries the hot hold over by itself)."""
        view = self._checkpoints()
        view.hold(run, step, holder)  # must exist on some tier; the record goes to hot
        if isinstance(view, TieredView):
            for name in view.where(run, step):
                if name != HOT:
                    view.tiers.get(name, create=False).hold(run, step, holder)

    def _release(self, run: str, step: int, holder: str) -> None:
        view = self._checkpoints()
        view.release(run, step, holder)
        if isinstance(view, TieredView):
            for name in view.where(run, step):
                if name != HOT:
                    view.tiers.get(name, create=False).release(run, step, holder)

    def register(
        self,
        model: str,
        run: str,
        step: int,
        *,
        note: str = "",
        export: dict[str, Any] | None = None,
    ) -> ModelVersion:
        """A new version of ``model`` for checkpoint ``run@step`` (or the existing one).

        The checkpoint is held (protected from retention and GC) for as long as the version
        exists. ``export`` records where its weights were exported (see ``stepvault export``).
        """
        validate_model_name(model)
        try:
            mid = manifest_id(self._checkpoints().read_manifest(run, step))
        except CheckpointNotFoundError as exc:
            raise RegistryError(f"cannot register {run}@{step}: {exc}") from None
        for v in self.versions(model):
            if v.manifest_blake3 == mid and export is None:
                return v  # registering the same checkpoint twice is a no-op
        prefix = f"{self._prefix(model)}/versions"
        for _ in range(1000):
            n = max(self._numbers(prefix), default=0) + 1
            record = {
                "model": model,
                "version": n,
                "run": run,
                "step": int(step),
                "manifest_blake3": mid,
                "export": export,
                "note": note,
                **self._stamp(),
            }
            # Hold first: a version must never exist without its protection.
            self._hold(run, step, f"{model}.v{n}")
            try:
                self.store.backend.put_atomic(
                    f"{prefix}/{n}.json", [self._signed(record)], overwrite=False
                )
            except FileExistsError:
                # Another process took number n: drop our hold unless theirs is the same one.
                _, theirs = self._read(f"{prefix}/{n}.json")
                if (theirs.get("run"), theirs.get("step")) != (run, int(step)):
                    self._release(run, step, f"{model}.v{n}")
                continue
            log_event(self.store, run, "register", step=step, model=model, version=n)
            return _version_from(record)
        raise RegistryError(f"could not allocate a version number for {model!r}")

    def _append_move(
        self, model: str, alias: str, action: str, decide: Any, note: str
    ) -> AliasMove:
        prefix = f"{self._prefix(model)}/moves"
        for _ in range(1000):
            seqs = self._numbers(prefix)
            seq = max(seqs, default=0) + 1
            prev_hash = None
            if seqs:
                prev = self.store.backend.read_bytes(f"{prefix}/{seqs[-1]}.json")
                prev_hash = blake3(prev).hexdigest()
            stack = self._stacks(model).get(alias, [])
            previous = stack[-1] if stack else None
            version = decide(stack)
            record = {
                "model": model,
                "seq": seq,
                "alias": alias,
                "action": action,
                "version": version,
                "previous": previous,
                "prev_blake3": prev_hash,
                "note": note,
                **self._stamp(),
            }
            try:
                self.store.backend.put_atomic(
                    f"{prefix}/{seq}.json", [self._signed(record)], overwrite=False
                )
            except FileExistsError:
                continue  # a concurrent move won this number: decide again on the new state
            move = _move_from(record)
            self._write_head(model, seq)
            target = self.version(model, version) if version is not None else None
            if target is not None:
                log_event(
                    self.store,
                    target.run,
                    action,
                    step=target.step,
                    model=model,
                    alias=alias,
                    version=version,
                    previous=previous,
                )
            return move
        raise RegistryError(f"could not record the move of {model}@{alias}")

    def promote(
        self, model: str, target: str | int | ModelVersion, alias: str, *, note: str = ""
    ) -> AliasMove:
        """Point ``alias`` of ``model`` at ``target`` (``RUN@STEP``, a version number, or a
        :class:`ModelVersion`); a checkpoint not yet registered becomes a new version."""
        validate_alias(alias)
        if isinstance(target, ModelVersion):
            version = target.version
        elif isinstance(target, int):
            version = self.version(model, target).version
        else:
            m = _VERSION_REF.match(target)
            if m:
                version = self.version(model, int(m.group(1))).version
            else:
                from ..catalog.refs import parse_ref

                run, step = parse_ref(target)
                if not isinstance(step, int):
                    raise RegistryError(
                        f"promote needs an exact checkpoint RUN@STEP, got {target!r}"
                    )
                version = self.register(model, run, step).version
        return self._append_move(model, alias, "promote", lambda stack: version, note)

    def rollback(self, model: str, alias: str, *, note: str = "") -> AliasMove:
        """Move ``alias`` back to the version it held before its current one."""
        validate_alias(alias)

        def decide(stack: list[int]) -> int:
            if len(stack) < 2:
                held = (
                    f"it holds v{stack[-1]} and nothing held it before (a rollback moves back "
                    "past the versions it rolled back from)"
                    if stack
                    else "it holds nothing"
                )
                raise RegistryError(
                    f"cannot roll back {model}@{alias}: {held}; promote a version instead"
                )
            return stack[-2]

        return self._append_move(model, alias, "rollback", decide, note)

    def remove_alias(self, model: str, alias: str, *, note: str = "") -> AliasMove:
        """Clear ``alias`` (its history is kept)."""
        validate_alias(alias)
        if alias not in self.aliases(model):
            raise RegistryError(f"model {model!r} has no alias {alias!r}")
        return self._append_move(model, alias, "remove", lambda stack: None, note)

    def _write_head(self, model: str, seq: int) -> None:
        """Point the head at move ``seq`` unless it already names a newer one (concurrent
        moves: the loser of the race leaves the head alone)."""
        prefix = self._prefix(model)
        try:
            _, head = self._read(f"{prefix}/head.json")
            if isinstance(head.get("seq"), int) and head["seq"] > seq:
                return
        except (FileNotFoundError, StepvaultError):
            pass
        data = self.store.backend.read_bytes(f"{prefix}/moves/{seq}.json")
        record = {"model": model, "seq": seq, "blake3": blake3(data).hexdigest()}
        self.store.backend.put_atomic(f"{prefix}/head.json", [self._signed(record)])

    def _check_head(
        self, model: str, seqs: list[int], verifier: Verifier | None
    ) -> dict[str, Any] | None:
        key = f"{self._prefix(model)}/head.json"
        entry: dict[str, Any] = {"key": key, "kind": "head", "status": "ok"}
        try:
            _, head = self._read(key)
        except FileNotFoundError:
            if not seqs:
                return None
            # Written before heads existed, or a crash between a move and its head.
            return {**entry, "status": "no-head", "detail": "the newest move is not anchored"}
        except StepvaultError as exc:
            return {**entry, "status": "damaged", "detail": str(exc)}
        seq, last = head.get("seq"), max(seqs, default=0)
        if not isinstance(seq, int) or head.get("model") != model:
            entry.update(status="damaged", detail="not a head record of this model")
        elif seq > last:
            entry.update(
                status="truncated",
                detail=f"the head names move {seq} but the history ends at {last}: "
                "newest moves were deleted",
            )
        else:
            data = self.store.backend.read_bytes(f"{self._prefix(model)}/moves/{seq}.json")
            if blake3(data).hexdigest() != head.get("blake3"):
                entry.update(
                    status="broken-chain", detail=f"move {seq} is not the file the head names"
                )
        if verifier is not None:
            entry["signature"] = verifier.check_record(head).status
        return entry

    # ---------------------------------------------------------------- checking
    def check(self, verifier: Verifier | None = None) -> list[dict[str, Any]]:
        """Every registry record with its status: ``ok``, ``damaged``, ``broken-chain``,
        ``truncated`` (newest moves deleted), ``no-head`` (history not anchored: an older
        registry, or a crash right after a move; the next move anchors it),
        ``missing-checkpoint``, ``changed-checkpoint``, and with a verifier also the
        signature verdict (``valid``, ``invalid``, ``unsigned``, ``other-key``)."""
        out: list[dict[str, Any]] = []
        for model in self.models():
            prefix = self._prefix(model)
            for n in self._numbers(f"{prefix}/versions"):
                key = f"{prefix}/versions/{n}.json"
                out.append(self._check_version(key, verifier))
            prev: bytes | None = None
            expected = 1
            seqs = self._numbers(f"{prefix}/moves")
            head = self._check_head(model, seqs, verifier)
            if head is not None:
                out.append(head)
            for seq in seqs:
                key = f"{prefix}/moves/{seq}.json"
                entry: dict[str, Any] = {"key": key, "kind": "move", "status": "ok"}
                try:
                    data, record = self._read(key)
                except StepvaultError as exc:
                    out.append({**entry, "status": "damaged", "detail": str(exc)})
                    prev = None
                    continue
                want = blake3(prev).hexdigest() if prev is not None else None
                if seq != expected:
                    entry.update(
                        status="broken-chain", detail=f"moves {expected}..{seq - 1} are missing"
                    )
                elif record.get("prev_blake3") != want or record.get("seq") != seq:
                    entry.update(
                        status="broken-chain",
                        detail="does not follow the previous move (history edited or reordered)",
                    )
                if verifier is not None:
                    entry["signature"] = verifier.check_record(record).status
                out.append(entry)
                prev, expected = data, seq + 1
        return out

    def _check_version(self, key: str, verifier: Verifier | None) -> dict[str, Any]:
        entry: dict[str, Any] = {"key": key, "kind": "version", "status": "ok"}
        try:
            _, record = self._read(key)
            v = _version_from(record)
        except (StepvaultError, KeyError, TypeError, ValueError) as exc:
            return {**entry, "status": "damaged", "detail": str(exc)}
        entry["ref"] = v.ref
        try:
            current = manifest_id(self._checkpoints().read_manifest(v.run, v.step))
        except StepvaultError:
            entry.update(status="missing-checkpoint", detail=f"{v.ref} is gone")
        else:
            if current != v.manifest_blake3:
                entry.update(
                    status="changed-checkpoint", detail=f"{v.ref} is not the manifest registered"
                )
        if verifier is not None:
            entry["signature"] = verifier.check_record(record).status
        return entry
