"""The seams of issue 18 as behaviour: options checked at construction, one candidate
choice, a manifest parsed once per restore, reused chunks taken from the parent manifest."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import stepvault
from stepvault import CheckpointManager, KeepBest
from stepvault.catalog import CheckpointRecord, choose_candidates
from stepvault.format import manifest as manifest_format
from stepvault.manager.options import (
    GCOptions,
    LeaseOptions,
    ManagerOptions,
    MemOptions,
    StagingOptions,
)
from stepvault.store import Store


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(256, 256)
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "step": 0}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (lambda: {"codec": "zst"}, "codec must be one of"),
        (lambda: {"total_steps": True}, "total_steps"),
        (lambda: {"options": ManagerOptions(workers=0)}, "workers"),
        (lambda: {"options": {"workers": 2}}, "options must be a stepvault ManagerOptions"),
        (lambda: {"tiers": {"mem": MemOptions(budget="lots")}}, "mem budget"),
        (lambda: {"tiers": {"mem": 3}}, "tiers\\['mem'\\] must be"),
    ],
)
def test_bad_option_fails_at_construction_before_the_store_is_touched(tmp_path, kwargs, message):
    root = tmp_path / "store"
    with pytest.raises((ValueError, TypeError), match=message):
        CheckpointManager(root, "r", **kwargs())
    assert not root.exists()  # nothing created, no lease left behind


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: StagingOptions(if_busy="drop"), "if_busy must be"),
        (lambda: StagingOptions(memory="lots"), "staging memory"),
        (lambda: GCOptions(grace_seconds=-1), "grace_seconds"),
        (lambda: GCOptions(sweep_after_deletions=0), "sweep_after_deletions"),
        (lambda: LeaseOptions(stale_after=0), "stale_after"),
        (lambda: ManagerOptions(on_save_error="ignore"), "on_save_error must be"),
        (lambda: ManagerOptions(gc=0.5), "options.gc must be a stepvault GCOptions"),
        (lambda: MemOptions(path=3), "MemOptions.path"),
    ],
)
def test_each_nested_option_is_checked_when_it_is_made(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_choose_candidates_latest_best_and_exact():
    recs = [
        CheckpointRecord(1, 1.0, {"loss": 0.5}),
        CheckpointRecord(2, 2.0, {"loss": 0.3}, kind="weights"),
        CheckpointRecord(3, 3.0, valid=False, kind="?"),
        CheckpointRecord(4, 4.0, {"loss": 0.3}),
        CheckpointRecord(5, 5.0, {"loss": 0.9}),
    ]
    latest = choose_candidates(recs, "latest")
    assert latest.steps == [5, 4, 3, 1] and latest.fallback  # damaged kept: reported
    assert choose_candidates(recs, "latest", full_only=False).steps == [5, 4, 3, 2, 1]
    best = choose_candidates(recs, "best", best=("loss", "min"))
    assert best.steps == [4, 2, 1, 5]  # a tie goes to the newer checkpoint
    assert choose_candidates(recs, "best", best=("loss", "max")).steps == [5, 1, 4, 2]
    exact = choose_candidates(recs, 3)
    assert exact.steps == [3] and not exact.fallback
    with pytest.raises(ValueError, match="needs a metric"):
        choose_candidates(recs, "best")


def test_manager_best_step_and_restore_best_agree(tmp_path):
    state = _state()
    with CheckpointManager(tmp_path, "r", keep=KeepBest(5, metric="loss")) as mgr:
        for step, loss in [(1, 0.4), (2, 0.2), (3, 0.2), (4, 0.8)]:
            mgr.save(step, state, metrics={"loss": loss})
        mgr.wait()
        assert mgr.best_step == 3
        assert mgr.restore(_state(1), "best").step == 3


@pytest.fixture
def count_parses(monkeypatch):
    calls: list[int] = []
    real = manifest_format._from_json

    def counting(doc):
        calls.append(doc.get("step") if isinstance(doc, dict) else None)
        return real(doc)

    monkeypatch.setattr(manifest_format, "_from_json", counting)
    return calls


def test_a_restore_parses_the_manifest_it_restores_once(tmp_path, count_parses):
    state = _state()
    for step in (1, 2, 3):
        stepvault.save(tmp_path, state, run="r", step=step)
    count_parses.clear()
    assert stepvault.restore(tmp_path, _state(1), run="r").step == 3
    assert count_parses == [3]
    with CheckpointManager(tmp_path, "r", lineage=False) as mgr:
        count_parses.clear()
        assert mgr.restore(_state(1)).step == 3
        assert count_parses == [3]  # the listing came from the summary cache


def test_a_second_save_takes_reused_chunks_from_the_parent_manifest(tmp_path, monkeypatch):
    state = _state()
    stepvault.save(tmp_path, state, run="r", step=1)
    lookups: list[str] = []
    for name in ("object_size", "has_object"):
        real = getattr(Store, name)

        def spy(self, digest, _real=real, _name=name):
            lookups.append(_name)
            return _real(self, digest)

        monkeypatch.setattr(Store, name, spy)
    info = stepvault.save(tmp_path, state, run="r", step=2)
    assert info.new_bytes == 0 and info.objects > 0
    assert "object_size" not in lookups  # sizes and codecs come from the parent manifest
    assert lookups.count("has_object") <= info.objects  # only the post-write re-check
    with CheckpointManager(tmp_path, "r", lineage=False, async_save=False) as mgr:
        mgr.restore(state)
        lookups.clear()
        mgr.save(3, state)
        assert "object_size" not in lookups
    assert stepvault.ops.verify(tmp_path, deep=True).ok


#: A module may pass ``MAX_MODULE_LINES`` only when its docstring says why it is one unit,
#: in one of these forms (the ones src/stepvault already uses; see policy/keep.py and
#: format/encoding.py).
MAX_MODULE_LINES = 400
WHY_LONG = ("(Longer than most modules", "(At ~", "(Its length")


def test_a_module_over_400_lines_says_why_at_its_top():
    package = Path(stepvault.__file__).parent
    unexplained = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines <= MAX_MODULE_LINES:
            continue
        doc = ast.get_docstring(ast.parse(text, str(path)), clean=False) or ""
        if not any(phrase in doc for phrase in WHY_LONG):
            unexplained.append(f"{path.relative_to(package.parent)} ({lines} lines)")
    assert not unexplained, (
        f"modules over {MAX_MODULE_LINES} lines whose docstring does not say why: "
        f"{unexplained}. Split the module by what its parts do, or end its docstring with "
        f"one sentence starting with one of {WHY_LONG} that names the one reason it is one unit"
    )
