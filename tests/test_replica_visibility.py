"""Replication you can see (issue 33): every rank's mem-tier and replica events in the
run's event log with its real rank, ``mgr.wait(replicated=True)`` and the replica state in
``stats()``, buddy pairing for torchrun's ``LOCAL_RANK`` layout, a warning and an event
when there is no buddy, and the manager's process groups destroyed by ``close()``. Two
gloo ranks as two simulated nodes (``replication_workers.run``)."""

from __future__ import annotations

import json

from test_replication import _spawn

from stepvault.catalog.events import read_events
from stepvault.distributed.nodes import NodeLayout
from stepvault.store import Store

W = "replica_visibility_workers:"


def test_pairing_by_position_and_the_reason_for_no_buddy():
    """Nodes simulated on one machine keep the launcher's LOCAL_RANK (0 on n0, 1 on n1):
    they pair by position on their node, not by the LOCAL_RANK value."""
    assert NodeLayout.of(["n0", "n1"], [0, 1]).buddies() == {0: 1, 1: 0}
    torchrun = NodeLayout.of(["a", "a", "b", "b"], [1, 0, 0, 1])
    assert torchrun.buddies() == {1: 2, 0: 3, 2: 1, 3: 0}  # position = order by LOCAL_RANK
    solo = NodeLayout.of(["h", "h"], [0, 1])
    assert solo.buddies() == {}
    assert "same node 'h'" in solo.no_buddy_reason(0)
    uneven = NodeLayout.of(["a", "a", "b"])
    assert uneven.buddies() == {0: 2, 2: 0}
    assert "has only 1 rank" in uneven.no_buddy_reason(1)


def test_replicas_events_and_groups_are_visible_from_every_rank(tmp_path):
    mem, out = tmp_path / "mem", tmp_path / "out"
    _spawn(2, W + "visible", mem, out)
    docs = [json.loads((out / f"visible{r}.json").read_text()) for r in range(2)]
    for rank, doc in enumerate(docs):
        ranks = doc["stats"]["ranks"]
        assert [(r["rank"], r["buddy"], r["state"], r["step"]) for r in ranks] == [
            (0, 1, "replicated", 2),
            (1, 0, "replicated", 2),
        ], doc
        assert all(r["lag_seconds"] >= 0 for r in ranks)
        assert doc["stats"]["buddy"] == 1 - rank and doc["stats"]["pending"] == 0
        assert doc["warnings"] == []
        before, during, after_first, after = doc["groups"]
        assert during > before and after_first == before and after == before, doc["groups"]
    events = read_events(Store.open(out / "hot"), "r")
    replicas = [(e["rank"], e["source_rank"], e["step"]) for e in events if e["event"] == "replica"]
    # every receiving rank logs into the run's event log, tagged with its own rank
    assert {(0, 1, 2), (1, 0, 2)} <= set(replicas)
    over = [e for e in events if e["event"] == "mem_over_budget"]
    assert [(e["rank"], e["step"]) for e in over] == [(1, 4)]
    saves = {e["step"]: e for e in events if e["event"] == "save"}
    assert saves[2]["tier"] == "mem" and saves[3]["tier"] == "mem+hot"
    assert saves[4]["tier"] == "hot" and saves[4]["mem_missing_ranks"] == [1]


def test_no_buddy_warns_and_logs_the_reason(tmp_path):
    mem, out = tmp_path / "mem", tmp_path / "out"
    _spawn(2, W + "solo", mem, out)
    for rank in range(2):
        doc = json.loads((out / f"solo{rank}.json").read_text())
        assert len(doc["made"]) == 1 and "found no buddy" in doc["made"][0]
        assert "STEPVAULT_NODE" in doc["made"][0]
        assert "rank 0: no buddy" in doc["waited"][0] and "rank 1: no buddy" in doc["waited"][0]
        assert doc["stats"]["buddy"] is None and "same node" in doc["stats"]["no_buddy"]
        assert sorted(e["rank"] for e in doc["events"]) == [0, 1]
        assert all("same node 'solo'" in e["reason"] for e in doc["events"])
