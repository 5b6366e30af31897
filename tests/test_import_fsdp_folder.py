"""The FSDP folder import's refusals and its one-process restore, on a folder written the
way Accelerate's FSDP ``save_state`` writes it (the same torch calls: DCP saves of
``get_model_state_dict``/``get_optimizer_state_dict`` under ``model``/``optimizer``, and
``torch.save`` of the scheduler and of each rank's RNG dict), in one process. The real
2-rank folder, its import and both ranks' resume are in tests/test_sharded_accelerate.py.
"""

from __future__ import annotations

import random
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import cli
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import stepvault
import stepvault.ops.migrate
from stepvault.errors import StepvaultError, UntrustedInputError
from stepvault.ops.migrate import import_dcp


def _rng_dict(step: int) -> dict:
    """The keys accelerate.checkpointing.save_accelerator_state writes (CPU)."""
    return {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }


def _accelerate_folder(out: Path, ranks: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group says so
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=out / "pytorch_model_fsdp_0")
        dcp.save(
            {"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=out / "optimizer_0"
        )
    torch.save(sched.state_dict(), out / "scheduler.bin")
    for r in range(ranks):
        torch.manual_seed(100 + r)
        torch.save(_rng_dict(7), out / f"random_states_{r}.pkl")
    return model, opt


def test_accelerate_fsdp_folder_imports_as_one_checkpoint_and_restores(tmp_path):
    model, opt = _accelerate_folder(tmp_path / "acc")
    info = import_dcp(tmp_path / "store", tmp_path / "acc", run="acc", step=3, trust=True)
    assert info.step == 3
    ckpt = stepvault.open(tmp_path / "store").checkpoint("acc", 3)
    kinds = ckpt.manifest.state_kinds
    assert kinds["model"] == "module" and kinds["optimizer"] == "optimizer", kinds
    assert ckpt.manifest.metadata["format"] == "accelerate"

    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    rng = stepvault.RNGState()
    state = {"model": fresh, "optimizer": fresh_opt, "scheduler": sched, "rng": rng}
    stepvault.restore(tmp_path / "store", state, run="acc", step=3, strict=False)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key])
    assert (
        sched.get_last_lr() == [0.01 * 0.5**3] and fresh_opt.param_groups[0]["lr"] == 0.01 * 0.5**3
    )
    torch.manual_seed(100)  # one process takes rank 0's RNG: the state random_states_0 holds
    want = torch.rand(3)
    stepvault.restore(tmp_path / "store", {"rng": stepvault.RNGState()}, run="acc", step=3,
                      strict=False)  # fmt: skip
    assert torch.equal(torch.rand(3), want)


def test_accelerate_fsdp_folder_refusals(tmp_path):
    _accelerate_folder(tmp_path / "acc")
    with pytest.raises(UntrustedInputError, match="trust"):
        import_dcp(tmp_path / "store", tmp_path / "acc", run="acc", step=3)
    (tmp_path / "acc" / "random_states_0.pkl").unlink()  # a partial save
    with pytest.raises(StepvaultError, match=r"ranks \[1\].*missing"):
        import_dcp(tmp_path / "store", tmp_path / "acc", run="acc", step=3, trust=True)
    # the CLI needs the step (the folder records none) and says so
    cli = [sys.executable, "-m", "stepvault.cli.main", "--root", str(tmp_path / "store")]
    done = subprocess.run(
        [*cli, "import", str(tmp_path / "acc"), "--run", "acc", "--trust"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0 and "--step" in done.stdout + done.stderr


#: One rank of an Accelerate FSDP1 ``SHARDED_STATE_DICT`` job saved with ``use_dcp=False``:
#: the torch calls of ``accelerate.utils.save_fsdp_model``/``save_fsdp_optimizer`` (accelerate
#: 1.16 ``utils/fsdp_utils.py``): under ``FSDP.state_dict_type(SHARDED_STATE_DICT)``,
#: ``torch.save`` of ``model.state_dict()`` and of ``FSDP.optim_state_dict`` per rank.
PER_RANK_JOB = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
out = sys.argv[1]
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
torch.manual_seed(0)
model = FSDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)),
             device_id=torch.device("cpu"), use_orig_params=True)
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
model(torch.randn(3, 4)).sum().backward()
opt.step()
with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
    torch.save(model.state_dict(), os.path.join(out, "pytorch_model_fsdp_0_rank0.bin"))
    torch.save(FSDP.optim_state_dict(model, opt), os.path.join(out, "optimizer_0_rank0.bin"))
dist.destroy_process_group()
"""


def test_accelerate_per_rank_fsdp_folder_is_refused_naming_the_layout_and_the_way_out(tmp_path):
    """Accelerate's ``use_dcp=False`` layout (one pickle of ShardedTensors per rank, which
    only the job's process group can even unpickle) is refused by name, before any
    question of step or trust, by every entry point; the store is not touched."""
    folder = tmp_path / "acc"
    folder.mkdir()
    subprocess.run(
        [sys.executable, "-c", PER_RANK_JOB, str(folder), str(tmp_path / "pg")],
        check=True,
        capture_output=True,
        timeout=300,
    )
    # the rest of save_state: the scheduler and the rank's RNG
    torch.save({"last_epoch": 1, "_last_lr": [0.01]}, folder / "scheduler.bin")
    torch.save(_rng_dict(1), folder / "random_states_0.pkl")
    store = tmp_path / "store"
    layout = r"saved one file per rank without torch.distributed.checkpoint"
    way_out = r"use_dcp=False.*save_state.*SHARDED_STATE_DICT.*stepvault import"
    for call in (
        lambda: import_dcp(store, folder, run="acc", step=1, trust=True),
        lambda: stepvault.ops.migrate.import_checkpoint(store, folder, run="acc", step=1),
    ):
        with pytest.raises(StepvaultError, match=f"(?s){layout}.*{way_out}"):
            call()
    done = cli(store, "import", str(folder), "--run", "acc")  # no --step, no --trust
    assert done.exit_code != 0 and "pytorch_model_fsdp_0_rank0.bin" in done.output, done.output
    assert "one file per rank" in done.output and "records no step" not in done.output
    # The HF Trainer's checkpoint-N under FSDP LOCAL_STATE_DICT (pytorch_model_fsdp_rank<r>.bin
    # beside trainer_state.json) is an HF folder: the same refusal, not "no model weights"
    (folder / "pytorch_model_fsdp_0_rank0.bin").rename(folder / "pytorch_model_fsdp_rank0.bin")
    (folder / "trainer_state.json").write_text('{"global_step": 1, "log_history": []}')
    done = cli(store, "import", str(folder), "--run", "acc", "--trust")
    assert done.exit_code != 0 and "pytorch_model_fsdp_rank0.bin" in done.output, done.output
    assert "one file per rank" in done.output and "no model weights" not in done.output
    assert not store.exists()


def test_import_names_the_accelerate_fsdp_folder(tmp_path):
    """``stepvault import --help`` lists the Accelerate FSDP folder; ``import_checkpoint``
    of one names it and says how to import it (it needs the step and trust up front)."""
    _accelerate_folder(tmp_path / "acc")
    with pytest.raises(StepvaultError) as raised:
        stepvault.ops.migrate.import_checkpoint(tmp_path / "store", tmp_path / "acc", run="acc")
    message = str(raised.value)
    assert "an Accelerate FSDP save_state folder" in message, message
    assert "--step N --trust" in message and "import_dcp(" in message, message
    done = cli(tmp_path / "store", "import", "--help", env={"COLUMNS": "1000", "NO_COLOR": "1"})
    assert "or an Accelerate FSDP save_state folder" in done.output, done.output
    done = cli(tmp_path / "store", "import-dcp", "--help", env={"COLUMNS": "1000"})
    assert "Accelerate FSDP save_state folder" in done.output, done.output
