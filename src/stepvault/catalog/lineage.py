"""Lineage: how a checkpoint was made — config, code version, data, environment, parent.

A :class:`Lineage` is captured once per training session and stored content-addressed::

    runs/<run>/lineage/<blake3 of the record>.json

Every manifest the session commits names that record in its ``lineage`` field, so each
checkpoint points at exactly the config and code that produced it (a resumed run with a new
learning rate gets a new record; the checkpoints before it keep the old one). Because the
manifest is checksummed (and optionally signed), so is the link to its lineage.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from blake3 import blake3

from .._env import environment
from ..errors import IntegrityError, StepvaultError
from ..store import Store, validate_run_name
from .annotations import manifest_id

LINEAGE_FORMAT = "stepvault-lineage"


def _plain(value: Any) -> Any:
    """A JSON-ready copy of a config value; anything exotic becomes its ``str``."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=str) if isinstance(value, set | frozenset) else value
        return [_plain(v) for v in items]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, argparse.Namespace):
        return _plain(vars(value))
    for method in ("to_dict", "to_container"):  # HF TrainingArguments, OmegaConf-like
        fn = getattr(value, method, None)
        if callable(fn):
            try:
                return _plain(fn())
            except Exception:  # a broken to_dict is not worth failing a save over
                break
    return str(value)


def git_info(path: str | os.PathLike[str] = ".") -> dict[str, Any] | None:
    """Commit, branch and dirty flag of the git work tree at ``path``; None outside one."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", os.fspath(path), *args],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "git_commit": commit,
        "git_branch": git("rev-parse", "--abbrev-ref", "HEAD"),
        "dirty": bool(status),
        "repository": git("rev-parse", "--show-toplevel"),
    }


def fingerprint_files(
    paths: Iterable[str | os.PathLike[str]], *, content: bool = False
) -> dict[str, Any]:
    """A fingerprint of a data set given as files and/or directories (walked recursively).

    By default the BLAKE3 covers each file's relative path and size (fast: no reads); with
    ``content=True`` it covers the bytes too.
    """
    files: list[tuple[str, str]] = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            for dirpath, dirnames, filenames in os.walk(p):
                dirnames.sort()
                for name in sorted(filenames):
                    full = os.path.join(dirpath, name)
                    files.append((os.path.relpath(full, p), full))
        elif os.path.isfile(p):
            files.append((os.path.basename(p), p))
        else:
            raise StepvaultError(f"data path {p!r} does not exist; pass existing files or dirs")
    h = blake3()
    total = 0
    for rel, full in sorted(files):
        size = os.path.getsize(full)
        total += size
        h.update(f"{rel}\0{size}\n".encode())
        if content:
            with open(full, "rb") as f:
                while block := f.read(1 << 22):
                    h.update(block)
    return {
        "fingerprint": h.hexdigest(),
        "files": len(files),
        "bytes": total,
        "method": "blake3(path,size,content)" if content else "blake3(path,size)",
    }


@dataclass
class Lineage:
    """What a training session records about how its checkpoints are made.

    ``config``: hyperparameters (dict, dataclass, argparse Namespace, HF TrainingArguments...).
    ``data``: a data fingerprint — any string (a dataset version, a hash), a dict, or the
    result of :func:`fingerprint_files`. ``parent``: ``"RUN@STEP"`` this run was fine-tuned
    from. ``code`` (git) and ``environment`` (library versions, host, world size) are filled
    in automatically by :meth:`capture`.
    """

    config: Any = None
    data: Any = None
    parent: str | None = None
    code: dict[str, Any] | None = None
    environment: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def capture(
        cls,
        config: Any = None,
        *,
        data: Any = None,
        parent: str | None = None,
        code_dir: str | os.PathLike[str] = ".",
        **extra: Any,
    ) -> Lineage:
        """Lineage of this process: the given config/data/parent plus git and environment."""
        env = environment()
        try:
            import torch.distributed as dist

            env["world_size"] = dist.get_world_size() if dist.is_initialized() else 1
        except Exception:  # torch.distributed unavailable in some builds
            env["world_size"] = 1
        return cls(
            config=config,
            data=data,
            parent=parent,
            code=git_info(code_dir),
            environment=env,
            extra=dict(extra),
        )

    def record(self, store: Store) -> dict[str, Any]:
        """The JSON record stored for this lineage (the parent resolved to its manifest)."""
        parent = None
        if self.parent is not None:
            from .refs import parse_ref

            run, step = parse_ref(self.parent)
            if not isinstance(step, int):
                raise StepvaultError(
                    f"parent must name an exact checkpoint RUN@STEP, got {self.parent!r}"
                )
            parent = {
                "run": run,
                "step": step,
                "manifest_blake3": manifest_id(store.read_manifest(run, step)),
            }
        return {
            "format": LINEAGE_FORMAT,
            "version": 1,
            "config": _plain(self.config),
            "data": _plain(self.data),
            "parent": parent,
            "code": _plain(self.code),
            "environment": _plain(self.environment),
            "extra": _plain(self.extra),
        }


def write_lineage(store: Store, run: str, lineage: Lineage) -> str:
    """Store ``lineage`` for ``run`` (content-addressed, written once); return its digest."""
    data = json.dumps(lineage.record(store), sort_keys=True, separators=(",", ":")).encode()
    digest = blake3(data).hexdigest()
    key = f"runs/{validate_run_name(run)}/lineage/{digest}.json"
    if not store.backend.exists(key):
        try:
            store.backend.put_atomic(key, [data], overwrite=False)
        except FileExistsError:
            pass  # the same record, written concurrently
    return digest


def read_lineage(store: Store, run: str, digest: str) -> dict[str, Any]:
    """The lineage record ``digest`` of ``run``, checked against its hash."""
    if not isinstance(digest, str) or len(digest) != 64:
        raise IntegrityError(f"bad lineage reference {digest!r}")
    key = f"runs/{validate_run_name(run)}/lineage/{digest}.json"
    try:
        data = store.backend.read_bytes(key)
    except FileNotFoundError:
        raise IntegrityError(f"lineage record {key} is missing") from None
    if blake3(data).hexdigest() != digest:
        raise IntegrityError(f"lineage record {key} does not match its hash (damaged or altered)")
    return json.loads(data)
