"""``CheckpointManager(..., tiers={"mem": True}, replicate=True)`` under a process group:
2 gloo ranks as 2 simulated nodes (part B's harness: ``replication_workers.run``), every
job ending with all ranks SIGKILLed."""

from __future__ import annotations

import json
import shutil

from test_replication import _spawn

import stepvault
from stepvault.catalog.events import read_events
from stepvault.store import Store

W = "manager_replication_workers:"


def test_manager_resumes_bitwise_from_own_and_buddy_memory(tmp_path):
    mem, out = tmp_path / "mem", tmp_path / "out"
    _spawn(2, W + "train", mem, out)
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
        replica = Store.open(peers / "peers" / source / "rank0")
        assert 5 in replica.list_steps(f"r+rank{0 if source == 'n0' else 1}")
        assert stepvault.verify(replica.backend.url, deep=True).ok

    shutil.rmtree(mem / "n1")  # node n1 was replaced: its memory is gone
    _spawn(2, W + "resume", mem, out, "5")
    info = [json.loads((out / f"info{r}.json").read_text()) for r in (0, 1)]
    assert info[0]["step"] == info[1]["step"] == 5  # newer than disk's 3: from memory
    assert info[0]["tier"] == "mem" and info[1]["tier"] == "peer"
    assert info[0]["event"] == {"step": 5, "tier": "mem", "rank_tiers": ["mem", "peer"]}
    # close(): step 6 (saved after the restore) is on disk, so the memory is removed
    assert hot.list_steps("r") == [3, 6]
    assert info[0]["mem_left"] == [] and info[1]["mem_left"] == []


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
