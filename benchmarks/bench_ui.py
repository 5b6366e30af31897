#!/usr/bin/env python
"""The dashboard at scale and during training (issue 29): a run of 10,000 checkpoints with
a manager saving once per second, served by a real ``stepvault ui`` process.

Rewrites the section between ``<!-- ui:begin -->`` and ``<!-- ui:end -->`` of
BENCHMARKS.md::

    python benchmarks/bench_ui.py [--checkpoints 10000] [--seconds 30] [--out BENCHMARKS.md]

Measures, over HTTP on loopback:

- time to first byte of every page and of the run's JSON, cold (the first request to a
  fresh server) and warm (median of the next ones), with no cold tier and with a cold tier
  whose endpoint accepts connections and never answers (a blackhole on loopback);
- while a ``CheckpointManager`` in another process saves once per second: what an open run
  page downloads per update (``/api/changes`` polls plus ``/api/runs/RUN?since=CURSOR``,
  gzip as a browser asks), against what the page downloaded before (the whole run JSON on
  every save), and how long an update takes to answer.

The run is written quickly (``tests/ui_util.make_long_run``: one real save, its manifest
re-committed per step with the commit epilogue's summary rows, a save event per step).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common
from _common import REPO, facts_line, fmt_bytes, machine_facts, table

sys.path.insert(0, str(REPO / "tests"))
from ui_util import make_long_run

SECTION = "ui"
RUN = "long"
#: seconds between two polls of /api/changes by an open page (the dashboard's default)
POLL = 2.0

WRITER = """
import sys, time, torch
from stepvault import CheckpointManager, Every
root, run, start, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
w = torch.zeros(64)
with CheckpointManager(root, run=run, save=Every(steps=1), async_save=False) as mgr:
    t0 = time.monotonic(); step = start
    while time.monotonic() - t0 < seconds:
        w[0] = step
        mgr.save(step, {"w": w}, metrics={"loss": 1.0 / step, "lr": 1e-3})
        step += 1
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t0) % 1.0))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Blackhole:
    """Accepts connections on loopback and never answers: a dead S3 endpoint."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


class Server:
    """``stepvault ui`` in its own process."""

    def __init__(self, root: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "stepvault.cli.main", "ui", "--root", str(root)]
        cmd += ["--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("stepvault ui did not start")

    def get(self, path: str, gzip: bool = True) -> tuple[float, float, int, bytes, dict[str, str]]:
        """(time to first byte, total time, bytes on the wire, body, headers)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        headers = {"Accept-Encoding": "gzip"} if gzip else {}
        t0 = time.perf_counter()
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        ttfb = time.perf_counter() - t0
        body = resp.read()
        total = time.perf_counter() - t0
        head = {k.lower(): v for k, v in resp.getheaders()}
        wire = len(body) + sum(len(k) + len(v) + 4 for k, v in resp.getheaders()) + 17
        conn.close()
        if resp.status >= 400:
            raise RuntimeError(f"{path}: HTTP {resp.status}")
        return ttfb, total, wire, body, head

    def json(self, path: str) -> Any:
        import gzip as gz

        _, _, _, body, head = self.get(path)
        return json.loads(gz.decompress(body) if head.get("content-encoding") == "gzip" else body)

    def stop(self) -> float:
        t0 = time.perf_counter()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        return time.perf_counter() - t0


def pages(steps: list[int]) -> dict[str, str]:
    return {
        "store `/`": "/",
        "store with usage (`/?usage=1`, fetched by its script)": "/?usage=1",
        "run `/runs/RUN`": f"/runs/{RUN}",
        "run, oldest page": f"/runs/{RUN}?page=999999",
        "checkpoint": f"/runs/{RUN}/checkpoints/{steps[len(steps) // 2]}",
        "events": f"/events?run={RUN}",
        "registry": "/registry",
        "run JSON (whole)": f"/api/runs/{RUN}",
        "retention preview (the run's own policy: none)": f"/api/runs/{RUN}/retention",
        "retention preview, `keep_last=3` (gc's plan)": f"/api/runs/{RUN}/retention?keep_last=3",
    }


def ttfb_of_pages(server: Server, steps: list[int], repeats: int) -> dict[str, tuple[float, float]]:
    """page -> (cold TTFB, warm TTFB median) in seconds."""
    out = {}
    for name, path in pages(steps).items():
        cold = server.get(path)[0]
        warm = statistics.median(server.get(path)[0] for _ in range(repeats))
        out[name] = (cold, warm)
        print(f"{name}: cold {cold:.3f} s, warm {warm:.3f} s", flush=True)
    return out


def live(server: Server, root: Path, start: int, seconds: float) -> dict[str, Any]:
    """An open run page while a manager saves once per second: what each update costs."""
    doc = server.json(f"/api/runs/{RUN}")
    whole_gz = server.get(f"/api/runs/{RUN}")[2]
    whole_raw = server.get(f"/api/runs/{RUN}", gzip=False)[2]
    cursor = doc["cursor"]
    token = server.json("/api/changes")["token"]
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root), RUN, str(start), str(seconds)]
    )
    polls = updates = 0
    poll_bytes = update_bytes = 0
    per_update: list[int] = []
    latency: list[float] = []
    new_rows = 0
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < seconds + 3:
            time.sleep(POLL)
            _, _, wire, body, _ = server.get("/api/changes")
            polls += 1
            poll_bytes += wire
            now = json.loads(body)["token"]
            if now == token:
                continue
            token = now
            _, total, wire, body, head = server.get(f"/api/runs/{RUN}?since={cursor}")
            import gzip as gz

            delta = json.loads(
                gz.decompress(body) if head.get("content-encoding") == "gzip" else body
            )
            if delta.get("unchanged"):
                continue
            cursor = delta["cursor"]
            updates += 1
            update_bytes += wire
            per_update.append(wire)
            latency.append(total)
            new_rows += len(delta.get("checkpoints", []))
    finally:
        writer.wait(timeout=seconds + 120)
    return {
        "seconds": time.monotonic() - t0,
        "polls": polls,
        "poll_bytes": poll_bytes,
        "updates": updates,
        "update_bytes": update_bytes,
        "per_update_median": statistics.median(per_update) if per_update else 0,
        "per_update_max": max(per_update) if per_update else 0,
        "latency_median": statistics.median(latency) if latency else float("nan"),
        "new_rows": new_rows,
        "whole_gz": whole_gz,
        "whole_raw": whole_raw,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", type=int, default=10_000)
    ap.add_argument("--seconds", type=float, default=30.0, help="live phase: manager saving 1/s")
    ap.add_argument("--repeats", type=int, default=5, help="warm requests per page")
    ap.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    t_all = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-ui-", dir=args.workdir or None))
    root = work / "store"
    t0 = time.perf_counter()
    steps = make_long_run(root, RUN, args.checkpoints)
    made = time.perf_counter() - t0
    print(f"{len(steps)} checkpoints written in {made:.1f} s", flush=True)

    server = Server(root)
    plain = ttfb_of_pages(server, steps, args.repeats)
    run = live(server, root, args.checkpoints + 1, args.seconds)
    stop_plain = server.stop()
    print(json.dumps(run), flush=True)

    dead: dict[str, tuple[float, float]] | None = None
    stop_dead = float("nan")
    hole = None
    with contextlib.suppress(ImportError):
        import s3fs  # noqa: F401

        from stepvault.store import Store
        from stepvault.tiers.config import TierSpec, add_tier

        hole = Blackhole()
        add_tier(
            Store.open(root),
            TierSpec(
                "s3arch", "s3://b/c", options={"endpoint_url": f"http://127.0.0.1:{hole.port}"}
            ),
        )
        env = {
            "AWS_ACCESS_KEY_ID": "x",
            "AWS_SECRET_ACCESS_KEY": "y",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        server = Server(root, env)
        steps = Store.open(root).list_steps(RUN)
        dead = ttfb_of_pages(server, steps, args.repeats)
        stop_dead = server.stop()
        hole.close()

    runtime = time.perf_counter() - t_all
    facts = machine_facts(work)
    rows = []
    for name in plain:
        cold, warm = plain[name]
        row = [name, f"{cold:.3f} s", f"{warm:.3f} s"]
        if dead is not None:
            row += [f"{dead[name][0]:.3f} s", f"{dead[name][1]:.3f} s"]
        rows.append(row)
    header = ["page", "cold TTFB", "warm TTFB"]
    if dead is not None:
        header += ["cold, dead tier", "warm, dead tier"]
    per_save_before = run["whole_gz"]
    lines = _common.section_head(
        "The dashboard at scale and during training (issue 29)",
        "python benchmarks/bench_ui.py",
        runtime,
        facts,
    )
    lines += [
        f"A run of {len(steps):,} checkpoints (written in {made:.0f} s), `stepvault ui` in its "
        "own process, HTTP on loopback, gzip accepted as a browser does.",
        "",
        "### Time to first byte",
        "",
        table(header, rows),
        "",
        f"Goals: < 0.3 s warm, < 1.5 s cold; a dead tier costs what no tier costs. Server "
        f"exit after SIGTERM: {stop_plain:.2f} s"
        + (f", with the dead tier {stop_dead:.2f} s." if dead is not None else ".")
        + ("" if dead is not None else " (no s3fs: the dead-tier columns were not measured)"),
        "",
        "### An open run page while a manager saves once per second",
        "",
        table(
            ["measure", "value"],
            [
                ["live phase", f"{run['seconds']:.0f} s, {run['new_rows']} new checkpoints"],
                ["updates (a change seen by a poll)", str(run["updates"])],
                [
                    "bytes per update, median (max)",
                    f"{fmt_bytes(run['per_update_median'])} ({fmt_bytes(run['per_update_max'])})",
                ],
                [
                    "bytes of the polls (`/api/changes`, every 2 s)",
                    f"{fmt_bytes(run['poll_bytes'])} for {run['polls']} polls",
                ],
                ["update answered in, median", f"{run['latency_median']:.3f} s"],
                [
                    "the whole run JSON (what each update fetched before)",
                    f"{fmt_bytes(run['whole_raw'])} raw, {fmt_bytes(per_save_before)} gzipped",
                ],
                [
                    "bytes per update / whole run JSON (gzipped)",
                    f"{run['per_update_median'] / per_save_before:.4f}",
                ],
            ],
        ),
        "",
        "### Method",
        "",
        "- The run: `tests/ui_util.make_long_run` (a real `stepvault.save`, then its manifest "
        "re-committed for each step with the commit epilogue's summary row and object list, "
        "and a `save` event carrying the metrics); the live writer is a `CheckpointManager` "
        "in another process saving one checkpoint per second on the same run.",
        "- TTFB: `http.client` to a fresh `stepvault ui` process; cold = its first request "
        f"for the page, warm = median of the next {args.repeats} (the page is memoised until "
        "the store changes).",
        "- The dead tier: `tiers add s3arch s3://b/c --endpoint-url` pointing at a loopback "
        "socket that accepts connections and never answers (the worst case: no refusal); "
        "the dashboard probes it on a background thread and leaves it out of every page.",
        "- Per update: what a run page's script downloads when a poll sees a change: "
        "`/api/runs/RUN?since=CURSOR` (new and changed checkpoints, removed steps, new metric "
        "points and save statistics, the marks), headers included.",
    ]
    _common.write_section(args.out, SECTION, "\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"plain": plain, "dead": dead, "live": run}))
    print(facts_line(facts))
    _common.remove(work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
