"""``stepvault verify --signatures``: check every signed record, report anything altered.

Covered: each manifest (detached ``<step>.sig``), each annotation record, each registry
version and alias move (their own ``signature`` field), plus the registry's hash chain.
A manifest whose signature fails was altered after signing even if its envelope checksum
was recomputed; an ``unsigned`` record in a store that should be signed is reported too
(``require=True`` counts it as a failure).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..catalog.annotations import read_annotations
from ..registry import Registry
from ..store import Store
from ..store.signing import Signer, Verifier
from ..tiers.config import HOT
from ..tiers.view import TieredView, read_view


@dataclass
class SignatureReport:
    """Every checked record with its verdict; ``ok`` when nothing is invalid."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    require: bool = False

    def count(self, status: str) -> int:
        return sum(1 for e in self.entries if e["status"] == status)

    @property
    def problems(self) -> list[dict[str, Any]]:
        bad = {
            "invalid",
            "other-key",
            "broken-chain",
            "truncated",
            "no-head",
            "damaged",
            "changed-checkpoint",
            "missing-checkpoint",
        }
        if self.require:
            bad.add("unsigned")
        return [e for e in self.entries if e["status"] in bad]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        statuses = sorted({e["status"] for e in self.entries})
        return {
            "ok": self.ok,
            "counts": {s: self.count(s) for s in statuses},
            "problems": self.problems,
            "entries": self.entries,
        }


def verify_signatures(
    store: Store, verifier: Verifier | Signer, *, run: str | None = None, require: bool = False
) -> SignatureReport:
    """Check the signatures of ``run`` (all runs when None) and of the whole registry."""
    if isinstance(verifier, Signer):
        verifier = verifier.verifier()
    report = SignatureReport(require=require)
    view = read_view(store)
    for r in [run] if run else view.list_runs():
        for step, tier, copy in _copies(view, r):
            # each tier's copy is checked: an archive copy altered on its own shows too
            where = f"{r}@{step}" + (f" (in {tier})" if tier != HOT else "")
            try:
                data = copy.read_manifest(r, step)
            except Exception as exc:  # unreadable: the deep verify reports the damage
                report.entries.append(
                    {"kind": "manifest", "ref": where, "status": "damaged", "detail": str(exc)}
                )
                continue
            verdict = verifier.check(data, copy.read_signature(r, step))
            report.entries.append(
                {
                    "kind": "manifest",
                    "ref": where,
                    "tier": tier,
                    "status": verdict.status,
                    "detail": verdict.detail,
                }
            )
        for step, records in read_annotations(store, r).items():
            for record in records:
                key = record.pop("_key")
                verdict = verifier.check_record(record)
                report.entries.append(
                    {
                        "kind": "annotation",
                        "ref": f"{r}@{step}",
                        "key": key,
                        "status": verdict.status,
                        "detail": verdict.detail,
                    }
                )
    for entry in Registry(store).check(verifier):
        status, signature = entry["status"], entry.get("signature", "unsigned")
        if status == "ok" or signature in ("invalid", "other-key"):
            status = signature  # an altered record is reported as such first
        report.entries.append({**entry, "status": status, "registry_status": entry["status"]})
    return report


def _copies(view: Store, run: str) -> Iterator[tuple[int, str, Store]]:
    """``(step, tier, store)`` for every committed copy of every checkpoint of ``run``,
    hot first: a checkpoint moved to a cold tier is signed and checked there."""
    if not isinstance(view, TieredView):
        for step in view.list_steps(run):
            yield step, HOT, view
        return
    stores = dict(view._stores())
    order = {tier: i for i, tier in enumerate(stores)}
    copies = [(step, tier) for tier, steps in view.steps_by_tier(run).items() for step in steps]
    for step, tier in sorted(copies, key=lambda c: (c[0], order[c[1]])):
        yield step, tier, stores[tier]


def sign_existing(store: Store, signer: Signer, run: str, steps: list[int] | None = None) -> int:
    """Sign the committed manifests of ``run`` that have no signature yet, on every tier
    that holds a copy (the signature is written next to each copy); return how many."""
    done = 0
    wanted = None if steps is None else set(steps)
    for step, _tier, copy in _copies(read_view(store), run):
        if wanted is not None and step not in wanted:
            continue
        if copy.read_signature(run, step) is not None:
            continue
        data = copy.read_manifest(run, step)
        sig = json.dumps(signer.sign(data), sort_keys=True).encode()
        copy.backend.put_atomic(copy.signature_key(run, step), [sig], overwrite=False)
        done += 1
    return done
