"""Export of DeepSpeed ZeRO-3 checkpoints, one tensor at a time (INTEGRATIONS.md "DeepSpeed").

Fast: where each parameter lies in the ranks' flat fp32 partitions
(:func:`~stepvault.ops.export_zero3.zero3_param_slices`) gives the same tensors as
DeepSpeed's own ``zero_to_fp32.py`` merge of the same partitions (odd sizes, padding, two
groups, 1-3 ranks). Slow (CI): the files of a 3-rank ZeRO-3 job (frozen fragments, a tied
and a half-precision buffer) stored as ``DeepSpeedCheckpointer`` stores them, by two
processes: the export equals DeepSpeed's own merge. Extended (``-m extended``): a real
2-rank ZeRO-3 job on a tiny GPT-2 (tied, frozen and padded parameters, two groups) through
``DeepSpeedCheckpointer``, exported: the weights equal DeepSpeed's own
``get_fp32_state_dict_from_zero_checkpoint`` of DeepSpeed's own save of the same state and
stepvault's ``load_fp32_state_dict``; the export holds one tensor at a time (measured:
tracemalloc's peak, and each file's bytes written before the next tensor is read);
``from_pretrained`` loads the exported folder and gives the job's logits.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

import itertools

from stepvault.errors import StepvaultError
from stepvault.ops.export_zero3 import zero3_param_slices

SCRIPT = Path(__file__).parent / "scripts" / "deepspeed_export_job.py"
sys.path.insert(0, str(SCRIPT.parent))  # the job's model config, for from_pretrained's check


def _partition(groups: list[dict[str, torch.Tensor]], world: int) -> list[list[torch.Tensor]]:
    """Each rank's flat fp32 groups, laid out as ZeRO-3 lays them (each parameter padded
    to ``world * ceil(numel / world)``, rank r holding the r-th slice)."""
    flats: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for group in groups:
        parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for t in group.values():
            part = math.ceil(t.numel() / world)
            padded = torch.cat([t.reshape(-1), torch.full((part * world - t.numel(),), 7e7)])
            for r in range(world):
                parts[r].append(padded[r * part : (r + 1) * part])
        for r in range(world):
            flats[r].append(torch.cat(parts[r]))
    return flats


@pytest.mark.parametrize("world", [1, 2, 3])
def test_zero3_slices_join_the_parameters_as_deepspeeds_own_merge_does(world):
    from deepspeed.utils.zero_to_fp32 import (
        _get_fp32_state_dict_from_zero3_checkpoint,
        to_torch_tensor,
        zero_model_state,
    )

    g = torch.Generator().manual_seed(world)
    sizes = [[(5, 3), (7,), (1,), (4, 4)], [(3,), (11, 2), (2, 2, 3)]]  # odd counts: padding
    groups = [
        {f"g{i}.p{j}": torch.randn(s, generator=g) for j, s in enumerate(group)}
        for i, group in enumerate(sizes)
    ]
    flats = _partition(groups, world)
    shapes = [{n: torch.Size(t.shape) for n, t in group.items()} for group in groups]
    states = [
        zero_model_state(
            buffers={},
            param_shapes=shapes,
            shared_params=[],
            ds_version="0.19.8",
            frozen_param_shapes=None,
            frozen_param_fragments=None,
        )
        for _ in range(world)
    ]
    theirs = to_torch_tensor(
        _get_fp32_state_dict_from_zero3_checkpoint(world, flats, states, False)
    )

    slices = zero3_param_slices(shapes, [f.numel() for f in flats[0]], world)
    assert list(slices) == list(theirs)  # DeepSpeed's order
    for name, pieces in slices.items():
        ours = torch.cat([flats[r][grp][s : s + n] for r, grp, s, n in pieces])
        want = next(group[name] for group in groups if name in group)
        assert torch.equal(ours.view(want.shape), theirs[name])
        assert torch.equal(theirs[name], want)
        assert ours.numel() == want.numel()  # the padding (7e7) is never read


def test_zero3_slices_refuse_partitions_that_do_not_hold_the_parameters():
    with pytest.raises(StepvaultError, match="do not match"):
        zero3_param_slices([{"w": (3, 3)}], [4], 2)  # 9 elements need 5 per rank


def _zero3_files(world: int) -> tuple[dict[str, dict], dict[str, torch.Tensor]]:
    """DeepSpeed's ZeRO-3 files of ``world`` ranks (the trees its ``save_checkpoint``
    hands the checkpoint engine, with the keys ``zero_to_fp32.py`` reads: what
    ``DeepSpeedCheckpointer`` stores), and the weights they hold: two parameter groups with
    padded sizes, a frozen parameter (each rank its fragment), a tied parameter and a
    half-precision buffer; eight 1.2 MB weights, so that holding one at a time shows."""
    g = torch.Generator().manual_seed(3)
    groups = [
        {
            "wte.weight": torch.randn(601, 499, generator=g),
            "ln.weight": torch.randn(7, generator=g),
        },
        {"head.bias": torch.randn(3, generator=g)},
    ]
    for i in range(7):
        groups[i % 2][f"h.{i}.weight"] = torch.randn(599, 501 + i, generator=g)
    frozen = torch.randn(5, 3, generator=g)
    buffer = torch.randn(6, generator=g).half()
    flats = _partition(groups, world)
    part = math.ceil(frozen.numel() / world)
    padded = torch.cat([frozen.reshape(-1), torch.zeros(part * world - frozen.numel())])
    files: dict[str, dict] = {}
    for r in range(world):
        module = {n: torch.empty(0) for group in groups for n in group}
        module.update({"wpe.weight": torch.empty(0), "lm_head.weight": torch.empty(0)})
        module["mask"] = buffer
        files[f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"] = {
            "module": module,
            "buffer_names": ["mask"],
            "param_shapes": [{n: torch.Size(t.shape) for n, t in gr.items()} for gr in groups],
            "frozen_param_shapes": {"wpe.weight": torch.Size(frozen.shape)},
            "frozen_param_fragments": {"wpe.weight": padded[r * part : (r + 1) * part].clone()},
            "shared_params": {"lm_head.weight": "wte.weight"},
            "ds_version": "0.19.8",
        }
        files[f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"] = {
            "optimizer_state_dict": {
                "zero_stage": 3,
                "partition_count": world,
                "fp32_flat_groups": [f.clone() for f in flats[r]],
            }
        }
    weights = {n: t for group in groups for n, t in group.items()}
    weights.update({"wpe.weight": frozen, "lm_head.weight": weights["wte.weight"]})
    weights["mask"] = buffer.float()
    return files, weights


#: one of two processes saving ZeRO-3 files collectively, as DeepSpeedCheckpointer does
#: (argv: root, files, rendezvous file, rank): rank r the files of ranks r, r + 2, ...
_SAVE_FILES = """
import re, sys, torch, torch.distributed as dist
from stepvault import CheckpointManager
from stepvault.ops.migrate.deepspeed import TensorRef, pack_file
from stepvault.state import register_type
# the packed layout's one type (register_deepspeed_types' first line; the rest would
# import DeepSpeed, whose own objects these files do not hold)
register_type(TensorRef, "stepvault.deepspeed.TensorRef", lambda r: r.index, TensorRef)
rank = int(sys.argv[4])
dist.init_process_group("gloo", init_method="file://" + sys.argv[3], rank=rank, world_size=2)
files = torch.load(sys.argv[2])
mine = {n: t for n, t in files.items() if int(re.search(r"rank_(\\d+)_", n)[1]) % 2 == rank}
with CheckpointManager(sys.argv[1], "z3", async_save=False) as mgr:
    mgr.save(3, {"deepspeed": {n: pack_file(t) for n, t in mine.items()}}, force=True)
dist.destroy_process_group()
"""


@pytest.mark.slow  # two small processes (no framework): the one ZeRO-3 export test in CI
def test_zero3_export_of_a_stored_checkpoint_equals_deepspeeds_own_merge(tmp_path):
    """DeepSpeedCheckpointer's stored layout (each file packed, written collectively by two
    processes), the files of a 3-rank ZeRO-3 job: the export reads each weight's ranges of
    the stored partitions, holds one weight at a time (tracemalloc) and equals DeepSpeed's
    own zero_to_fp32 merge of the same files."""
    from deepspeed.utils.zero_to_fp32 import (
        _get_fp32_state_dict_from_zero3_checkpoint,
        to_torch_tensor,
        zero_model_state,
    )
    from safetensors.torch import load_file

    from stepvault.ops.export import export_weights
    from stepvault.ops.migrate.deepspeed import register_deepspeed_types
    from stepvault.store import Store

    files, weights = _zero3_files(3)
    torch.save(files, tmp_path / "files.pt")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _SAVE_FILES,
                str(tmp_path / "store"),
                str(tmp_path / "files.pt"),
                str(tmp_path / "rendezvous"),
                str(rank),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]

    path = tmp_path / "w.safetensors"
    register_deepspeed_types()  # its imports are not the export's memory
    memory: list[int] = []
    tracemalloc.start()
    try:
        report = export_weights(
            Store.open(tmp_path / "store"),
            "z3",
            3,
            path,
            progress=lambda done, total: memory.append(tracemalloc.get_traced_memory()[0]),
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    exported = load_file(path)
    largest = max(t.numel() * t.element_size() for t in exported.values())
    assert report.total_bytes > 8 * largest
    assert max(memory) - min(memory) < 2.5 * largest, (memory, largest)
    assert peak < 3 * largest + 4 * 2**20, (peak, largest, report.total_bytes)
    model = [files[f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"] for r in range(3)]
    states = [
        zero_model_state(
            buffers={"mask": m["module"]["mask"].float()},
            param_shapes=m["param_shapes"],
            shared_params=list(m["shared_params"].items()),
            ds_version=m["ds_version"],
            frozen_param_shapes=m["frozen_param_shapes"],
            frozen_param_fragments=m["frozen_param_fragments"],
        )
        for m in model
    ]
    flats = [
        files[f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"]["optimizer_state_dict"][
            "fp32_flat_groups"
        ]
        for r in range(3)
    ]
    theirs = to_torch_tensor(_get_fp32_state_dict_from_zero3_checkpoint(3, flats, states, False))
    assert set(exported) == set(theirs) == set(weights)
    assert [n for n in theirs if not torch.equal(exported[n], theirs[n])] == []
    assert [n for n in weights if not torch.equal(exported[n], weights[n])] == []


# ------------------------------------------------------------------ a real 2-rank job


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def zero3_job(tmp_path_factory):
    """stepvault's checkpoint (run z3, step 3), DeepSpeed's own save of the same state and
    the engine's logits, from one 2-rank ZeRO-3 job."""
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("zero3")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
        "2", str(SCRIPT), "--root", str(tmp / "store"), "--native", str(tmp / "native"),
        "--out", str(tmp / "logits.pt"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return tmp


def _deepspeeds_own(native: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(native))


@pytest.mark.slow
@pytest.mark.extended  # a multi-process job: outside CI's runs (-m extended)
def test_zero3_export_equals_deepspeeds_own_consolidation_one_tensor_at_a_time(zero3_job):
    from safetensors.torch import load_file

    from stepvault.integrations.deepspeed import load_fp32_state_dict
    from stepvault.ops.export import export_weights
    from stepvault.ops.migrate.deepspeed import register_deepspeed_types
    from stepvault.store import Store

    store = Store.open(zero3_job / "store")
    out = zero3_job / "w.safetensors"
    sizes: list[tuple[int, int]] = []  # (bytes read so far, bytes on disk then)
    memory: list[int] = []

    def progress(done: int, total: int | None) -> None:
        partial = str(out) + ".partial"
        sizes.append((done, os.path.getsize(partial) if os.path.exists(partial) else 0))
        memory.append(tracemalloc.get_traced_memory()[0])

    register_deepspeed_types()  # its imports are not the export's memory
    tracemalloc.start()
    try:
        report = export_weights(store, "z3", 3, out, progress=progress)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    exported = load_file(out)
    theirs = _deepspeeds_own(zero3_job / "native")
    # every parameter, frozen and tied ones included, and the buffers DeepSpeed returns
    assert set(exported) == set(theirs)
    assert [n for n in theirs if not torch.equal(exported[n], theirs[n])] == []
    ours = load_fp32_state_dict(zero3_job / "store", "z3", 3)
    assert [n for n in ours if not torch.equal(exported[n], ours[n])] == []
    assert exported["lm_head.weight"].equal(exported["transformer.wte.weight"])

    # one tensor at a time: the file grows tensor by tensor (each is written before the
    # next is read), and the traced memory never holds more than about two tensors
    largest = max(t.numel() * t.element_size() for t in exported.values())
    assert report.total_bytes > 6 * largest
    # (on disk: all but what the file object still buffers, at most 64 KiB)
    assert all(b[1] + 2**16 >= a[0] for a, b in itertools.pairwise(sizes)), sizes
    assert max(memory) - min(memory) < 2.5 * largest, (memory, largest)
    assert peak < 3 * largest + 4 * 2**20, (peak, largest, report.total_bytes)


@pytest.mark.slow
@pytest.mark.extended  # a multi-process job: outside CI's runs (-m extended)
def test_zero3_export_loads_with_from_pretrained_and_gives_the_jobs_logits(zero3_job):
    from deepspeed_export_job import CONFIG, tokens  # the job's model
    from transformers import GPT2Config, GPT2LMHeadModel
    from typer.testing import CliRunner

    from stepvault.cli.main import app
    from stepvault.ops.export_hf import verify_export

    config = GPT2Config(**CONFIG, architectures=["GPT2LMHeadModel"])
    config.save_pretrained(zero3_job / "config")  # what a user of plain DeepSpeed has
    folder = zero3_job / "hf"
    result = CliRunner().invoke(
        app,
        ["export", "z3@3", "-o", str(folder), "--root", str(zero3_job / "store"),
         "--config", str(zero3_job / "config"), "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["format"] == "hf" and verify_export(folder).ok
    assert "lm_head.weight" in report["tied"]  # left out; from_pretrained ties it again
    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    reference = GPT2LMHeadModel(config).eval()
    reference.load_state_dict(_deepspeeds_own(zero3_job / "native"))
    with torch.no_grad():
        logits = model(input_ids=tokens()).logits
        assert torch.equal(logits, reference(input_ids=tokens()).logits)
    torch.testing.assert_close(logits, torch.load(zero3_job / "logits.pt"), rtol=1e-5, atol=1e-5)
