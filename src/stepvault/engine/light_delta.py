"""The light-checkpoint codec: a float tensor as a block-quantised delta against a base.

Pure functions (no store): :func:`encode_light_delta` turns ``new - base`` into a payload of
per-block float32 scales and int8 (or packed int4) codes and measures the error of the
decoded result against ``new`` exactly as :func:`decode_light_delta` will rebuild it (in
``new``'s dtype, so the rounding of bfloat16/float16 is part of the measured error).

Payload layout (FORMAT.md §12), for ``n`` elements and block size ``B``:
``ceil(n / B)`` little-endian float32 scales, then the codes: ``n`` int8 bytes (bits=8),
or ``ceil(n / 2)`` bytes of two's-complement int4 nibbles, the low nibble holding the even
element (bits=4). Element ``i`` decodes to ``base[i] + code[i] * scale[i // B]``, computed
in float32 and cast to the tensor's dtype. A block of all-equal values has scale 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: dtypes a light delta encodes; every other dtype is stored exactly
FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
BITS = (8, 4)
DEFAULT_BLOCK = 256


@dataclass(frozen=True)
class DeltaError:
    """The error of a decoded light delta against the exact values it replaced.

    ``max_rel = max_abs / max|new|`` and ``mean_rel = mean_abs / mean|new|`` (relative to the
    tensor's magnitude, not per element: a per-element ratio is unbounded near zero); both
    are 0 for an all-zero tensor.
    """

    max_abs: float
    mean_abs: float
    max_rel: float
    mean_rel: float

    def to_json(self) -> dict[str, float]:
        return {
            "max_abs": self.max_abs,
            "mean_abs": self.mean_abs,
            "max_rel": self.max_rel,
            "mean_rel": self.mean_rel,
        }

    @classmethod
    def between(cls, approx: torch.Tensor, exact: torch.Tensor) -> DeltaError:
        """The error of ``approx`` against ``exact`` (same shape, finite values)."""
        e = exact.detach().reshape(-1).to(torch.float64)
        diff = (approx.detach().reshape(-1).to(torch.float64) - e).abs()
        if e.numel() == 0:
            return cls(0.0, 0.0, 0.0, 0.0)
        max_abs, mean_abs = float(diff.max()), float(diff.mean())
        peak, mean = float(e.abs().max()), float(e.abs().mean())
        return cls(
            max_abs,
            mean_abs,
            max_abs / peak if peak > 0 else 0.0,
            mean_abs / mean if mean > 0 else 0.0,
        )


def light_delta_size(numel: int, *, bits: int = 8, block: int = DEFAULT_BLOCK) -> int:
    """Payload bytes of a tensor of ``numel`` elements (before the store's codec)."""
    _check(bits, block)
    codes = numel if bits == 8 else (numel + 1) // 2
    return 4 * math.ceil(numel / block) + codes


def _check(bits: int, block: int) -> None:
    if bits not in BITS:
        raise ValueError(f"light delta bits must be 8 or 4, got {bits!r}")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"light delta block must be a positive int, got {block!r}")


def check_encodable(base: torch.Tensor, new: torch.Tensor) -> str | None:
    """Why ``new`` cannot be a delta against ``base`` (None when it can): a caller stores
    such a tensor exactly."""
    if new.dtype not in FLOAT_DTYPES:
        return f"dtype {new.dtype} is not a float dtype"
    if base.dtype != new.dtype or tuple(base.shape) != tuple(new.shape):
        return (
            f"base is {base.dtype} {tuple(base.shape)}, the tensor {new.dtype} {tuple(new.shape)}"
        )
    # inf/nan have no finite delta: stored exactly rather than approximated by garbage
    if not bool(torch.isfinite(new).all()) or not bool(torch.isfinite(base).all()):
        return "it holds inf or nan"
    return None


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    # float64 tensors keep their precision in the sum; the rest add in float32
    return torch.float64 if dtype == torch.float64 else torch.float32


def _blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.reshape(-1, block)


def encode_light_delta(
    base: torch.Tensor, new: torch.Tensor, *, bits: int = 8, block: int = DEFAULT_BLOCK
) -> tuple[bytes, DeltaError]:
    """The quantised delta of ``new`` against ``base`` and its measured error.

    Both must have the same shape and float dtype and hold only finite values; otherwise a
    ValueError says which (store such a tensor exactly).
    """
    _check(bits, block)
    why = check_encodable(base, new)
    if why is not None:
        raise ValueError(f"cannot encode a light delta: {why}; store the tensor exactly")
    n = new.numel()
    wd = _work_dtype(new.dtype)
    delta = (new.detach().reshape(-1).to(wd) - base.detach().reshape(-1).to(wd)).to(torch.float32)
    top = 127 if bits == 8 else 7
    blocks = _blocks(delta, block)
    scales = blocks.abs().amax(dim=1) / top
    # A delta can overflow float32 (two huge finite values of opposite sign): refuse.
    if not bool(torch.isfinite(scales).all()):
        raise ValueError("cannot encode a light delta: the difference overflows float32")
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe[:, None]).clamp_(-top, top).to(torch.int8).reshape(-1)[:n]
    payload = scales.to(torch.float32).numpy().astype("<f4").tobytes() + _pack(codes, bits)
    decoded = decode_light_delta(base, payload, bits=bits, block=block)
    return payload, DeltaError.between(decoded, new)


def _pack(codes: torch.Tensor, bits: int) -> bytes:
    if bits == 8:
        return codes.numpy().tobytes()
    u = (codes.to(torch.int16) & 0xF).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat([u, u.new_zeros(1)])
    pairs = u.reshape(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).numpy().tobytes()


def _unpack(data: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    if bits == 8:
        return data[:n].view(torch.int8).to(torch.float32)
    lo = (data & 0xF).to(torch.int16)
    hi = (data >> 4).to(torch.int16)
    nib = torch.stack([lo, hi], dim=1).reshape(-1)[:n]
    return torch.where(nib > 7, nib - 16, nib).to(torch.float32)


def decode_light_delta(
    base: torch.Tensor, payload: bytes | memoryview, *, bits: int = 8, block: int = DEFAULT_BLOCK
) -> torch.Tensor:
    """``base`` plus the delta in ``payload``, in ``base``'s dtype and shape (a new tensor)."""
    _check(bits, block)
    n = base.numel()
    expected = light_delta_size(n, bits=bits, block=block)
    if len(payload) != expected:
        raise ValueError(
            f"light delta payload is {len(payload)} bytes, a tensor of {n} elements needs "
            f"{expected} (damaged, or written with other bits/block)"
        )
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if n else torch.empty(0)
    nscales = math.ceil(n / block)
    scales = raw[: 4 * nscales].view(torch.float32)
    codes = _unpack(raw[4 * nscales :], n, bits)
    per = scales.repeat_interleave(block)[:n]
    wd = _work_dtype(base.dtype)
    out = base.detach().reshape(-1).to(wd) + (codes * per).to(wd)
    return out.to(base.dtype).reshape(base.shape)
