"""safetensors files written one tensor at a time (the export's writer).

The format is an 8-byte little-endian header length, a JSON header (each tensor's dtype,
shape and byte offsets, plus ``__metadata__``) and the tensors' bytes. The header needs
only shapes and dtypes, which a manifest tells before any byte is read, so the header is
written first and each tensor streamed in as soon as it is read: the writer holds one
tensor, where ``safetensors.torch.save_file`` needs every tensor of the file in memory.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from typing import Any

import torch

from ..errors import StepvaultError

#: safetensors' dtype names (safetensors.torch's own table)
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}


def write_streamed(
    path: str,
    items: list[tuple[str, Any, list[tuple[str, torch.dtype, tuple[int, ...]]]]],
    metadata: dict[str, str],
    produce: Callable[[str, Any], dict[str, torch.Tensor]],
) -> None:
    """Write one safetensors file whose header is known before its tensors are.

    ``items``: ``(name, loader, [(key, dtype, shape), ...])`` in file order;
    ``produce(name, loader)`` reads one of them and returns its tensors by key (checked
    against the plan). The header goes first, then each tensor's bytes as soon as it is
    read, so at most one tensor is in memory. Written beside ``path`` and renamed into
    place: a failed export leaves no half-written file under the final name.
    """
    header: dict[str, Any] = {"__metadata__": metadata}
    at = 0
    for _, _, outs in items:
        for key, dtype, shape in outs:
            if dtype not in _ST_DTYPES:
                raise StepvaultError(f"{key}: safetensors cannot hold {dtype}")
            end = at + math.prod(shape) * dtype.itemsize
            header[key] = {
                "dtype": _ST_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [at, end],
            }
            at = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    tmp = path + ".partial"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for name, load, outs in items:
                tensors = produce(name, load)
                for key, dtype, shape in outs:
                    t = tensors[key]
                    if t.dtype != dtype or tuple(t.shape) != shape:
                        raise StepvaultError(
                            f"{key}: read as {t.dtype} {tuple(t.shape)}, but the manifest "
                            f"says {dtype} {shape} (a damaged manifest?)"
                        )
                    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
                    f.write(flat.numpy().data)
                del tensors
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
