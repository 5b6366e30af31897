"""One commit epilogue for every save, the collective (DCP) one included: the summary row
written, the bases of reused xor delta objects listed (so GC keeps them); one rule for
light saves under a process group (written full, warned once); a single-process
checkpoint restored under a group refuses a state it does not fit, nothing changed.
Real 2-rank gloo groups, real stores."""

from __future__ import annotations

import json
from pathlib import Path

import epilogue_workers
import pytest
import torch
from helpers import spawn_ranks
from test_xor_delta import same, save_run, stores

import stepvault
import stepvault.distributed as sd
from stepvault.catalog.events import read_events
from stepvault.catalog.summaries import log_key
from stepvault.engine.gc import sweep
from stepvault.format import parse_manifest
from stepvault.format.hashing import content_hash
from stepvault.format.objects import parse_header
from stepvault.format.xor_codec import chain_of
from stepvault.store import Store


def _spawn(world: int, task: str, root: Path, out: Path) -> None:
    """``epilogue_workers``' ``task`` on ``world`` gloo ranks (helpers.spawn_ranks)."""
    spawn_ranks(epilogue_workers.run, world, task, root, out)


@pytest.fixture(scope="module")
def light_under_group(tmp_path_factory):
    """A manager whose policy emits light saves (steps 1, 2; asynchronous DCP saves) and a
    ``stepvault.save(kind="light")`` (step 3), on 2 ranks."""
    root = tmp_path_factory.mktemp("store")
    out = tmp_path_factory.mktemp("out")
    _spawn(2, "light_under_group", root, out)
    return root, [json.loads((out / f"result{r}.json").read_text()) for r in range(2)]


def test_a_light_save_under_a_group_is_written_full_with_one_warning(light_under_group):
    root, results = light_under_group
    for result in results:  # every rank: both entry points, the same rule
        assert result["kinds"] == ["full", "full", "full"]  # handles, then SaveInfo
        assert len(result["warnings"]) == 1  # once per process, not per save
        assert "need one process" in result["warnings"][0]
    store = Store.open(root)
    for run, steps in (("m", [1, 2]), ("s", [3])):
        for step in steps:
            assert parse_manifest(store.read_manifest(run, step), f"{run}@{step}").kind == "full"
        events = read_events(store, run)
        as_full = [e["step"] for e in events if e["event"] == "light_as_full"]
        assert as_full == steps  # the event log says why, once per save (rank 0's)
    saves = [e for e in read_events(store, "m") if e["event"] == "save"]
    assert [(e["step"], e["kind"]) for e in saves] == [(1, "full"), (2, "full")]


def test_a_collective_commit_writes_its_summary_row(light_under_group):
    root, _ = light_under_group
    store = Store.open(root)
    assert parse_manifest(store.read_manifest("m", 2), "m@2").parent_step == 1
    log = root / log_key("m")
    lines = log.read_bytes().splitlines()
    assert len(lines) == 2  # one row per collective commit (rank 0 commits)
    # Rewrite the row of step 2 (its record checksum still valid): the listing shows the
    # rewritten metric, so it came from the row and the manifest was not parsed.
    checksum, payload = lines[1].split(b" ", 1)
    assert content_hash(payload).encode() == checksum
    digest, entry = json.loads(payload)
    assert entry[4] == {"loss": 2.0}
    entry[4] = {"loss": -2.0}
    payload = json.dumps([digest, entry]).encode()
    lines[1] = content_hash(payload).encode() + b" " + payload
    log.write_bytes(b"\n".join(lines) + b"\n")
    listed = stepvault.open(root).checkpoints("m")
    assert [(c.step, c.metrics["loss"]) for c in listed] == [(1, 1.0), (2, -2.0)]
    assert (root / log_key("s")).read_bytes().count(b"\n") == 1  # stepvault.save's commit


def test_a_collective_save_into_a_delta_store_lists_the_bases_it_reuses(tmp_path):
    hot, tiers = stores(tmp_path, "xor")
    cold = tiers["cold"]
    save_run(hot, tiers, 3)  # r@1..3 in the cold tier: from r@2 on, xor deltas
    _spawn(2, "save_into_delta_store", tmp_path, tmp_path / "out")
    direct = parse_manifest(cold.read_manifest("direct", 1), "direct@1")
    assert direct.sharded  # written by the DCP writer
    deltas = [d for d, e in direct.objects.items() if e.codec == "xor"]
    assert deltas  # the collective save reused r@3's delta objects...
    chain = {h for d in deltas for h in chain_of(parse_header(cold.read_object(d)).params)}
    assert chain and chain <= set(direct.objects)  # ...and lists every base they need
    for s in cold.list_steps("r"):  # the run that wrote the bases is gone from the tier
        cold.delete_manifest("r", s)
    assert sweep(cold, grace_seconds=0).deleted  # something was collected, no base
    ck = stepvault.open(hot).checkpoint("r", 3)
    expected = {k: ck.tensor(k) for k in ck.tensor_names()}
    loaded = {"state": {k: torch.zeros_like(v) for k, v in expected.items()}}
    assert sd.load_sharded(tmp_path / "cold", loaded, run="direct") == 1
    assert same(loaded["state"], expected)


def test_a_full_checkpoint_restored_under_a_group_refuses_a_state_it_does_not_fit(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 4),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()
    # A single-process checkpoint (the ordinary format), restored on 2 FSDP2 ranks into a
    # wrong shape, a live entry it lacks and a module key it lacks: refused every time,
    # through stepvault.restore and restore_full_checkpoint, live tensors unchanged; then
    # a state that fits is restored (every rank's shards equal the saved tensors).
    stepvault.save(
        tmp_path / "store", {"model": model, "optimizer": opt, "step": 3}, run="f", step=3
    )
    torch.save(model.state_dict(), tmp_path / "expected.pt")
    _spawn(2, "restore_mismatched_full", tmp_path / "store", tmp_path / "out")
