"""Turning live tensors and arrays into host byte views (and back) without extra copies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..format.dtypes import dtype_from_numpy, dtype_info
from ..format.encoding import torch_dtype, torch_dtype_name


@dataclass
class HostArray:
    """Contiguous little-endian bytes of one tensor/array plus what is needed to rebuild it."""

    kind: str  # "tensor" | "ndarray"
    dtype: str
    shape: list[int]
    data: memoryview  # flat uint8 view

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def to_host(value: Any) -> HostArray:
    """Host view of a tensor or array; copies only when it must (device, layout, byte order)."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.resolve_conj().resolve_neg().contiguous()
        flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        return HostArray("tensor", torch_dtype_name(t.dtype), list(t.shape), _u8_view(flat))
    if isinstance(value, np.ndarray):
        dt = dtype_from_numpy(value.dtype)
        if dt is None:
            raise TypeError(f"unsupported numpy dtype {value.dtype}")
        arr = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))
        flat_np = arr.reshape(-1).view(np.uint8)
        # numpy's stubs declare __buffer__ only for Python >= 3.12; ndarray has it on 3.10.
        view = memoryview(flat_np).cast("B")  # type: ignore[arg-type]
        return HostArray("ndarray", dt, list(value.shape), view)
    raise TypeError(f"not a tensor or array: {type(value).__name__}")


def _u8_view(flat: torch.Tensor) -> memoryview:
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]  # see to_host


def from_bytes(kind: str, dtype: str, shape: list[int], data: Any) -> Any:
    """Build a tensor/array over ``data`` (a writable uint8 buffer) without copying."""
    count = 1
    for d in shape:
        count *= d
    if kind == "ndarray":
        np_name = dtype_info(dtype).numpy
        if np_name is None:
            raise ValueError(f"numpy has no dtype {dtype!r}")
        return np.frombuffer(data, dtype=np_name, count=count).reshape(shape)
    tdtype = torch_dtype(dtype)
    if count == 0:
        return torch.empty(shape, dtype=tdtype)
    return torch.frombuffer(data, dtype=tdtype, count=count).reshape(shape)
