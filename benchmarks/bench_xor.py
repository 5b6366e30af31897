"""Lossless xor deltas on real AdamW steps: stored size of xor vs float vs zstd.

A small transformer (2 encoder layers, d_model 256) is trained on CPU with AdamW on
random token sequences; after a warm-up, each step's weights and Adam moments are encoded
three ways, chunk by chunk (4 MiB): zstd, the ``float`` codec, and the ``xor`` codec
against the same chunk of the previous step (exactly what an ``xor`` cold tier stores when
it holds every step). Ratios are stored bytes / raw bytes; each decode is checked bitwise.

    .venv/bin/python benchmarks/bench_xor.py [--steps 30] [--warmup 20] [--every 1] [--json out]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from stepvault.format.codecs import choose_codec
from stepvault.format.encoding import torch_dtype_name
from stepvault.format.hashing import content_hash
from stepvault.format.objects import decode_object, encode_object, frame_object
from stepvault.format.xor_codec import encode_xor

CHUNK = 4 << 20


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
    return torch.nn.Sequential(
        torch.nn.Embedding(512, 256),
        torch.nn.TransformerEncoder(layer, 2),
        torch.nn.Linear(256, 512),
    )


def groups(net: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    state = [opt.state[p] for p in net.parameters()]
    return {
        "weights": [p.detach().clone() for p in net.parameters()],
        "exp_avg": [s["exp_avg"].clone() for s in state],
        "exp_avg_sq": [s["exp_avg_sq"].clone() for s in state],
    }


def chunks(t: torch.Tensor):
    raw = memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")
    for at in range(0, raw.nbytes, CHUNK):
        yield raw[at : at + CHUNK]


def sizes(new: list[torch.Tensor], old: list[torch.Tensor]) -> dict[str, int]:
    out = {"raw": 0, "zstd": 0, "float": 0, "xor": 0}
    for a, b in zip(new, old):
        dtype = torch_dtype_name(a.dtype)
        for ra, rb in zip(chunks(a), chunks(b)):
            out["raw"] += ra.nbytes
            out["zstd"] += encode_object(ra, "zstd", dtype).size
            plain = encode_object(ra, choose_codec("float", dtype), dtype)
            out["float"] += plain.size
            digest, base = content_hash(ra), content_hash(rb)
            parts, params = encode_xor(ra, rb, [base], dtype)
            delta = frame_object(digest, "xor", ra.nbytes, params, parts)
            blob = b"".join(bytes(memoryview(p).cast("B")) for p in delta.parts)
            back = decode_object(blob, digest, base=lambda d, m, rb=rb: rb)
            assert bytes(back) == bytes(ra)
            # What the tier stores: the delta only where it wins (plain object otherwise).
            out["xor"] += min(delta.size, plain.size)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--every", type=int, default=1, help="steps between compared checkpoints")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1)
    prev, totals, t0 = None, {}, time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randint(0, 512, (8, 64), generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x).flatten(0, 1), x.roll(1, 1).flatten())
        loss.backward()
        opt.step()
        if step < args.warmup or (step - args.warmup) % args.every:
            continue
        cur = groups(net, opt)
        if prev is not None:
            for name in cur:
                s = sizes(cur[name], prev[name])
                acc = totals.setdefault(name, dict.fromkeys(s, 0))
                for k, v in s.items():
                    acc[k] += v
        prev = cur
    doc = {
        "steps": args.steps,
        "warmup": args.warmup,
        "every": args.every,
        "lr": args.lr,
        "params": sum(p.numel() for p in net.parameters()),
        "seconds": round(time.perf_counter() - t0, 1),
        "ratios": {
            name: {k: round(v / t["raw"], 3) for k, v in t.items() if k != "raw"}
            for name, t in totals.items()
        },
    }
    print("| tensors | zstd | float | xor |\n|---|---|---|---|")
    for name, r in doc["ratios"].items():
        print(f"| {name} | {r['zstd']} | {r['float']} | {r['xor']} |")
    print(json.dumps(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
