"""Model registry: versions, aliases, promote/rollback history, GC protection, events."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import cli, linear

import stepvault
from stepvault import CheckpointManager, KeepLast
from stepvault.errors import RegistryError
from stepvault.registry import Registry
from stepvault.store import Store


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "s"
    for step in (1, 2, 3):
        stepvault.save(root, {"model": linear(step), "step": step}, run="r", step=step)
    return root


def test_promote_and_rollback_follow_the_alias_history(root):
    reg = Registry(root)
    assert reg.promote("m", "r@1", "stable").version == 1
    assert reg.promote("m", "r@2", "stable").previous == 1
    reg.promote("m", "r@3", "stable")
    reg.promote("m", "r@3", "candidate")
    assert reg.aliases("m") == {"candidate": 3, "stable": 3}
    assert [v.ref for v in reg.versions("m")] == ["r@1", "r@2", "r@3"]  # r@3 registered once
    back = reg.rollback("m", "stable")
    assert (back.version, back.previous) == (2, 3)
    assert reg.resolve("m@stable").ref == "r@2"
    assert reg.rollback("m", "stable").version == 1
    with pytest.raises(RegistryError, match="it holds v1 and nothing held it before"):
        reg.rollback("m", "stable")
    assert reg.resolve("m@candidate").ref == "r@3"  # other aliases untouched
    assert reg.resolve("m@v2").ref == "r@2" and reg.resolve("m").version == 3
    history = reg.history("m", "stable")
    assert [(h.action, h.version) for h in history] == [
        ("promote", 1),
        ("promote", 2),
        ("promote", 3),
        ("rollback", 2),
        ("rollback", 1),
    ]
    assert all(h.user and h.host and h.time > 0 for h in history)
    reg.remove_alias("m", "candidate")
    assert "candidate" not in reg.aliases("m")
    assert all(e["status"] == "ok" for e in reg.check())


def test_bad_names_and_unknown_targets_are_refused_clearly(root):
    reg = Registry(root)
    with pytest.raises(RegistryError, match="ambiguous"):
        reg.promote("m", "r@1", "v2")
    with pytest.raises(stepvault.errors.InvalidNameError):
        reg.promote("../evil", "r@1", "stable")
    with pytest.raises(RegistryError, match="cannot register r@9"):
        reg.promote("m", "r@9", "stable")
    with pytest.raises(RegistryError, match="no model 'nope'"):
        reg.resolve("nope@stable")
    reg.promote("m", "r@1", "stable")
    with pytest.raises(RegistryError, match=r"no alias 'prod'.*stable=v1"):
        reg.resolve("m@prod")
    with pytest.raises(RegistryError, match="no version 7"):
        reg.promote("m", "v7", "stable")


def test_registered_checkpoints_survive_keep_policies_and_gc(tmp_path):
    root = tmp_path / "s"
    with CheckpointManager(root, "r", keep=KeepLast(1), async_save=False) as mgr:
        state = {"model": linear(0), "step": 0}
        mgr.save(1, state)
        Registry(mgr.store).promote("m", "r@1", "stable")
        for step in (2, 3, 4):
            state["model"] = linear(step)  # new weights: the old objects become garbage
            mgr.save(step, state)
        plan = mgr.retention_plan()
    store = Store.open(root)
    assert store.list_steps("r") == [1, 4]
    # The manager's plan says who keeps it: the registry, not a pin (it said "pinned").
    assert {e.step: e.reasons for e in plan.entries}[1] == ["held by the registry (model m v1)"]
    result = stepvault.ops.collect_garbage(store, run="r", keep=KeepLast(1), grace_seconds=0)
    assert result.plan.delete == [] and result.sweep.deleted  # garbage did go
    assert stepvault.ops.verify(root, "r", 1, deep=True).ok  # its objects were not swept
    restored = {"model": linear(9), "step": None}
    stepvault.restore(root, restored, run="r", step=1)
    assert torch.equal(restored["model"].weight, linear(0).weight)


def test_registry_events_and_cli(root, tmp_path):
    out = tmp_path / "export"
    res = cli(root, "register", "m", "r@2", "--export", str(out), "--dtype", "bfloat16")
    assert res.exit_code == 0, res.output
    assert "m v1 = r@2" in res.output
    res = cli(root, "promote", "m", "v1", "--alias", "stable", "--note", "passed eval")
    assert res.exit_code == 0 and "m@stable -> v1" in res.output, res.output
    assert cli(root, "promote", "m", "r@3", "-a", "stable").exit_code == 0
    res = cli(root, "rollback", "m", "--alias", "stable")
    assert res.exit_code == 0 and "-> v1 (was v2)" in res.output, res.output
    res = cli(root, "rollback", "m", "--alias", "stable")
    assert res.exit_code == 2 and "cannot roll back" in res.output
    data = json.loads(cli(root, "models", "m", "--history", "--json").output)[0]
    assert data["aliases"] == {"stable": 1}
    v1 = data["versions"][0]
    assert v1["export"]["options"] == {"dtype": "bfloat16"}
    assert len(v1["export"]["files"][0]["blake3"]) == 64
    assert [m["action"] for m in data["history"]] == ["promote", "promote", "rollback"]
    assert data["history"][0]["note"] == "passed eval"
    table = cli(root, "models", "--history")
    assert table.exit_code == 0 and "rollback" in table.output and "r@3" in table.output
    events = [e["event"] for e in stepvault.open(root).store and _events(root)]
    assert {"register", "export", "promote", "rollback"} <= set(events)


def _events(root):
    from stepvault.catalog.events import read_events

    return read_events(Store.open(root), "r")


def test_concurrent_promotions_keep_a_consistent_history(root):
    import threading

    regs = [Registry(root) for _ in range(4)]
    errors = []

    def work(i):
        try:
            for step in (1, 2, 3):
                regs[i].promote("m", f"r@{step}", f"a{i % 2}")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    reg = Registry(root)
    assert len(reg.history("m")) == 12
    assert [m.seq for m in reg.history("m")] == list(range(1, 13))
    assert all(e["status"] == "ok" for e in reg.check())  # an unbroken hash chain
    held = Store.open(root).held_steps("r")
    versions = reg.versions("m")
    assert {v.step for v in versions} == {1, 2, 3}
    for v in versions:  # every version holds its own checkpoint, no stray holds
        assert f"m.v{v.version}" in held[v.step]
    assert sum(len(h) for h in held.values()) == len(versions)
