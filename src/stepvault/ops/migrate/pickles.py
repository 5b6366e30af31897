"""Reading pickled files (``torch.save``) safely: ``torch.load(weights_only=True)`` with
plain numpy arrays allowed, and a clear refusal when a file needs more."""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

import numpy as np
import torch

from ...errors import StepvaultError, UntrustedInputError

_PLAIN_NUMPY_DTYPES = [
    *("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"),
    *("float16", "float32", "float64", "complex64", "complex128"),
]


def _numpy_safe_globals() -> list[Any]:
    """numpy pieces a pickle needs to rebuild plain arrays and scalars (HF's RNG files).

    They only allocate an array of a given dtype and fill it with bytes; an object-dtype
    array would still need its items unpickled by the restricted unpickler, and the
    encoding refuses object arrays anyway.
    """
    core = getattr(np, "_core", None) or np.core
    allow: list[Any] = [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype]
    allow += [type(np.dtype(name)) for name in _PLAIN_NUMPY_DTYPES]
    return allow


def _refusal(path: str, exc: Exception) -> UntrustedInputError:
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
    detail = f"it references {found.group(1)}" if found else str(exc).strip().splitlines()[0]
    return UntrustedInputError(
        f"{path}: this pickle holds more than tensors and plain values ({detail}); loading "
        "it fully would run code chosen by whoever wrote the file. If you made this file or "
        "trust its author, pass trust=True (CLI: --trust); never for files from others"
    )


def load_pickle(path: str, *, trust: bool = False) -> Any:
    """``torch.load`` a file safely: ``weights_only=True`` unless ``trust`` is passed.

    Raises :class:`UntrustedInputError` when the file needs full unpickling and ``trust`` is
    false; nothing in the file has run by then.
    """
    if not os.path.isfile(path):
        raise StepvaultError(f"{path}: no such file")
    try:
        with torch.serialization.safe_globals(_numpy_safe_globals()):
            return _torch_load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        if not trust:
            raise _refusal(path, exc) from None
    return _torch_load(path, weights_only=False)


def _torch_load(path: str, *, weights_only: bool) -> Any:
    try:
        # mmap: a large file is paged in as it is written to the store, not read twice.
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):  # legacy (non-zip) torch.save files cannot be mapped
            raise _unreadable(path, exc) from None
    except (EOFError, OSError, ValueError) as exc:
        raise _unreadable(path, exc) from None
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise _unreadable(path, exc) from None


def _unreadable(path: str, exc: Exception) -> StepvaultError:
    return StepvaultError(
        f"{path}: not a readable torch.save file ({type(exc).__name__}: {exc}); "
        "is it truncated or of another format?"
    )
