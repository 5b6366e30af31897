"""Crash injection: SIGKILL a training process at random instants, many times.

Each trial kills a real training process (async saves with slowed object writes, a keep
policy with immediate GC, and for odd seeds a cold tier that the mover copies every 6th
step to in the background) at a random moment — mid-object write, between the last object
and the manifest, during retention/GC, during a tier move — then checks that the store
deep-verifies, that restore takes the newest committed checkpoint, and that training
continued from there ends bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import pytest
from helpers import final_digest, run_train_loop, start_train_loop

import stepvault

ARGS = ["--steps", "30", "--save-every", "3", "--width", "256", "--slow-writes", "0.05"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return final_digest(run_train_loop(tmp_path_factory.mktemp("ref"), *ARGS, timeout=300))


def _cold(root: Path) -> Path:
    return root.parent / "cold"  # next to the hot store, inside this trial's tmp_path


def _committed(root: Path) -> list[int]:
    """Steps committed in any tier (hot and, when configured, the cold directory)."""
    steps: set[int] = set()
    for store in (root, _cold(root)):
        if (store / "stepvault.json").exists():
            steps.update(stepvault.open(store).steps("job"))
    return sorted(steps)


def _verify_all(root: Path) -> None:
    for store in (root, _cold(root)):
        if (store / "stepvault.json").exists() and stepvault.open(store).runs():
            report = stepvault.ops.verify(store, deep=True)
            assert report.ok, report.to_json()


def _trial(root: Path, seed: int, reference: str) -> dict:
    """One kill; odd seeds also run a cold tier, so kills land in tier moves too."""
    rng = random.Random(seed)
    tier = ["--cold", str(_cold(root))] if seed % 2 else []
    proc = start_train_loop(root, *ARGS, *tier)
    # wait until training runs (imports take a while), then kill at a random instant
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stdout.readline()
        if line.startswith(("FRESH", "RESUMED")) or not line:
            break
    time.sleep(rng.uniform(0.0, 2.5))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    committed = _committed(root)
    _verify_all(root)
    stdout = run_train_loop(root, *ARGS, *tier, timeout=300)
    expected = f"RESUMED {committed[-1]}" if committed else "FRESH"
    assert expected in stdout
    assert final_digest(stdout) == reference
    _verify_all(root)
    if tier:  # the policy ran to the end: every 6th step archived, consistent both sides
        assert stepvault.open(_cold(root)).steps("job")[-1] == 30
    return {"seed": seed, "committed_at_kill": committed[-1] if committed else None}


@pytest.mark.parametrize("seed", [11, 12])
def test_sigkill_at_random_instants(tmp_path, reference, seed):
    _trial(tmp_path / "store", seed, reference)


def _seed_trial(root: Path, seed: int, reference: str) -> dict:
    try:
        return _trial(root, seed, reference)
    except Exception as exc:
        raise AssertionError(f"seed {seed}: {exc!r}") from exc


# The campaign: STEPVAULT_CRASH_SEEDS seeds (default 6; RELIABILITY.md's figures come from
# runs of 50), two trials at a time (separate stores): a trial mostly waits on its child
# processes (slowed writes, sleeps, torch start-up). The first seed moves with the date
# (override: STEPVAULT_CRASH_SEED_BASE), so successive CI runs kill at different instants
# while any one failure stays reproducible from the seed in its test id.
_SEEDS = int(os.environ.get("STEPVAULT_CRASH_SEEDS", "6"))
_BASE = int(
    os.environ.get("STEPVAULT_CRASH_SEED_BASE", str(1000 + 50 * (date.today().toordinal() % 20)))
)


@pytest.mark.slow
@pytest.mark.parametrize("first", range(_BASE, _BASE + _SEEDS, 2))
def test_sigkill_at_random_instants_many(tmp_path, reference, first):
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [
            pool.submit(_seed_trial, tmp_path / f"s{seed}" / "store", seed, reference)
            for seed in (first, first + 1)
        ]
    for fut in futures:
        fut.result()
