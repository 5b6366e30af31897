"""DeepSpeed ZeRO through stepvault (INTEGRATIONS.md "DeepSpeed", MIGRATION.md "DeepSpeed
global_stepN").

Fast: DeepSpeed's checkpoint trees (int-keyed optimizer state, the loss scaler, fragment
addresses, ZeroStageEnum) survive stepvault's pickle-free encoding exactly; the importer
refuses DeepSpeed's pickles without trust. Slow: real 2-rank ZeRO-1/2/3 jobs under torchrun
(gloo, CPU) saving through :class:`DeepSpeedCheckpointer`, SIGKILLed after a committed
checkpoint and resumed in new processes, bitwise against an uninterrupted run and against
DeepSpeed's own save/load of the same job; a damaged shard of rank 1 makes every rank fall
back; a checkpoint of 2 ranks read as full fp32 weights in one process; DeepSpeed's own
``global_stepN`` folder imported and consolidated.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from helpers import flip_byte, object_path

import stepvault
from stepvault.errors import UntrustedInputError
from stepvault.ops.migrate.deepspeed import (
    pack_file,
    read_tag,
    register_deepspeed_types,
    unpack_file,
)
from stepvault.ops.migrate.deepspeed_merge import consolidate

SCRIPT = Path(__file__).parent / "scripts" / "deepspeed_train.py"


def _ds_tree():
    """The shape of a ZeRO-2 optimizer file, with DeepSpeed's own objects in it."""
    from collections import OrderedDict

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return {
        "optimizer_state_dict": {
            "loss_scaler": LossScaler(scale=1),
            "dynamic": DynamicLossScaler(
                init_scale=2**16,
                scale_window=1000,
                min_scale=1,
                delayed_shift=1,
                consecutive_hysteresis=False,
            ),
            "zero_stage": ZeroStageEnum.gradients,
            "base_optimizer_state": {
                "state": {0: {"exp_avg": torch.randn(6), "step": torch.tensor(3.0)}},
                "param_groups": [{"params": [0], "betas": (0.9, 0.999), "lr": 0.01}],
            },
            "single_partition_of_fp32_groups": [torch.randn(6)],
            "param_slice_mappings": [OrderedDict(w=fragment_address(numel=4, start=2))],
            "partition_count": [2],
        },
        "ds_version": "0.19.8",
    }


def test_deepspeed_trees_round_trip_pickle_free(tmp_path):
    register_deepspeed_types()
    tree = _ds_tree()
    stepvault.save(tmp_path, {"ds": pack_file(tree)}, run="r", step=1)
    back = {"ds": None}
    stepvault.restore(tmp_path, back, run="r")
    got = unpack_file(back["ds"])["optimizer_state_dict"]
    want = tree["optimizer_state_dict"]
    assert type(got["loss_scaler"]) is type(want["loss_scaler"])
    assert vars(got["loss_scaler"]) == vars(want["loss_scaler"])
    assert vars(got["dynamic"]) == vars(want["dynamic"])
    assert got["zero_stage"] is want["zero_stage"]
    # int keys stay ints: torch's load_state_dict matches state to params by them
    assert list(got["base_optimizer_state"]["state"]) == [0]
    assert torch.equal(
        got["base_optimizer_state"]["state"][0]["exp_avg"],
        want["base_optimizer_state"]["state"][0]["exp_avg"],
    )
    assert isinstance(got["single_partition_of_fp32_groups"], list)
    assert got["param_slice_mappings"][0]["w"] == want["param_slice_mappings"][0]["w"]
    assert got["base_optimizer_state"]["param_groups"][0]["betas"] == (0.9, 0.999)
    # a reader that knows nothing of DeepSpeed (another process: export, show, a plain
    # load) reads the checkpoint: the skeleton is bytes to it
    code = (
        "import sys, stepvault; t = stepvault.open(sys.argv[1]).checkpoint('r').load(); "
        "assert isinstance(t['ds']['tree'], bytes), type(t['ds']['tree']); print('OK')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip() == "OK", done.stderr[-2000:]


def test_import_refuses_deepspeed_pickles_without_trust(tmp_path):
    folder = tmp_path / "global_step4"
    folder.mkdir()
    torch.save(_ds_tree(), folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(UntrustedInputError, match="trust"):
        read_tag(str(folder), trust=False)


# ------------------------------------------------------------------ real 2-rank jobs


def _env():
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent), env.get("PYTHONPATH", "")])
    return env


def _job(*args: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(SCRIPT),
        *args,
    ]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        start_new_session=True,
    )


def _run(*args: str, timeout: float = 240) -> str:
    proc = _job(*args)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def _run_and_kill(*args: str, timeout: float = 240) -> str:
    """Start the job, wait for ``COMMITTED``, then SIGKILL torchrun and every rank (its
    workers run in sessions of their own), as a lost node would end them."""
    pid_dir = tempfile.mkdtemp(prefix="ds-pids-")
    proc = _job(*args, "--pid-dir", pid_dir)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("COMMITTED"):
                break
            assert time.monotonic() < deadline, "".join(lines)[-4000:]
        else:
            pytest.fail("the job ended before its checkpoint: " + "".join(lines)[-4000:])
    finally:
        ranks = [int(Path(pid_dir, n).read_text()) for n in os.listdir(pid_dir)]
        for pid in [proc.pid, *ranks]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)
        for pid in ranks:  # gone before the next job takes the run's lease
            while _alive(pid):
                time.sleep(0.1)
    return "".join(lines)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _same(a_path, b_path) -> None:
    a, b = torch.load(a_path), torch.load(b_path)
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ


@pytest.mark.slow
@pytest.mark.extended
def test_zero2_sigkill_resume_bitwise_against_deepspeed_and_straight(tmp_path):
    common = ["--stage", "2", "--steps", "16", "--save-every", "4"]
    straight = tmp_path / "straight.pt"
    _run("--root", str(tmp_path / "s0"), *common, "--out", str(straight))

    store = tmp_path / "store"
    _run_and_kill("--root", str(store), *common, "--hold-after", "12")
    out = _run("--root", str(store), *common, "--out", str(tmp_path / "sv.pt"))
    assert "RESUMED 12 skipped=0" in out
    _same(tmp_path / "sv.pt", straight)

    # DeepSpeed's own save/load of the same job: bitwise too (the reference)
    native = tmp_path / "native"
    _run_and_kill("--mode", "native", "--root", str(native), *common, "--hold-after", "12")
    out = _run("--mode", "native", "--root", str(native), *common, "--out", str(tmp_path / "n.pt"))
    assert "RESUMED 12" in out
    _same(tmp_path / "n.pt", straight)

    # 2 -> 1: the 2-rank checkpoint as full fp32 weights in this process, no group
    from stepvault.integrations.deepspeed import load_fp32_state_dict
    from stepvault.ops.migrate import import_checkpoint

    weights = load_fp32_state_dict(store, "ds", 16)
    final = torch.load(straight)
    assert sorted(weights) == sorted(k for k in final if not k.endswith(("exp_avg", "exp_avg_sq")))
    for name, tensor in weights.items():
        assert torch.equal(tensor, final[name]), name
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 8)
    )
    model.load_state_dict(weights)

    # Training continues from an import of DeepSpeed's own global_step12 (files kept): the
    # engine resumed from the store holds DeepSpeed's fp32 weights of step 12
    imp = tmp_path / "imp"
    import_checkpoint(imp, native / "global_step12", run="ds", trust=True)
    at12 = ["--stage", "2", "--steps", "12", "--save-every", "4", "--no-moments"]
    out = _run("--root", str(imp), *at12, "--out", str(tmp_path / "imp12.pt"))
    assert "RESUMED 12 skipped=0" in out and "ResumeGapWarning" in out  # no RNG in DeepSpeed's
    want = consolidate(read_tag(str(native / "global_step12"), trust=True))
    got = torch.load(tmp_path / "imp12.pt")
    assert got.keys() == want.keys()
    assert [k for k in got if not torch.equal(got[k], want[k])] == []

    # DeepSpeed's own global_step16 folder imported: consolidated weights, files kept
    imported = tmp_path / "imported"
    import_checkpoint(imported, native / "global_step16", run="ds-import", trust=True)
    back = {
        "model": torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 8)
        )
    }
    info = stepvault.restore(imported, back, run="ds-import", strict=False)
    assert info.step == 16
    for name, tensor in back["model"].state_dict().items():
        assert torch.equal(tensor, final[name]), name


@pytest.mark.slow
@pytest.mark.extended
def test_zero1_sigkill_damaged_shard_of_rank1_resumes_across_epoch_bitwise(tmp_path):
    """ZeRO-1 (only the optimizer partitioned): the job killed (SIGKILL, every process)
    after the checkpoint at 9 is committed; one object of rank 1's optimizer partition at 9
    damaged; the rerun falls back to 6 on both ranks, crosses the epoch boundary at 8 and
    ends bitwise equal to the uninterrupted job (weights and both Adam moments); the 2-rank
    checkpoint exports as one safetensors file of the final weights."""
    from sharded_jobs import damage_rank1_shard

    common = ["--stage", "1", "--steps", "12", "--save-every", "3"]
    straight = tmp_path / "straight.pt"
    _run("--root", str(tmp_path / "s0"), *common, "--out", str(straight))

    store = tmp_path / "store"
    _run_and_kill("--root", str(store), *common, "--hold-after", "9")
    assert stepvault.open(store).steps("ds") == [3, 6, 9]
    damaged = damage_rank1_shard(store, "ds", 9)
    assert "zero_pp_rank_1" in damaged, damaged
    out = _run("--root", str(store), *common, "--out", str(tmp_path / "sv.pt"))
    assert "RESUMED 6 skipped=1" in out, out[-3000:]
    _same(tmp_path / "sv.pt", straight)
    assert stepvault.ops.verify(store, deep=True).ok  # the damaged one was quarantined

    from safetensors.torch import load_file

    from stepvault.store import Store

    stepvault.ops.export_weights(Store.open(store), "ds", 12, tmp_path / "w.safetensors")
    exported, final = load_file(tmp_path / "w.safetensors"), torch.load(straight)
    assert exported.keys() == {k for k in final if not k.endswith(("exp_avg", "exp_avg_sq"))}
    assert [k for k, t in exported.items() if not torch.equal(t, final[k])] == []


@pytest.mark.slow
def test_zero3_damaged_shard_of_rank1_falls_back_on_every_rank(tmp_path):
    common = ["--stage", "3", "--steps", "16", "--save-every", "4"]
    # the uninterrupted reference saves with DeepSpeed's own engine (saving changes no
    # training state): its global_step16 is the ZeRO-3 import below
    straight, native = tmp_path / "straight.pt", tmp_path / "native"
    _run("--mode", "native", "--root", str(native), *common, "--out", str(straight))

    store = tmp_path / "store"
    _run_and_kill("--root", str(store), *common, "--hold-after", "12")
    from stepvault.format import parse_manifest
    from stepvault.store import Store

    m = parse_manifest(Store.open(store).read_manifest("ds", 12), "ds@12")
    entry = m.sharded["entries"]["deepspeed.zero_pp_rank_1_mp_rank_00_optim_states.pt.tensors.t0"]
    flip_byte(object_path(store, entry["shards"][0]["chunks"][0][0]))

    out = _run("--root", str(store), *common, "--out", str(tmp_path / "sv.pt"))
    assert "RESUMED 8 skipped=1" in out, out[-3000:]
    _same(tmp_path / "sv.pt", straight)

    # ZeRO-3 partitions joined per parameter: stepvault's 2-rank checkpoint in one
    # process, and DeepSpeed's own global_step16 imported, both equal the job's weights
    from stepvault.integrations.deepspeed import load_fp32_state_dict
    from stepvault.ops.migrate import import_checkpoint

    final = torch.load(straight)
    weights = load_fp32_state_dict(store, "ds", 16)
    assert weights.keys() == {k for k in final if not k.endswith(("exp_avg", "exp_avg_sq"))}
    assert all(torch.equal(t, final[n]) for n, t in weights.items())
    import_checkpoint(tmp_path / "imported", native, run="z3", trust=True)  # via 'latest'
    imported = stepvault.open(tmp_path / "imported").checkpoint("z3").load()
    assert imported["model"].keys() == weights.keys()
    assert all(torch.equal(t, final[n]) for n, t in imported["model"].items())
