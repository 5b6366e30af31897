"""Child process for the tier-move crash test: apply a tier policy hot -> S3, slowly.

Prints ``COMMIT <step>`` right before each manifest commit in the cold tier and
``EVICT``/``DONE`` markers, so the parent can SIGKILL it at a chosen instant.
"""

from __future__ import annotations

import argparse
import sys
import time

from stepvault.store import Store
from stepvault.tiers import CopyEvery, HotLast, Tiers, TierSpec, apply_tier_policy

ap = argparse.ArgumentParser()
ap.add_argument("--hot", required=True)
ap.add_argument("--cold", required=True)
ap.add_argument("--endpoint", required=True)
ap.add_argument("--pause-at", type=int, default=-1, help="sleep before this step's commit")
args = ap.parse_args()

hot = Store.open(args.hot)
tiers = Tiers(hot, [TierSpec("archive", args.cold, options={"endpoint_url": args.endpoint})])


def before_commit(step: int, tier: str) -> None:
    print(f"COMMIT {step}", flush=True)
    if step == args.pause_at:
        time.sleep(60)


print("START", flush=True)
t0 = time.perf_counter()
report = apply_tier_policy(
    tiers,
    "r",
    HotLast(1) | CopyEvery("archive", steps=1),
    grace_seconds=0,
    workers=4,
    before_commit=before_commit,
)
print("DONE", f"{time.perf_counter() - t0:.2f}s", report.evicted, report.failed, flush=True)
sys.exit(1 if report.failed else 0)
