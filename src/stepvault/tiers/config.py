"""Which tiers a store has: the hot store itself plus named cold tiers, recorded in the hot
store as ``tiers.json`` so that every tool (restore, CLI, mover) finds them.

Each tier is a complete stepvault store (objects + manifests + refs) on its own backend:
a local directory, an S3 bucket prefix, any fsspec URL. ``tiers.json`` holds names, URLs,
codecs and non-secret storage options only; credentials come from the environment
(``AWS_*`` variables, ``~/.aws``, instance roles), never from the store.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import TierError
from ..store import Backend, Store

TIERS_KEY = "tiers.json"
HOT = "hot"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}\Z")
_SECRET_OPTIONS = {"key", "secret", "token", "aws_secret_access_key", "aws_session_token"}
#: Settings a cold tier inherits from the hot store when it is created.
_INHERITED = ("chunk_size", "small_tensor", "bundle_size")


@dataclass
class TierSpec:
    """One cold tier: ``name``, store ``url``, ``codec`` for moved objects and fsspec
    ``options`` (e.g. ``{"endpoint_url": ...}``; never credentials).

    ``codec="keep"`` (default) copies stored objects byte for byte, so a checkpoint's
    manifest is identical in every tier; ``"auto"``/``"float"``/``"zstd"`` re-encode objects
    for size as they move (principle 6: colder tiers favour size); ``"xor"``/``"xor:K"``
    also store an object as a lossless delta against the tier's previous checkpoint where
    that is smaller (a full object every K, default 8; STORAGE.md). Signed checkpoints are
    always copied with ``"keep"`` so their signature stays valid.
    """

    name: str
    url: str
    codec: str = "keep"
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if "://" not in self.url:  # a local tier must not depend on the current directory
            self.url = os.path.abspath(self.url)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "codec": self.codec, "options": self.options}


def _is_delta(codec: str) -> bool:
    from ..format.xor_codec import chain_limit

    try:
        return chain_limit(codec) is not None
    except ValueError:
        return False


def check_tier_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or name == HOT:
        raise TierError(
            f"invalid tier name {name!r}: use 1-64 lowercase letters, digits, '_' or '-' "
            f"(and not {HOT!r}, the name of the store itself)"
        )
    return name


def read_tier_specs(hot: Store) -> list[TierSpec]:
    """The cold tiers recorded in ``hot`` (empty when it has none)."""
    try:
        raw = hot.backend.read_bytes(TIERS_KEY)
    except FileNotFoundError:
        return []
    try:
        data = json.loads(raw)
        return [
            TierSpec(t["name"], t["url"], t.get("codec", "keep"), dict(t.get("options", {})))
            for t in data["tiers"]
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise TierError(f"{hot.backend.url}/{TIERS_KEY} is damaged: {exc}") from exc


def write_tier_specs(hot: Store, specs: list[TierSpec]) -> None:
    names = [check_tier_name(s.name) for s in specs]
    if len(set(names)) != len(names):
        raise TierError(f"duplicate tier names in {names}")
    for s in specs:
        leaked = _SECRET_OPTIONS & {k.lower() for k in s.options}
        if leaked:
            raise TierError(
                f"tier {s.name!r}: credentials ({', '.join(sorted(leaked))}) must not be "
                "stored in the store; put them in the environment (AWS_ACCESS_KEY_ID, ...)"
            )
        from ..format import CODEC_CHOICES

        if s.codec != "keep" and s.codec not in CODEC_CHOICES and not _is_delta(s.codec):
            raise TierError(
                f"tier {s.name!r}: codec must be 'keep', one of {CODEC_CHOICES} or "
                f"'xor'/'xor:K' (lossless deltas, a full object every K; K <= 64), "
                f"not {s.codec!r}"
            )
    data = json.dumps({"tiers": [s.to_json() for s in specs]}, indent=2, sort_keys=True)
    hot.backend.put_atomic(TIERS_KEY, [(data + "\n").encode()], overwrite=True)
    hot.sync()


def add_tier(hot: Store, spec: TierSpec) -> None:
    """Record (or replace) the cold tier ``spec.name`` in ``hot``."""
    specs = [s for s in read_tier_specs(hot) if s.name != spec.name]
    write_tier_specs(hot, [*specs, spec])


def remove_tier(hot: Store, name: str) -> None:
    """Forget tier ``name`` (its store and contents are left untouched)."""
    specs = read_tier_specs(hot)
    if not any(s.name == name for s in specs):
        raise TierError(f"no tier named {name!r} in {hot.backend.url}")
    write_tier_specs(hot, [s for s in specs if s.name != name])


class Tiers:
    """The tiers of one hot store, opened: ``tiers["archive"]`` is that tier's Store.

    Cold stores are opened (and created, with the hot store's chunking settings) on first
    use, so a store with an unreachable archive still saves and restores from hot.
    """

    def __init__(
        self, hot: Store, specs: list[TierSpec], stores: Mapping[str, Store] | None = None
    ) -> None:
        self.hot = hot
        self.specs = {s.name: s for s in specs}
        self._stores: dict[str, Store] = {**(stores or {}), HOT: hot}

    @classmethod
    def of(cls, hot: Store) -> Tiers:
        return cls(hot, read_tier_specs(hot))

    @property
    def names(self) -> list[str]:
        """``"hot"`` first, then the cold tiers in the order they were added."""
        return [HOT, *self.specs]

    @property
    def cold_names(self) -> list[str]:
        return list(self.specs)

    def spec(self, name: str) -> TierSpec:
        try:
            return self.specs[name]
        except KeyError:
            known = ", ".join(self.names)
            raise TierError(
                f"no tier named {name!r} in {self.hot.backend.url} (tiers: {known}); add it "
                "with 'stepvault tiers add NAME URL' or CheckpointManager(tiers={...})"
            ) from None

    def __getitem__(self, name: str) -> Store:
        return self.get(name)

    def get(self, name: str, *, create: bool = True) -> Store:
        """The store of tier ``name``; ``create=False`` (readers) never initialises one."""
        store = self._stores.get(name)
        if store is None:
            spec = self.spec(name)
            if not create:
                from ..store import backend_for

                store = Store.open(backend_for(spec.url, **spec.options))
            else:
                defaults = {k: self.hot.settings[k] for k in _INHERITED if k in self.hot.settings}
                # An xor tier's plain objects (first of a chain, or where no delta pays
                # off) use the best plain encoding.
                plain = "auto" if _is_delta(spec.codec) else spec.codec
                defaults["codec"] = "raw" if spec.codec == "keep" else plain
                store = open_tier_store(spec.url, spec.options, defaults)
            self._stores[name] = store
        return store

    def __contains__(self, name: object) -> bool:
        return name == HOT or name in self.specs


def open_tier_store(
    target: str | os.PathLike[str] | Backend | Store,
    options: Mapping[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
) -> Store:
    """Open (creating if absent) the store of a tier given as URL, path, Backend or Store."""
    if isinstance(target, Store):
        return target
    from ..store import backend_for

    backend = target if isinstance(target, Backend) else backend_for(target, **dict(options or {}))
    return Store.open(backend, create=True, defaults=defaults)


def spec_for(name: str, target: Any, codec: str = "keep") -> TierSpec:
    """A TierSpec for ``target`` (a URL or path; Backends/Stores are not recordable)."""
    if isinstance(target, TierSpec):
        return target if target.name == name else replace(target, name=check_tier_name(name))
    if isinstance(target, Store | Backend):
        url = target.backend.url if isinstance(target, Store) else target.url
        return TierSpec(check_tier_name(name), url, codec)
    return TierSpec(check_tier_name(name), os.fspath(target), codec)
