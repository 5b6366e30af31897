"""The Hugging Face Trainer with a sharded model saving through stepvault (INTEGRATIONS.md
"Hugging Face Transformers"): DeepSpeed ZeRO-2/3, FSDP2 and FSDP1.

Real 2-process jobs under torchrun (gloo, CPU), the Trainer itself training a tiny GPT-2
(tests/scripts/transformers_sharded_train.py): 5 optimizer steps an epoch, checkpoints
every 4 steps, 12 steps in all. Each job is SIGKILLed (torchrun and both ranks) once the
checkpoint of step 8 is committed and resumed in new processes across the epoch boundary
at 10; the final fp32 weights, every rank's optimizer partition or shard with its Adam
moments, the LR and every rank's next RNG draw are compared bitwise with an uninterrupted
run and with the Trainer's own DeepSpeed save/resume of the same job. A damaged object of
the newest checkpoint makes every rank fall back to the one before. The FSDP2 checkpoint
exports to a folder ``from_pretrained`` loads.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from helpers import flip_byte, object_path

import stepvault

SCRIPT = Path(__file__).parent / "scripts" / "transformers_sharded_train.py"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent), env.get("PYTHONPATH", "")])
    return env


def _job(*args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc_per_node", "2", str(SCRIPT), *args]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        start_new_session=True,
    )


def _run(*args: str, timeout: float = 300) -> str:
    proc = _job(*args)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-5000:]
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _run_and_kill(*args: str, timeout: float = 300) -> str:
    """Start the job, wait for ``COMMITTED``, then SIGKILL torchrun and every rank (its
    workers run in sessions of their own), as a lost node would end them."""
    pid_dir = tempfile.mkdtemp(prefix="hf-pids-")
    proc = _job(*args, "--pid-dir", pid_dir)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("COMMITTED"):
                break
            assert time.monotonic() < deadline, "".join(lines)[-5000:]
        else:
            pytest.fail("the job ended before its checkpoint: " + "".join(lines)[-5000:])
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


def _same(a_path: Path, b_path: Path) -> None:
    a, b = torch.load(a_path), torch.load(b_path)
    assert a.keys() == b.keys()
    assert len([k for k in a if k.startswith("w.")]) > 10
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ


def _damage_rank1(store: Path, step: int, prefix: str) -> None:
    """Flip one bit of an object only rank 1 wrote in ``gpt@step``: the first tensor
    entry under ``prefix`` with a shard at a nonzero offset (FSDP2), or under rank 1's
    DeepSpeed file."""
    from stepvault.format import parse_manifest
    from stepvault.store import Store

    m = parse_manifest(Store.open(store).read_manifest("gpt", step), f"gpt@{step}")
    for fqn, entry in m.sharded["entries"].items():
        if entry["type"] != "tensor" or not fqn.startswith(prefix):
            continue
        for shard in entry["shards"]:
            if prefix.startswith("deepspeed") or any(shard["offsets"]):
                flip_byte(object_path(store, shard["chunks"][0][0]))
                return
    raise AssertionError(f"no object of rank 1 under {prefix!r} in gpt@{step}")


def test_fsdp1_in_one_process_is_refused_naming_torchrun(tmp_path):
    # FSDP1 is saved collectively (every rank its shards): one process (no torchrun) is
    # refused when train() starts, before any collective, saying what to run instead
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--shard", "fsdp1", "--root", str(tmp_path),
         "--fsdp1-refused"],
        capture_output=True, text=True, timeout=300, env=_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "REFUSED the stepvault Trainer integration saves a fsdp1 job collectively" in (
        done.stdout
    )
    assert "torchrun --nproc_per_node N" in done.stdout  # what to run instead
    assert not (tmp_path / "runs").exists()  # nothing written to the store


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("shard", ["zero2", "zero1"])  # the same files; ZeRO-1 by hand before
def test_deepspeed_zero2_sigkill_damaged_shard_resume_bitwise_and_from_pretrained_export(
    tmp_path, shard
):
    common = ["--shard", shard, "--max-steps", "12", "--save-every", "4"]
    straight = tmp_path / "straight.pt"
    _run(*common, "--root", str(tmp_path / "s0"), "--final", str(straight))

    store = tmp_path / "store"
    _run_and_kill(*common, "--root", str(store), "--hold-after", "8")
    # one bit of rank 1's ZeRO-2 partition: both ranks fall back to 4
    _damage_rank1(store, 8, "deepspeed.zero_pp_rank_1_mp_rank_00_optim_states.pt.tensors")
    out = _run(*common, "--root", str(store), "--resume", "--final", str(tmp_path / "sv.pt"))
    assert "RESUMED 4 skipped=1" in out, out[-3000:]
    _same(tmp_path / "sv.pt", straight)
    # the resume is in the run's event log, as every other resume is (the damage with it)
    from stepvault.catalog.events import read_events
    from stepvault.store import Store

    restores = [e for e in read_events(Store.open(store), "gpt") if e["event"] == "restore"]
    assert [(e["step"], [k["step"] for k in e["skipped"]]) for e in restores] == [(4, [8])]

    # 2 -> 1: the Trainer's DeepSpeed checkpoint as full fp32 weights in this process
    from stepvault.integrations.deepspeed import load_fp32_state_dict

    weights = load_fp32_state_dict(store, "gpt", 12)
    final = torch.load(straight)
    # (lm_head.weight is DeepSpeed's own entry of the tied embedding)
    assert {f"w.{k}" for k in weights} - {k for k in final} == {"w.lm_head.weight"}
    assert torch.equal(weights["lm_head.weight"], weights["transformer.wte.weight"])
    assert all(torch.equal(t, final[f"w.{k}"]) for k, t in weights.items() if f"w.{k}" in final)

    # The checkpoint as a model folder (the module weights of DeepSpeed's model-states file,
    # one tensor at a time), loaded by from_pretrained: the job's final weights
    _export_loads_final(store, tmp_path / "export", final)


@pytest.mark.reference
def test_deepspeed_zero2_the_trainers_own_resume_is_bitwise_too(tmp_path):
    """The Trainer's own DeepSpeed checkpoint-8 folder, killed and resumed the same way,
    ends where the uninterrupted job does (what stepvault's resume is held to)."""
    common = ["--shard", "zero2", "--max-steps", "12", "--save-every", "4"]
    straight = tmp_path / "straight.pt"
    _run(*common, "--root", str(tmp_path / "s0"), "--final", str(straight))
    native = tmp_path / "native"
    _run_and_kill(*common, "--backend", "native", "--root", str(native), "--hold-after", "8")
    _run(*common, "--backend", "native", "--root", str(native), "--resume", "--final",
         str(tmp_path / "n.pt"))  # fmt: skip
    _same(tmp_path / "n.pt", straight)


def _export(store: Path, folder: Path) -> subprocess.CompletedProcess:
    cli = str(Path(sys.executable).parent / "stepvault")
    return subprocess.run(
        [cli, "-r", str(store), "export", "gpt@12", "-o", str(folder)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _export_loads_final(store: Path, folder: Path, final: dict) -> None:
    from transformers import GPT2LMHeadModel

    done = _export(store, folder)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    got = GPT2LMHeadModel.from_pretrained(folder).state_dict()
    names = [k[2:] for k in final if k.startswith("w.")]
    assert names and all(torch.equal(got[n], final[f"w.{n}"]) for n in names)


@pytest.mark.extended  # the fallback on every rank: CI has it under FSDP2 and plain ZeRO-3
def test_deepspeed_zero3_damaged_shard_of_rank1_falls_back_on_every_rank(tmp_path):
    common = ["--shard", "zero3", "--max-steps", "12", "--save-every", "4"]
    straight = tmp_path / "straight.pt"
    _run(*common, "--root", str(tmp_path / "s0"), "--final", str(straight))

    store = tmp_path / "store"
    _run_and_kill(*common, "--root", str(store), "--hold-after", "8")
    _damage_rank1(store, 8, "deepspeed.zero_pp_rank_1_mp_rank_00_optim_states.pt.tensors")
    out = _run(*common, "--root", str(store), "--resume", "--final", str(tmp_path / "sv.pt"))
    assert "RESUMED 4 skipped=1" in out, out[-3000:]
    _same(tmp_path / "sv.pt", straight)
    # ZeRO-3 keeps no whole weight: the export joins each from the ranks' partitions, one
    # at a time, into a folder from_pretrained loads (tests/test_export_zero3.py)
    _export_loads_final(store, tmp_path / "export", torch.load(straight))


@pytest.mark.slow
@pytest.mark.extended
def test_fsdp2_sigkill_damaged_shard_fallback_and_from_pretrained_export(tmp_path):
    common = ["--shard", "fsdp2", "--max-steps", "12", "--save-every", "4"]
    straight = tmp_path / "straight.pt"
    _run(*common, "--root", str(tmp_path / "s0"), "--final", str(straight))

    store = tmp_path / "store"
    _run_and_kill(*common, "--root", str(store), "--hold-after", "8")
    _damage_rank1(store, 8, "model.")  # a weight shard only rank 1 holds
    reads = tmp_path / "reads"
    reads.mkdir()
    out = _run(*common, "--root", str(store), "--resume", "--final", str(tmp_path / "sv.pt"),
               "--reads-dir", str(reads))  # fmt: skip
    assert "RESUMED 4 skipped=1" in out, out[-3000:]
    _same(tmp_path / "sv.pt", straight)
    # The resume reads each object of the checkpoint it loads once on a rank: the load
    # verifies as it reads (it was read once to choose, then again to load)
    vault = stepvault.open(store)
    only4 = set(vault.manifest("gpt", 4).objects) - set(vault.manifest("gpt", 8).objects)
    for rank in (0, 1):
        counts = Counter(Path(reads, f"rank{rank}.txt").read_text().split())
        assert any(counts[d] for d in only4), rank  # the load read them
        twice = sorted(d for d in only4 if counts[d] > 1)
        assert not twice, (rank, len(twice), len(only4))

    # The sharded checkpoint as a model folder (one tensor at a time), loaded by
    # from_pretrained: the job's final weights
    _export_loads_final(store, tmp_path / "export", torch.load(straight))


@pytest.mark.slow
@pytest.mark.extended
def test_fsdp1_sigkill_damaged_shard_fallback_bitwise_and_from_pretrained_export(tmp_path):
    """FSDP1 (``fsdp="full_shard"``, ``fsdp_config={"version": 1}``, flat parameters, each
    GPT-2 block wrapped): every rank saves its shards (DTensors, see integrations/_fsdp1.py)
    asynchronously; killed after 8, a shard only rank 1 wrote damaged, the rerun falls back
    to 4 on both ranks and ends bitwise equal to the uninterrupted job, Adam moments
    included (the Trainer's own FSDP1 resume loads the optimizer into an empty template)."""
    common = ["--shard", "fsdp1", "--max-steps", "12", "--save-every", "4"]
    straight = tmp_path / "straight.pt"
    _run(*common, "--root", str(tmp_path / "s0"), "--final", str(straight))

    store = tmp_path / "store"
    _run_and_kill(*common, "--root", str(store), "--hold-after", "8")
    _damage_rank1(store, 8, "model.")  # a weight shard only rank 1 holds
    out = _run(*common, "--root", str(store), "--resume", "--final", str(tmp_path / "sv.pt"))
    assert "RESUMED 4 skipped=1" in out, out[-3000:]
    final = torch.load(straight)
    assert len([k for k in final if k.startswith("exp_avg_sq.")]) > 10  # the moments too
    _same(tmp_path / "sv.pt", straight)
    _export_loads_final(store, tmp_path / "export", final)
