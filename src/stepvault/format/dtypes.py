"""Element types a checkpoint can hold, by their format name (independent of torch/numpy)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class DType(NamedTuple):
    name: str
    itemsize: int
    #: numpy dtype with the same bytes (little-endian), or None when numpy has none (bf16, fp8)
    numpy: str | None
    #: float layout for the float codec: (exponent bits, mantissa bits) or None
    float_bits: tuple[int, int] | None


_DTYPES = [
    DType("bool", 1, "bool", None),
    DType("uint8", 1, "<u1", None),
    DType("int8", 1, "<i1", None),
    DType("uint16", 2, "<u2", None),
    DType("int16", 2, "<i2", None),
    DType("uint32", 4, "<u4", None),
    DType("int32", 4, "<i4", None),
    DType("uint64", 8, "<u8", None),
    DType("int64", 8, "<i8", None),
    DType("float16", 2, "<f2", (5, 10)),
    DType("bfloat16", 2, None, (8, 7)),
    DType("float32", 4, "<f4", (8, 23)),
    DType("float64", 8, "<f8", (11, 52)),
    DType("complex64", 8, "<c8", None),
    DType("complex128", 16, "<c16", None),
    DType("float8_e4m3fn", 1, None, None),
    DType("float8_e5m2", 1, None, None),
    DType("float8_e4m3fnuz", 1, None, None),
    DType("float8_e5m2fnuz", 1, None, None),
]

DTYPES: dict[str, DType] = {d.name: d for d in _DTYPES}

_FROM_NUMPY = {np.dtype(d.numpy).str: d.name for d in _DTYPES if d.numpy}


def dtype_info(name: str) -> DType:
    """Look up a format dtype name; raise ValueError naming the supported ones otherwise."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPES)}") from None


def dtype_from_numpy(dtype: np.dtype) -> str | None:
    """Format name of a numpy dtype (either byte order), or None when unsupported."""
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return "bool"
    return _FROM_NUMPY.get(dt.newbyteorder("<").str) if dt.kind in "iufc" else None
