"""The settings a new store records in ``stepvault.json`` (FORMAT.md §1)."""

from __future__ import annotations

from typing import Any

from .chunking import DEFAULT_BUNDLE_SIZE, DEFAULT_CHUNK_SIZE, DEFAULT_SMALL_TENSOR

#: Settings recorded in ``stepvault.json`` when a store is created by a save.
DEFAULT_STORE_SETTINGS: dict[str, Any] = {
    "chunk_size": DEFAULT_CHUNK_SIZE,
    "small_tensor": DEFAULT_SMALL_TENSOR,
    "bundle_size": DEFAULT_BUNDLE_SIZE,
    # The hot tier favours speed: raw chunks are memory-mapped on restore. Use "auto" for
    # the float codec on fp16/bf16/fp32 and zstd elsewhere.
    "codec": "raw",
}
