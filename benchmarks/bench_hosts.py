#!/usr/bin/env python
"""Resume after a host loss on namespaced hosts (issue 33): buddy memory vs disk vs S3, and
the replication lag behind the save, with and without a bandwidth cap or added latency
between the hosts.

Two hosts made by ``tests/netns.py`` (root; network, mount and UTS namespaces, each with
its own ``/dev/shm``) run ``tests/hosts_job.py`` under ``torchrun`` (one rank each, a
``--width`` model, every step saved through the replicated mem tier, disk every 3rd).

* **buddy memory**: 5 steps (step 5 in memory only), host h1 dies (its memory wiped),
  the job restarts: h1's rank restores from h0's replica, h0's from its own memory;
* **disk**: 6 steps (step 6 on disk), both hosts replaced (all memory gone), restart;
* **S3**: the same with the hot store on the ``s3`` host (moto, no faults).

The restore time is ``mgr.restore()`` inside the restarted job (all ranks agree, fetch,
verify, place), median over ``--repeats``. The replication lag is each ``replica`` event's
``lag_seconds`` (from the save's commit into memory to the buddy's committed replica),
median over the saves: the links as they are, with ``tc tbf`` capping each host's sending
rate (``--cap``), and with ``--delay-ms`` added to every packet between the hosts each way
(this kernel has no ``netem``: ``netns.Cluster.delay`` routes the hosts' traffic through a
userspace delay line on a TUN device in a router host). The first case rotates through the
three link conditions over the repeats.

Rewrites the section between ``<!-- hosts:begin -->`` and ``<!-- hosts:end -->``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests"), str(HERE.parent / "src")]
import _common  # noqa: E402
import hosts  # noqa: E402
import netns  # noqa: E402
from _common import table  # noqa: E402


def _launch(cluster, root: str, work: Path, launch: int, steps: int, width: int,
            env: dict[str, str] | None) -> list[dict]:  # fmt: skip
    job = hosts.Job(cluster, root, work, steps=steps, launch=launch, width=width, env=env,
                    sleep=0.05, timeout=120)  # fmt: skip
    if not job.wait(timeout=600):
        raise RuntimeError(f"launch {launch} failed: see {work}/log-{launch}-*.txt")
    return [json.loads((work / f"restore-{launch}-{r}.json").read_text()) for r in range(2)]


def _lags(root: str) -> list[float]:
    """``lag_seconds`` of every ``replica`` event of the run (a store on this machine)."""
    from stepvault.catalog.events import read_events
    from stepvault.store import Store

    events = read_events(Store.open(root), "r")
    return [e["lag_seconds"] for e in events if e["event"] == "replica" and "lag_seconds" in e]


def _probe(cluster) -> tuple[float, float]:
    """The median TCP round trip (ms) and bulk throughput (MB/s) from h0 to h1."""
    a, b = cluster.hosts[:2]
    server = (
        "import socket\ns = socket.create_server(('0.0.0.0', 7300))\n"
        "for _ in range(2):\n    c, _ = s.accept()\n"
        "    while d := c.recv(1 << 20):\n        c.send(d[:1])\n"
    )
    srv = b.popen([sys.executable, "-c", server])
    client = (
        "import socket, statistics, time\n"
        "for _ in range(100):\n"
        f"    try: c = socket.create_connection(('{b.address}', 7300)); break\n"
        "    except OSError: time.sleep(0.05)\n"
        "c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\nr = []\n"
        "for _ in range(30):\n"
        "    t = time.perf_counter(); c.sendall(b'x'); c.recv(1)\n"
        "    r.append(time.perf_counter() - t)\n"
        "c.close()\nc = socket.create_connection(('" + b.address + "', 7300))\n"
        "t = time.perf_counter(); c.sendall(b'x' * (32 << 20)); c.shutdown(socket.SHUT_WR)\n"
        "while c.recv(1 << 20): pass\n"
        "print(statistics.median(r) * 1000, 32 * 1.048576 / (time.perf_counter() - t))"
    )
    try:
        rtt, mbs = a.run([sys.executable, "-c", client]).stdout.split()
    finally:
        srv.kill()
        srv.wait()
    return float(rtt), float(mbs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=2048, help="model width (16 B per parameter)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cap", default="200mbit", help="tbf rate for the capped lag")
    p.add_argument("--delay-ms", type=float, default=5.0, help="latency added each way")
    p.add_argument("--out", default=str(HERE.parent / "BENCHMARKS.md"))
    p.add_argument("--workdir", "--work", dest="work", default="/tmp/stepvault-bench-hosts")
    p.add_argument("--cases", default="buddy,disk,s3", help="of buddy, disk, s3")
    args = p.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    reason = netns.unavailable()
    if reason:  # the section says why instead of numbers (run_all keeps going)
        print(f"bench_hosts: cannot make hosts here: {reason}", file=sys.stderr)
        _common.write_section(
            Path(args.out),
            "hosts",
            "## Resume after a host loss: buddy memory vs disk vs S3 (namespaced hosts)\n\n"
            f"Not measured on this machine: {reason}.",
        )
        return
    from hosts_job import make

    state = make(args.width)
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].state_dict().values()) * 2
    t0 = time.monotonic()
    base = Path(args.work)
    base.mkdir(parents=True, exist_ok=True)
    facts = _common.machine_facts(base)
    work = Path(tempfile.mkdtemp(prefix="bench-hosts-", dir=base))  # removed at the end
    times: dict[str, list[float]] = {"buddy memory (peer)": [], "own memory (mem)": [],
                                     "disk (hot)": [], "S3": []}  # fmt: skip
    delayed = f"+{args.delay_ms:g} ms each way (delay line)"
    lags: dict[str, list[float]] = {"no cap": [], f"tbf {args.cap}": [], delayed: []}
    with netns.Cluster(2, s3="s3" in cases, shm_size="2g") as cluster:
        s3 = hosts.S3Host(cluster) if "s3" in cases else None
        cluster.delay(args.delay_ms)
        rtt, line_mbs = _probe(cluster)
        cluster.delay(0)
        try:
            for rep in range(args.repeats):
                for case in cases:
                    folder = work / f"{case}-{rep}"
                    if folder.exists():
                        shutil.rmtree(folder)
                    folder.mkdir(parents=True)
                    for h in cluster.hosts:
                        h.kill(wipe=True)
                    env = None
                    root = str(folder / "hot")
                    if case == "s3":
                        root = f"s3://ckpt/bench-{rep}-{random.randrange(1 << 30):x}"
                        assert s3 is not None
                        s3.conditions()
                        env = s3.env()
                    # the first case that records lags rotates the link conditions
                    link = rep % 3 if case == cases[0] and case != "s3" else 0
                    for h in cluster.hosts:
                        (h.cap(rate=args.cap) if link == 1 else h.uncap())
                    cluster.delay(args.delay_ms if link == 2 else 0)
                    steps = 5 if case == "buddy" else 6
                    _launch(cluster, root, folder, 0, steps, args.width, env)
                    for h in cluster.hosts:
                        h.uncap()
                    cluster.delay(0)
                    if case != "s3":
                        lags[["no cap", f"tbf {args.cap}", delayed][link]] += _lags(root)
                    if case == "buddy":
                        cluster.hosts[1].kill(wipe=True)  # h0 keeps its memory
                    else:
                        for h in cluster.hosts:
                            h.kill(wipe=True)
                    docs = _launch(cluster, root, folder, 1, steps, args.width, env)
                    if case == "buddy":
                        assert [d["tier"] for d in docs] == ["mem", "peer"], docs
                        times["own memory (mem)"].append(docs[0]["seconds"])
                        times["buddy memory (peer)"].append(docs[1]["seconds"])
                    else:
                        times["disk (hot)" if case == "disk" else "S3"] += [
                            max(d["seconds"] for d in docs)
                        ]
                    print(case, rep, docs, flush=True)
        finally:
            if s3 is not None:
                s3.stop()
            shutil.rmtree(work, ignore_errors=True)
    runtime = time.monotonic() - t0
    command = (
        f"python benchmarks/bench_hosts.py --width {args.width} --repeats {args.repeats} "
        f"--cases {','.join(cases)}"
    )
    med = {k: statistics.median(v) for k, v in times.items() if v}
    lines = [
        "## Resume after a host loss: buddy memory vs disk vs S3 (namespaced hosts)",
        "",
        f"Generated by `{command}` in {runtime / 60:.1f} min on "
        f"{facts['date']}. {_common.facts_line(facts)}; load average at start "
        f"{facts['load average at start']}.",
        "",
        f"Two hosts (`tests/netns.py`: own network stack, hostname and `/dev/shm` each), one "
        f"rank each under `torchrun` (c10d rendezvous across the hosts), {nbytes / 1e6:.0f} MB "
        "of model and momentum per rank, every step saved through the replicated mem tier "
        "(disk every 3rd). Restore time: `mgr.restore()` in the restarted job, median of "
        f"{args.repeats}; the S3 host is moto behind the harness's proxy (no faults) on the "
        "same machine.",
        "",
        table(
            ["restart after", "restored from", "restore time (median)", "runs"],
            [
                [
                    "h1 died (its memory gone)",
                    "h1's rank: h0's replica (peer)",
                    f"{med.get('buddy memory (peer)', float('nan')):.2f} s",
                    _common.secs(times["buddy memory (peer)"]),
                ],
                [
                    "h1 died",
                    "h0's rank: its own memory",
                    f"{med.get('own memory (mem)', float('nan')):.2f} s",
                    _common.secs(times["own memory (mem)"]),
                ],
                [
                    "both hosts replaced",
                    "disk (hot store)",
                    f"{med.get('disk (hot)', float('nan')):.2f} s",
                    _common.secs(times["disk (hot)"]),
                ],
                [
                    "both hosts replaced",
                    "S3 (moto on the s3 host)",
                    f"{med.get('S3', float('nan')):.2f} s",
                    _common.secs(times["S3"]),
                ],
            ],
        ),
        "",
        "Replication lag behind the save (`replica` events' `lag_seconds`: from the commit "
        "into the rank's memory to the buddy's committed replica; saves every step, so a "
        "slow link queues replicas):",
        "",
        table(
            ["hosts' links", "replicas", "lag (median)", "lag (max)"],
            [
                [k, str(len(v)), f"{statistics.median(v):.3f} s", f"{max(v):.3f} s"]
                for k, v in lags.items()
                if v
            ],
        ),
        "",
        "The capped row is a `tc tbf` cap on each host's sending rate. This kernel has no "
        "`netem` (nor `fq`/`etf`), so the latency row routes every packet between the hosts "
        "through a router host whose forwarding goes through a TUN device and a userspace "
        f"delay line (`netns.Cluster.delay`): {args.delay_ms:g} ms each way, measured RTT "
        f"{rtt:.1f} ms; the line is a Python process on the same cores, so it also caps the "
        f"throughput between the hosts (~{line_mbs:.0f} MB/s here). All hosts share this "
        "machine's cores.",
    ]
    _common.write_section(Path(args.out), "hosts", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
