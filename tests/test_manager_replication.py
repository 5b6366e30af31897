"""``CheckpointManager(..., tiers={"mem": MemOptions(replicate=True)})`` under a group:
2 gloo ranks as 2 simulated nodes (part B's harness: ``replication_workers.run``), every
job ending with all ranks SIGKILLed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_replication import _spawn
from typer.testing import CliRunner

import stepvault
from stepvault.catalog.events import read_events
from stepvault.cli.main import app
from stepvault.store import Store
from stepvault.store.lease import lease_key
from stepvault.tiers.mem import list_mem_tiers, reclaim_stale

W = "manager_replication_workers:"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_manager_resumes_bitwise_from_own_and_buddy_memory(tmp_path, world):
    """Nodes n0 and n1 (``world // 2`` ranks each): train, SIGKILL every rank, wipe n1's
    memory; the restart restores step 4 by number and then the latest (5) from memory,
    n1's ranks from n0's replicas."""
    mem, out = tmp_path / "mem", tmp_path / "out"
    per_node = world // 2
    _spawn(world, W + "train", mem, out)
    hot = Store.open(out / "hot")
    assert hot.list_steps("r") == [3]  # disk every 3rd save: 4 and 5 only in memory
    saves = [e for e in read_events(hot, "r") if e["event"] == "save"]
    assert [(e["step"], e["tier"]) for e in saves] == [
        (1, "mem"),
        (2, "mem"),
        (3, "mem+hot"),
        (4, "mem"),
        (5, "mem"),
    ]
    for holder, source in [("n1", "n0"), ("n0", "n1")]:  # each node holds the other's
        peers = next((mem / holder).glob("*-r+peers"))
        for local in range(per_node):
            rank = local + (0 if source == "n0" else per_node)
            replica = Store.open(peers / "peers" / source / f"rank{local}")
            assert 5 in replica.list_steps(f"r+rank{rank}")
            assert stepvault.ops.verify(replica.backend.url, deep=True).ok
    _assert_listed_and_kept(mem, hot, world)

    shutil.rmtree(mem / "n1")  # node n1 was replaced: its memory is gone
    _spawn(world, W + "resume", mem, out, "5")
    info = [json.loads((out / f"info{r}.json").read_text()) for r in range(world)]
    tiers = ["mem"] * per_node + ["peer"] * per_node
    assert [i["step"] for i in info] == [5] * world  # newer than disk's 3: from memory
    assert [i["tier"] for i in info] == tiers
    assert [i["step4_tier"] for i in info] == tiers  # restore(step=4): memory, not disk
    assert info[0]["event"] == {"step": 5, "tier": "mem", "rank_tiers": tiers}
    # close(): step 6 (saved after the restore) is on disk, so the memory is removed
    assert hot.list_steps("r") == [3, 6]
    assert all(i["mem_left"] == [] for i in info)


def _names(tiers) -> set[str]:
    return {Path(t.path).name.split("-", 1)[1] for t in tiers}  # "<key>-r+rank0" -> "r+rank0"


def _assert_listed_and_kept(mem: Path, hot: Store, world: int) -> None:
    """After the SIGKILL every rank's own tier and each node's replicas are listed with
    their steps and kept (they hold steps 4 and 5, which are not on disk); were the run
    finished (no writer lease), they would be stale, and ``tiers ls`` says so."""
    per_node = world // 2
    for node, first in [("n0", 0), ("n1", per_node)]:
        ours = {f"r+rank{r}" for r in range(first, first + per_node)} | {"r+peers"}
        found = {n: t for t in list_mem_tiers(str(mem / node)) for n in _names([t])}
        assert ours <= set(found), (node, sorted(found))
        for name in ours:
            assert found[name].steps == [1, 2, 3, 4, 5], (node, name)
            assert not found[name].stale and "not on disk" in found[name].reason
        assert not ours & _names(reclaim_stale(str(mem / node), dry_run=True))
    lease = Path(hot.backend.root) / lease_key("r")
    saved = lease.read_bytes()
    lease.unlink()  # as if the run had finished
    try:
        ours = {f"r+rank{r}" for r in range(per_node)} | {"r+peers"}
        assert ours <= _names(reclaim_stale(str(mem / "n0"), dry_run=True))
        args = ["--root", str(hot.backend.root), "tiers", "ls", "--json"]
        shown = CliRunner().invoke(app, [*args, "--mem-root", str(mem / "n1")])
        assert shown.exit_code == 0, shown.output
        rows = {Path(r["path"]).name.split("-", 1)[1]: r for r in json.loads(shown.output)["mem"]}
        assert rows["r+peers"]["checkpoints"] == 5 and rows["r+peers"]["stale"]
        assert rows[f"r+rank{per_node}"]["stale"]
    finally:
        lease.write_bytes(saved)  # the crashed run's lease: the restart takes it over


def test_close_keeps_the_only_copy_and_memory_older_than_disk_is_not_restored(tmp_path):
    """Five managers in turn in one 2-rank job (the fourth after both nodes' memory is
    gone, the fifth with a memory budget too small on rank 0)."""
    mem, out = tmp_path / "mem", tmp_path / "out"
    _spawn(2, W + "reopen", mem, out)  # the assertions run on every rank
    events = read_events(Store.open(out / "hot"), "r")
    assert [e["event"] for e in events].count("mem_kept") == 1  # the first close only
    restores = [(e["step"], e["tier"]) for e in events if e["event"] == "restore"]
    assert restores == [(5, "mem"), (6, "hot"), (6, "hot")]
    over = [e for e in events if e["event"] == "mem_over_budget"]
    assert [e["step"] for e in over] == [7]


def test_fsdp2_shards_resume_bitwise_from_own_and_buddy_memory(tmp_path):
    """Sharded (FSDP2) state goes into node memory as each rank's local shards and is
    replicated; after a SIGKILL and a wiped node, both ranks restore step 5 (only in
    memory) bitwise into a fresh model and optimizer, rank 1 from its buddy."""
    mem, out = tmp_path / "mem", tmp_path / "out"
    _spawn(2, W + "fsdp_train", mem, out)
    hot = Store.open(out / "hot")
    assert hot.list_steps("r") == [3]  # 4 and 5 are in memory only
    saves = [(e["step"], e["tier"]) for e in read_events(hot, "r") if e["event"] == "save"]
    assert saves == [(1, "mem"), (2, "mem"), (3, "mem+hot"), (4, "mem"), (5, "mem")]
    shutil.rmtree(mem / "n1")  # node n1 was replaced
    _spawn(2, W + "fsdp_resume", mem, out)
    info = [json.loads((out / f"fsdp{r}.json").read_text()) for r in range(2)]
    assert info == [{"step": 5, "tier": "mem"}, {"step": 5, "tier": "peer"}]
