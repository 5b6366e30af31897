"""Lightning's sharding strategies through StepvaultCheckpoint: 2 real CPU processes
(gloo) started by Lightning's own launcher, the model sharded by ``ModelParallelStrategy``
(FSDP2 ``fully_shard``) or ``FSDPStrategy`` (FSDP1, through a test-only CPU subclass in
the worker script). Every rank writes its own shards through the collective manager.

Each test trains the job to the end (the reference), then the same job is preempted
(SIGTERM to every process: one collective checkpoint, every rank exits 143), SIGKILLed
after a committed checkpoint (a lost node), its newest checkpoint damaged in one rank's
shard, and run again: every rank falls back to the checkpoint before, resumes across an
epoch boundary and ends bitwise equal to the reference (weights and AdamW moments). The
2-rank checkpoint is then restored in this single process (for evaluation or export).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

pytest.importorskip("lightning.pytorch")
pytest.importorskip("torchdata.stateful_dataloader")

import torch
from ddp_util import kill_job_when_saved, run_job
from helpers import final_digest
from integration_util import damage_newest

import stepvault

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]

SCRIPT = Path(__file__).parent / "scripts" / "lightning_sharded_train.py"


def _job(root: Path, strategy: str, *extra: str) -> list[str]:
    import sys

    return [
        sys.executable,
        str(SCRIPT),
        "--root",
        str(root),
        "--run",
        "sharded",
        "--strategy",
        strategy,
        "--max-steps",
        "12",
        "--save-every",
        "3",
        *extra,
    ]


def _line(out: str, tag: str) -> str:
    return next(line.split()[1] for line in out.splitlines() if line.startswith(tag))


# FSDPStrategy with a mesh runs with -m extended (CI's 30 minutes): CI keeps ModelParallel
@pytest.mark.parametrize(
    "strategy", ["model_parallel", pytest.param("fsdp", marks=pytest.mark.extended)]
)
def test_sharded_lightning_preempted_killed_damaged_and_resumed_is_bitwise(tmp_path, strategy):
    ref = run_job(_job(tmp_path / "ref", strategy))
    reference, reference_weights = final_digest(ref), _line(ref, "WEIGHTS")
    root = tmp_path / "b"
    cmd = [*_job(root, strategy), "--step-sleep", "0.15"]
    # A preemption notice to every process: OnSignal saves at the next step boundary (a
    # step the Every(3) policy would not save) and every rank exits 143.
    # (The FSDP1 job skips it: the same callback path, one job fewer.)
    first = 3
    if strategy == "model_parallel":
        steps, status = kill_job_when_saved(cmd, root, "sharded", min_step=1, sig=signal.SIGTERM)
        assert status == 143, status
        assert steps[-1] % 3 != 0 and steps[-1] < 6, steps
        first = steps[-1]
    # A lost node: SIGKILL once a later checkpoint is committed.
    steps, status = kill_job_when_saved(cmd, root, "sharded", min_step=first + 3)
    assert status == -signal.SIGKILL and steps[-1] < 12, (status, steps)
    # One rank's shard of the newest checkpoint is damaged: every rank falls back to the
    # one before (8 batches per rank and epoch: the resume crosses the epoch boundary).
    assert damage_newest(root, "sharded") == steps[-1]
    assert steps[-2] < 8
    out = run_job(cmd[:-2])
    assert f"RESUMED {steps[-2]}" in out
    assert final_digest(out) == reference
    assert stepvault.ops.verify(root, deep=True).ok  # the damaged one was quarantined
    manifest = stepvault.open(root).manifest("sharded", 12)
    assert manifest.metadata["lightning_strategy"] in ("ModelParallelStrategy", "CPUFSDPStrategy")

    # 2 ranks -> 1 process: the sharded checkpoint restores into a plain module.
    import importlib.util

    spec = importlib.util.spec_from_file_location("lightning_sharded_train", SCRIPT)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    plain = worker.Sharded()
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    info = stepvault.restore(root, {"model": plain}, run="sharded", strict=False)
    assert info is not None and info.step == 12
    assert worker.weights_digest(plain) == reference_weights
    assert any(not torch.equal(before[k], v) for k, v in plain.state_dict().items())

    # ... and exports as safetensors (consolidated from the shards) with the same weights.
    from safetensors.torch import load_file

    from stepvault.store import Store

    stepvault.ops.export_weights(Store.open(root), "sharded", 12, tmp_path / "w.safetensors")
    exported = load_file(tmp_path / "w.safetensors")
    assert exported.keys() == plain.state_dict().keys()
    assert all(torch.equal(exported[k], v) for k, v in plain.state_dict().items())


DS_SCRIPT = Path(__file__).parent / "scripts" / "lightning_deepspeed_train.py"


def _ds_job(*extra: str) -> list[str]:
    import sys

    return [sys.executable, str(DS_SCRIPT), "--max-steps", "12", "--save-every", "3", *extra]


@pytest.mark.extended
def test_lightning_deepspeed_preempted_killed_damaged_and_resumed_is_bitwise(tmp_path):
    """Lightning's DeepSpeedStrategy (ZeRO-2, 2 CPU processes through Lightning's own
    launcher; a test-only CPU subclass in the worker) with StepvaultCheckpoint: the engine's
    own save and load run through DeepSpeedCheckpointer. Reference: the same job with
    Lightning's own DeepSpeed checkpoints (a ModelCheckpoint every 3 steps). The stepvault
    job is preempted (SIGTERM to every process: one collective checkpoint at a step the
    policy would not save, exit 143), that newest checkpoint is damaged in one of its
    objects; the rerun falls back on every rank, crosses the epoch boundary and ends with
    the reference's fp32 weights and AdamW moments, bitwise. (Three Lightning launches:
    a SIGKILL after a commit is the plain DeepSpeed test's; the path is the same.)"""
    pytest.importorskip("deepspeed")
    ref = run_job(_ds_job("--native", str(tmp_path / "native")))
    reference = final_digest(ref)
    assert (tmp_path / "native" / "epoch=0-step=6.ckpt").is_dir()  # Lightning's own saves
    root = tmp_path / "store"
    cmd = _ds_job("--root", str(root), "--run", "ds", "--step-sleep", "0.15")
    steps, status = kill_job_when_saved(cmd, root, "ds", min_step=1, sig=signal.SIGTERM)
    assert status == 143, status
    assert steps[-1] % 3 != 0 and steps[-1] < 6 and len(steps) >= 2, steps
    # The newest checkpoint's new objects are partitions and Lightning's state: damage one;
    # every rank must fall back to the one before (8 batches per rank and epoch).
    assert damage_newest(root, "ds") == steps[-1]
    assert steps[-2] < 8
    out = run_job(cmd[:-2])
    assert f"RESUMED {steps[-2]}" in out
    assert final_digest(out) == reference
    assert stepvault.ops.verify(root, deep=True).ok  # the damaged one was quarantined
    manifest = stepvault.open(root).manifest("ds", 12)
    assert manifest.sharded
    assert manifest.metadata["lightning_strategy"] == "CPUDeepSpeedStrategy"


RESHARD_SCRIPT = Path(__file__).parent / "scripts" / "lightning_reshard_train.py"


@pytest.mark.extended
def test_lightning_model_parallel_checkpoint_of_2_ranks_resumes_on_4(tmp_path):
    """Resharding 2 -> 4: a ModelParallelStrategy (FSDP2) job of 2 processes saves at the
    end of its first epoch; the same job on 4 processes (Lightning's launcher, gloo) resumes
    from it through the collective restore planner, which reshards the DCP checkpoint. The
    state training starts from on 4 ranks (the gathered weights and AdamW state) equals
    the 2-rank job's final state bitwise; training continues on 4 ranks and its own
    checkpoint (4 ranks' shards) restores in one process with the job's final weights."""
    import math
    import sys

    root = tmp_path / "store"

    def job(devices: int, steps: int) -> str:
        cmd = [sys.executable, str(RESHARD_SCRIPT), "--root", str(root)]
        return run_job([*cmd, "--devices", str(devices), "--max-steps", str(steps)], timeout=420)

    two = job(2, 8)  # 8 batches per rank and epoch on 2 ranks: saves at 4 and 8
    assert "FRESH" in two
    four = job(4, 12)  # 4 batches per rank and epoch on 4 ranks: saves at 12
    assert "RESUMED 8" in four
    assert _line(four, "RESTORED") == final_digest(two)  # resharded, state equal
    assert final_digest(four) != final_digest(two)  # it trained on
    assert math.isfinite(float(_line(four, "LOSS")))
    vault = stepvault.open(root)
    assert vault.steps("reshard")[-1] == 12 and vault.manifest("reshard", 12).sharded

    # The 4-rank checkpoint restores in one process (evaluation, export).
    import importlib.util

    spec = importlib.util.spec_from_file_location("lightning_sharded_train", SCRIPT)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    plain = worker.Sharded()
    info = stepvault.restore(root, {"model": plain}, run="reshard", strict=False)
    assert info is not None and info.step == 12
    assert worker.weights_digest(plain) == _line(four, "WEIGHTS")


def _damage_rank1_shard(root: Path, run: str, step: int) -> str:
    """Flip one bit of a weight shard only rank 1 wrote in ``run@step`` (a shard at a
    nonzero offset whose object no older checkpoint names); the tensor's name."""
    from helpers import flip_byte, object_path

    from stepvault.format import parse_manifest
    from stepvault.store import Store

    vault = stepvault.open(root)
    older = {o for s in vault.steps(run) if s < step for o in vault.manifest(run, s).objects}
    m = parse_manifest(Store.open(root).read_manifest(run, step), f"{run}@{step}")
    for fqn, entry in m.sharded["entries"].items():
        if entry["type"] != "tensor" or not fqn.startswith("model."):
            continue
        for shard in entry["shards"]:
            chunk = shard["chunks"][0][0] if shard["chunks"] else None
            if any(shard["offsets"]) and chunk is not None and chunk not in older:
                flip_byte(object_path(root, chunk))
                return fqn
    raise AssertionError(f"no weight shard of rank 1 only in {run}@{step}")


@pytest.mark.extended
@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_lightning_fsdp1_without_device_mesh_killed_damaged_and_resumed_is_bitwise(
    tmp_path, sharding
):
    """Lightning's FSDPStrategy (FSDP1, FULL_SHARD or SHARD_GRAD_OP) as most users build it: no
    device_mesh (its state dicts would be ShardedTensors; the callback gives the wrapped
    model the 1-D world mesh, so they are DTensors). 2 CPU processes through Lightning's
    own launcher (the test-only CPU subclass in the worker). SIGKILL after a committed
    checkpoint; one bit of a weight shard only rank 1 wrote in the newest is flipped; the
    rerun in new processes falls back on both ranks to the checkpoint before, crosses the
    epoch boundary (8 steps) and ends bitwise equal to the uninterrupted job (weights and
    AdamW moments). The old code refused this strategy at setup."""
    mode = ("--no-mesh", "--sharding-strategy", sharding)
    ref = run_job(_job(tmp_path / "ref", "fsdp", *mode), timeout=420)
    reference, reference_weights = final_digest(ref), _line(ref, "WEIGHTS")
    root = tmp_path / "b"
    cmd = [*_job(root, "fsdp", *mode), "--step-sleep", "0.15"]
    steps, status = kill_job_when_saved(cmd, root, "sharded", min_step=6, timeout=420)
    assert status == -signal.SIGKILL and steps[-1] < 12, (status, steps)
    assert len(steps) >= 2 and steps[-2] < 8, steps
    manifest = stepvault.open(root).manifest("sharded", steps[-1])
    assert manifest.sharded and manifest.metadata["lightning_strategy"] == "CPUFSDPStrategy"
    _damage_rank1_shard(root, "sharded", steps[-1])
    out = run_job(cmd[:-2], timeout=420)
    assert f"RESUMED {steps[-2]}" in out
    assert final_digest(out) == reference
    assert _line(out, "WEIGHTS") == reference_weights
    assert stepvault.ops.verify(root, deep=True).ok  # the damaged one was quarantined
    from stepvault.catalog.events import read_events
    from stepvault.store import Store

    events = read_events(Store.open(root), "sharded")
    restores = [e for e in events if e["event"] == "restore" and e["step"] is not None]
    assert [e["step"] for e in restores] == [steps[-2]], restores
    assert [s["step"] for s in restores[0]["skipped"]] == [steps[-1]], restores
