"""Multi-rank save/load on real gloo process groups (CPU): sharding, resharding, failures."""

from __future__ import annotations

import json
from pathlib import Path

import dist_workers
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from helpers import free_port, spawn_ranks

import stepvault
import stepvault.distributed as sd


def _spawn(world: int, task: str, root: Path, out: Path) -> None:
    """``dist_workers``' ``task`` on ``world`` gloo ranks (helpers.spawn_ranks)."""
    spawn_ranks(dist_workers.run, world, task, root, out)


def _plain_state(zeros: bool = True) -> dict:
    full = dist_workers.full_tensors()
    return {
        "model": {k: torch.zeros_like(v) if zeros else v for k, v in full.items()},
        "extra": {"step": 0, "betas": (0.0, 0.0)},
    }


@pytest.fixture(scope="module")
def saved_on_4(tmp_path_factory):
    root = tmp_path_factory.mktemp("store4")
    _spawn(4, "save", root, tmp_path_factory.mktemp("out"))
    return root


def test_saved_on_4_is_one_committed_json_manifest(saved_on_4):
    vault = stepvault.open(saved_on_4)
    assert vault.steps("r") == [1]
    m = vault.manifest("r", 1)
    assert m.metrics == {"loss": 0.5} and m.environment["world_size"] == 4
    entries = m.sharded["entries"]
    assert len(entries["model.w"]["shards"]) == 4  # Shard(0) on 4 ranks
    assert len(entries["model.b"]["shards"]) == 1  # replicated: written once
    assert entries["extra.step"] == {"type": "value", "value": 7}
    raw = (saved_on_4 / "runs" / "r" / "checkpoints" / "1.json").read_bytes()
    json.loads(raw.split(b"\n", 1)[1])  # plain JSON, no pickle
    assert stepvault.ops.verify(saved_on_4, deep=True).ok


def test_load_on_2_ranks_reshards(saved_on_4, tmp_path):
    _spawn(2, "load", saved_on_4, tmp_path)
    assert (tmp_path / "step0.txt").read_text() == "1"


def test_load_in_one_process_without_a_group(saved_on_4):
    state = _plain_state()
    assert sd.load_sharded(saved_on_4, state, run="r") == 1
    full = dist_workers.full_tensors()
    for k, v in full.items():
        assert torch.equal(state["model"][k], v)
    assert state["extra"] == {"step": 7, "betas": (0.9, 0.99)}


def test_full_state_dict_from_a_sharded_checkpoint(saved_on_4):
    """stepvault.open reads a sharded checkpoint as a full state dict (export, lazy reads)."""
    ckpt = stepvault.open(saved_on_4).checkpoint("r@1")
    full = dist_workers.full_tensors()
    assert torch.equal(ckpt.tensor("model.w"), full["w"])
    loaded = ckpt.load()
    assert torch.equal(loaded["model"]["emb"], full["emb"])
    assert loaded["extra"] == {"step": 7, "betas": (0.9, 0.99)}


@pytest.mark.slow
def test_saved_on_1_loads_on_4(tmp_path):
    root = tmp_path / "store1"
    sd.save_sharded(
        root,
        _plain_state(zeros=False) | {"extra": {"step": 7, "betas": (0.9, 0.99)}},
        run="r",
        step=1,
    )
    _spawn(4, "load", root, tmp_path / "out")


def test_a_failing_rank_commits_nothing(tmp_path):
    _spawn(2, "save_fail_on_rank1", tmp_path / "store", tmp_path / "out")
    assert stepvault.open(tmp_path / "store").steps("r") == [1]
    for rank in (0, 1):
        assert "rank 1 lost its disk" in (tmp_path / "out" / f"err{rank}.txt").read_text()
    assert stepvault.ops.verify(tmp_path / "store", deep=True).ok


def test_dcp_never_unpickles_our_values(saved_on_4, monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("torch.load used")

    monkeypatch.setattr(torch, "load", forbidden)
    state = _plain_state()
    sd.load_sharded(saved_on_4, state, run="r")
    assert state["extra"]["betas"] == (0.9, 0.99)
    assert dcp is not None


def test_all_ranks_fall_back_together_past_damage(tmp_path):
    root = tmp_path / "store"
    good = _plain_state(zeros=False) | {"extra": {"step": 7, "betas": (0.9, 0.99)}}
    sd.save_sharded(root, good, run="r", step=1)
    newer = {"model": {k: v + 1 for k, v in good["model"].items()}, "extra": good["extra"]}
    sd.save_sharded(root, newer, run="r", step=2)
    m1 = set(stepvault.open(root).manifest("r", 1).objects)
    m2 = stepvault.open(root).manifest("r", 2)
    victim = sorted(set(m2.objects) - m1)[0]
    path = root / "objects" / victim[:2] / victim
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))
    _spawn(2, "load_fallback", root, tmp_path / "out")
    assert {(tmp_path / "out" / f"step{r}.txt").read_text() for r in (0, 1)} == {"1"}


def _pt(path):  # test-local reference files written by torch.save in the workers
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def fsdp_on_2(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    out = tmp_path_factory.mktemp("fsdp-out")
    _spawn(2, "fsdp_save", root, out)
    return root, out


def test_fsdp2_resume_on_same_world_size_is_bitwise(fsdp_on_2, tmp_path):
    root, ref = fsdp_on_2
    _spawn(2, "fsdp_restore", root, tmp_path)
    saved, restored = _pt(ref / "saved.pt"), _pt(tmp_path / "restored.pt")
    assert saved.keys() == restored.keys()
    assert all(torch.equal(saved[k], restored[k]) for k in saved)
    continued, resumed = _pt(ref / "continued.pt"), _pt(tmp_path / "resumed.pt")
    assert all(torch.equal(continued[k], resumed[k]) for k in continued)


@pytest.mark.parametrize("world", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_fsdp2_checkpoint_reshards_to_other_world_sizes(fsdp_on_2, tmp_path, world):
    root, ref = fsdp_on_2
    _spawn(world, "fsdp_restore", root, tmp_path)
    saved, restored = _pt(ref / "saved.pt"), _pt(tmp_path / "restored.pt")
    assert all(torch.equal(saved[k], restored[k]) for k in saved)


def test_rank0_only_save_of_sharded_state_is_refused(tmp_path):
    _spawn(2, "rank0_only_sharded_save", tmp_path / "store", tmp_path)
    assert "only that rank's shards" in (tmp_path / "err.txt").read_text()
    assert not (tmp_path / "store" / "runs").exists()


def test_manager_with_ddp_on_every_rank(tmp_path):
    _spawn(2, "manager_ddp", tmp_path / "store", tmp_path)
    from stepvault.catalog.events import read_events

    log = read_events(stepvault.open(tmp_path / "store").store, "ddp")
    events = [e["event"] for e in log]
    assert events.count("save") == 3 and events.count("delete") == 1  # logged once, by rank 0
    saves = [e for e in log if e["event"] == "save"]
    assert all(e["asynchronous"] and e["world_size"] == 2 for e in saves)  # DCP async_save
    assert all(e["kind"] == "full" for e in saves) and events.count("light_as_full") == 3
    assert all(e["stall_seconds"] < e["write_seconds"] for e in saves)
    assert stepvault.ops.verify(tmp_path / "store", deep=True).ok
    # and a single process can read the DDP checkpoint as a full state dict
    full = stepvault.open(tmp_path / "store").checkpoint("ddp").load()
    assert full["model"]["weight"].shape == (4, 8)


def test_a_collective_save_before_the_first_step_leaves_the_optimizer_untouched(tmp_path):
    _spawn(2, "manager_step0_save", tmp_path / "store", tmp_path)


def test_import_dcp_directory_needs_trust(tmp_path):
    from typer.testing import CliRunner

    from stepvault.cli.main import app

    src = tmp_path / "dcp"
    state = {"model": dist_workers.full_tensors(), "meta": {"epoch": 3, "tags": ["a", "b"]}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(src)))
    runner = CliRunner()
    base = [
        "--root",
        str(tmp_path / "store"),
        "import-dcp",
        str(src),
        "--run",
        "imp",
        "--step",
        "5",
    ]
    refused = runner.invoke(app, base)
    assert refused.exit_code == 2 and "pickle" in refused.output and "--trust" in refused.output
    assert not (tmp_path / "store").exists()
    ok = runner.invoke(app, [*base, "--trust"])
    assert ok.exit_code == 0, ok.output
    loaded = stepvault.open(tmp_path / "store").checkpoint("imp@5").load()
    for k, v in state["model"].items():
        assert torch.equal(loaded["model"][k], v)
    assert loaded["meta"] == {"epoch": 3, "tags": ["a", "b"]}


@pytest.mark.parametrize("collective", [None, pytest.param(True, marks=pytest.mark.slow)])
def test_single_process_save_resumes_on_4_fsdp_ranks(tmp_path, collective):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 4),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {
        "model": model,
        "optimizer": opt,
        "scheduler": torch.optim.lr_scheduler.StepLR(opt, 2),
        "rng": stepvault.RNGState(),
        "step": 0,
    }
    dist_workers._train(state, 3)
    # collective=None: the ordinary single-process format; True: the multi-rank format
    stepvault.save(tmp_path / "store", state, run="f", step=3, collective=collective)
    _spawn(4, "fsdp_restore", tmp_path / "store", tmp_path)
    restored = _pt(tmp_path / "restored.pt")
    for k, v in model.state_dict().items():
        assert torch.equal(restored[f"model.{k}"], v), k
    for name, param in model.named_parameters():  # optimizer state follows each parameter
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(restored[f"opt.{name}.{k}"], opt.state[param][k]), (name, k)


def test_a_killed_rank_commits_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(mp.ProcessExitedException):
        mp.start_processes(
            dist_workers.run,
            args=(2, free_port(), "rank1_killed_mid_save", str(tmp_path / "store"), str(out)),
            nprocs=2,
            join=True,
            start_method="spawn",
        )
    assert stepvault.open(tmp_path / "store").steps("r") == [1]
    assert stepvault.ops.verify(tmp_path / "store", deep=True).ok


def test_export_from_a_multi_rank_checkpoint(fsdp_on_2, tmp_path):
    from safetensors.torch import load_file

    root, ref = fsdp_on_2
    out = tmp_path / "w.safetensors"
    stepvault.ops.export_weights(stepvault.open(root).store, "f", 3, out)
    weights = load_file(out)
    saved = _pt(ref / "saved.pt")
    assert set(weights) == {k[len("model.") :] for k in saved if k.startswith("model.")}
    assert all(torch.equal(weights[k], saved[f"model.{k}"]) for k in weights)


def test_multi_rank_restore_unpickles_nothing_from_the_store(fsdp_on_2, tmp_path):
    """No pickle, multi-rank. DCP's collectives exchange *planning* objects between the ranks
    of one job in memory (pickled by torch.distributed's object collectives); those are
    recorded by an audit hook on every rank and must be DCP plan/metadata classes only.
    Nothing read from the store is ever unpickled: a single process reading the same
    checkpoint resolves no class at all, and the stored files contain no pickle opcodes."""
    root, _ = fsdp_on_2
    _spawn(2, "fsdp_restore_audited", root, tmp_path)
    allowed_modules = ("torch.distributed.checkpoint.", "torch.distributed.tensor.")
    allowed = {("torch", "Size"), ("collections", "OrderedDict"), ("builtins", "slice")}
    for rank in range(2):
        seen = {tuple(x) for x in json.loads((tmp_path / f"unpickled{rank}.json").read_text())}
        assert seen, "the hook saw nothing: DCP's planning collectives should show up"
        stray = {
            (m, n) for m, n in seen if not m.startswith(allowed_modules) and (m, n) not in allowed
        }
        assert not stray, f"rank {rank} unpickled unexpected classes: {sorted(stray)}"
        assert not any(m.startswith("stepvault") for m, _ in seen)

    import sys

    recorded: list = []
    on = [True]
    sys.addaudithook(lambda e, a: recorded.append(a) if on[0] and e == "pickle.find_class" else 0)
    try:
        full = stepvault.open(root).checkpoint("f").load()
    finally:
        on[0] = False
    assert full["step"] == 3 and not recorded
    for path in Path(root).rglob("*"):  # pickle protocol 2+ streams start with 0x80 <proto>
        if path.is_file():
            head = path.read_bytes()[:2]
            assert not (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"))


def test_async_manager_saves_fsdp2_state_while_training_continues(tmp_path):
    _spawn(2, "manager_fsdp_async", tmp_path / "store", tmp_path)
    for step in (2, 4, 6):
        at, restored = _pt(tmp_path / f"at{step}.pt"), _pt(tmp_path / f"restored{step}.pt")
        assert at.keys() == restored.keys()
        assert all(torch.equal(at[k], restored[k]) for k in at), step
    assert not torch.equal(
        _pt(tmp_path / "at2.pt")["model.0.weight"], _pt(tmp_path / "at6.pt")["model.0.weight"]
    )
    assert stepvault.ops.verify(tmp_path / "store", deep=True).ok


def test_async_manager_failure_on_one_rank_surfaces_everywhere(tmp_path):
    _spawn(2, "manager_async_fails_on_rank1", tmp_path / "store", tmp_path)
    for rank in (0, 1):
        assert "rank 1 lost its disk" in (tmp_path / f"err{rank}.txt").read_text()
    assert stepvault.open(tmp_path / "store").steps("ff") == [1, 4]
    assert stepvault.ops.verify(tmp_path / "store", deep=True).ok


def test_rank_local_manager_saves_from_rank_0_only(tmp_path):
    _spawn(2, "manager_rank0_only", tmp_path / "store", tmp_path)
    assert stepvault.open(tmp_path / "store").steps("r0") == [1, 2, 3]
    assert "bad" not in stepvault.open(tmp_path / "store").runs()


def test_sharded_checkpoint_restores_from_a_cold_tier(tmp_path):
    _spawn(2, "fsdp_tiered", tmp_path / "hot", tmp_path)
    from stepvault.store import Store

    hot, cold = Store.open(tmp_path / "hot"), stepvault.open(tmp_path / "cold")
    assert hot.list_steps("t") == [3] and cold.steps("t") == [1, 2, 3]  # 1, 2: only cold
    assert cold.manifest("t", 2).sharded  # a multi-rank checkpoint, moved by rank 0's mover
    saved, restored = _pt(tmp_path / "saved2.pt"), _pt(tmp_path / "restored2.pt")
    assert saved.keys() == restored.keys()
    assert all(torch.equal(saved[k], restored[k]) for k in saved)
    assert stepvault.ops.verify(tmp_path / "cold", deep=True).ok


def test_async_saver_survives_a_torch_that_closes_its_stager(tmp_path, monkeypatch):
    """With torch 2.11 the stager passed to async_save came back closed after the upload
    (seen on a GPU machine: the second collective async save failed with KeyError: <class
    'type'>). Simulated on the installed torch: every save after the first must work."""
    from stepvault.core.write import open_store_for_writing
    from stepvault.distributed.api import AsyncSaver

    real = dcp.async_save

    def closing(*args, **kwargs):
        future = real(*args, **kwargs)
        future.result()
        # torch 2.11 left the stager closed after an upload: both levels are tried here
        kwargs["async_stager"]._state_dict_stager.close()
        kwargs["async_stager"].close()
        return future

    monkeypatch.setattr(dcp, "async_save", closing)
    store = open_store_for_writing(tmp_path)
    saver = AsyncSaver()
    model = torch.nn.Linear(4, 4)
    expected = {}
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.add_(1)
        expected[step] = model.weight.detach().clone()
        saver.save(store, {"model": model}, run="r", step=step).result()
    assert saver._stager.ignored_closes == 6
    saver.close()
    for step, weight in expected.items():
        fresh = torch.nn.Linear(4, 4)
        stepvault.restore(tmp_path, {"model": fresh}, run="r", step=step)
        assert torch.equal(fresh.weight, weight)


def test_each_rank_resumes_its_own_data_loader_and_values_are_rank_0s(tmp_path):
    """A collective save kept one copy of everything every rank holds, from the rank with
    the least planned bytes (rank 1 in practice): each rank's ResumableLoader (its own
    shuffle generator) resumed rank 1's position, silently, and a value that differs per
    rank came back as rank 1's, where the rule is rank 0's. A rank's loader is now kept per
    rank, like its RNGs."""
    root, out = tmp_path / "s", tmp_path / "out"
    _spawn(2, "per_rank_loaders", root, out)
    for rank in (0, 1):
        doc = json.loads((out / f"loader{rank}.json").read_text())
        assert doc["got"] == doc["expected"], (rank, doc)
        assert doc["who"] == 0
    one = json.loads((out / "loader0.json").read_text())["seen"]
    two = json.loads((out / "loader1.json").read_text())["seen"]
    assert one != two  # the ranks did read different batches
    entries = stepvault.open(root).manifest("r", 3).sharded["entries"]
    assert any(k.startswith("loader.rank1.") for k in entries), sorted(entries)
    loaded = stepvault.open(root).checkpoint("r", 3).load()  # no internal key shows
    assert sorted(loaded) == ["loader", "model", "who"] and loaded["who"] == 0
    # One process (no group) takes rank 0's position, as a smaller job's rank 0 would.
    from torch.utils.data import DataLoader

    g = torch.Generator().manual_seed(50)
    fresh = {
        "model": torch.nn.Linear(2, 2),
        "loader": stepvault.ResumableLoader(
            DataLoader(list(range(16)), batch_size=2, shuffle=True, generator=g)
        ),
        "who": -1,
    }
    assert stepvault.restore(root, fresh, run="r").step == 3
    got = [b.tolist() for _, b in zip(range(2), iter(fresh["loader"]))]
    assert got == json.loads((out / "loader0.json").read_text())["expected"]


def test_a_rank_local_manager_on_every_rank_is_told_how_to_make_it(tmp_path):
    root, out = tmp_path / "s", tmp_path / "out"
    _spawn(2, "rank_local_on_every_rank", root, out)
    assert (out / "lease0.txt").read_text() == "got the lease"
    said = (out / "lease1.txt").read_text()
    assert "being written by" in said and "on one rank only (rank 0" in said, said
    assert "collective=True" in said
