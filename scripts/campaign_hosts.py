"""The fault campaign across namespaced hosts (issue 33), counted.

Runs the scenarios of ``tests/hosts.py`` (a host killed during saves and replication or
during a restore, a host's link partitioned, the S3 host behind a slow, lossy link, a
stale writer's commit after a takeover by another job, frozen or partitioned from the
S3 host, one host's disk full) with
random timing, for a number of trials or minutes, on hosts made once by
``tests/netns.py`` (root, Linux namespaces), and appends one row per scenario to the
campaign table of RELIABILITY.md: trials, broken resumes, undetected corruptions, where
the restores came from, minutes.

    python scripts/campaign_hosts.py --minutes 30              # every scenario, in turn
    python scripts/campaign_hosts.py --trials 40 --scenarios kill_save,partition
    python scripts/campaign_hosts.py --trials 4 --no-table     # a sample, nothing written
    python scripts/campaign_hosts.py --minutes 120 --parallel 4  # 4 clusters (8+ cores)

A broken resume is a restore or a final state that differs from the uninterrupted replay,
ranks that restored different steps, a restore older than the newest checkpoint on disk,
or a job that did not finish in its launches; an undetected corruption is a committed
checkpoint that ``verify --deep`` rejects. Each failed trial's directory is kept (and
named) under ``--work``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import random
import shutil
import sys
import threading
import time
import types
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "src")]

import hosts  # noqa: E402
import netns  # noqa: E402

SCENARIOS = [
    "kill_save", "kill_restore", "partition", "s3_slow", "stale_writer", "disk_full",
    "stale_partition",
]  # fmt: skip
#: scenarios that run on their own number of hosts (two jobs of 2 hosts)
OWN_HOSTS = {"stale_writer": 4, "stale_partition": 4}
END = "<!-- campaign_hosts:end -->"  # right after the campaign table's last row


def append_rows(path: Path, rows: list[str]) -> None:
    """Insert ``rows`` at the end of the campaign table (before its end marker)."""
    text = path.read_text()
    if END not in text:
        raise SystemExit(f"{path} has no campaign table (the {END} marker after it)")
    head, tail = text.split(END, 1)
    path.write_text(head + "".join(r + "\n" for r in rows) + END + tail)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trials", type=int, default=None, help="trials in all (default: by time)")
    p.add_argument("--minutes", type=float, default=None, help="stop starting trials after this")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--hosts", type=int, default=2, help="2-4 training hosts")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--parallel", type=int, default=1,
                   help="clusters running trials at once (one per 2 spare cores)")  # fmt: skip
    p.add_argument("--work", default="/tmp/stepvault-campaign-hosts")
    p.add_argument("--table", default=str(REPO / "RELIABILITY.md"))
    p.add_argument("--no-table", action="store_true", help="print the counts only")
    p.add_argument("--json", default=None, help="also write the counts and each trial here")
    args = p.parse_args()
    if args.trials is None and args.minutes is None:
        p.error("give --trials N or --minutes M")
    reason = netns.unavailable()
    if reason:
        print(f"campaign_hosts: cannot make hosts here: {reason}", file=sys.stderr)
        return 2
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        p.error(f"unknown scenarios {unknown}; choose from {SCENARIOS}")
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    counts: dict[str, Counter[str]] = {s: Counter() for s in scenarios}
    trials: list[dict] = []
    t0 = time.monotonic()
    started = datetime.datetime.now(datetime.timezone.utc)
    made = max([args.hosts, *(OWN_HOSTS.get(s, 0) for s in scenarios)])
    lock = threading.Lock()
    next_trial = [0]
    base = rng.randint(40, 250 - args.parallel)  # each lane its own subnet

    def take() -> int | None:
        """The next trial's number, or None once the trials or the minutes are used up."""
        with lock:
            n = next_trial[0]
            if args.trials is not None and n >= args.trials:
                return None
            if args.minutes is not None and time.monotonic() - t0 > 60 * args.minutes:
                return None
            next_trial[0] += 1
            return n

    def lane(index: int) -> None:
        """One cluster of hosts running trials one after another."""
        need_s3 = bool({"s3_slow", "stale_partition"} & set(scenarios))
        with netns.Cluster(made, s3=need_s3, net=base + index) as cluster:
            # the scenarios' hosts: the first --hosts ones (stale_writer: its own number)
            view = types.SimpleNamespace(hosts=cluster.hosts[: args.hosts], s3=cluster.s3)
            s3 = hosts.S3Host(cluster) if cluster.s3 is not None else None
            try:
                while (n := take()) is not None:
                    trial(n, cluster, view, s3)
            finally:
                if s3 is not None:
                    s3.stop()

    def trial(n: int, cluster, view, s3) -> None:
        scenario = scenarios[n % len(scenarios)]
        trial_seed = random.Random(seed * 1_000_003 + n).randrange(1 << 30)
        folder = work / f"trial-{n:05d}-{scenario}"
        began = time.monotonic()
        n_hosts = OWN_HOSTS.get(scenario, args.hosts)
        on = cluster if n_hosts == made else view
        outcome = hosts.run_scenario(
            on, scenario, folder, steps=args.steps, rng=random.Random(trial_seed), s3=s3,
        )  # fmt: skip
        with lock:
            c = counts[scenario]
            c["hosts"] = n_hosts
            c["trials"] += 1
            c["broken"] += bool(outcome.broken)
            c["corrupt"] += bool(outcome.corrupt)
            c["seconds"] += round(time.monotonic() - began)
            for _, tier in outcome.restored:
                c[f"from:{tier or 'fresh'}"] += 1
            trials.append({"n": n, "scenario": scenario, "seed": trial_seed,
                           "ok": outcome.ok, "broken": outcome.broken,
                           "corrupt": outcome.corrupt, "notes": outcome.notes,
                           "restored": outcome.restored})  # fmt: skip
            status = "ok" if outcome.ok else f"FAILED (kept in {folder})"
            print(f"[{n}] {scenario} seed {trial_seed}: {status} {outcome.notes} "
                  f"restored {outcome.restored}", flush=True)  # fmt: skip
        if outcome.ok:
            shutil.rmtree(folder, ignore_errors=True)

    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        for done in [pool.submit(lane, i) for i in range(args.parallel)]:
            done.result()
    minutes = (time.monotonic() - t0) / 60
    rows = []
    for scenario, c in counts.items():
        if not c["trials"]:
            continue
        sources = ", ".join(f"{k[5:]} {v}" for k, v in sorted(c.items()) if k.startswith("from:"))
        rows.append(
            f"| {started:%Y-%m-%d} | {scenario} | {c['hosts']} | {c['trials']} | {c['broken']} "
            f"| {c['corrupt']} | {sources} | {c['seconds'] / 60:.1f} | seed {seed} |"
        )
    print("\n".join(rows))
    print(f"{sum(c['trials'] for c in counts.values())} trials in {minutes:.1f} min")
    if args.json:
        Path(args.json).write_text(json.dumps({"seed": seed, "trials": trials}, indent=1))
    if not args.no_table and rows:
        append_rows(Path(args.table), rows)
        print(f"appended {len(rows)} rows to {args.table}")
    return 1 if any(c["broken"] or c["corrupt"] for c in counts.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
