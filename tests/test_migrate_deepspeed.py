"""DeepSpeed ``global_stepN`` folders: consolidation and import (MIGRATION.md "DeepSpeed
global_stepN").

The folders under tests/data/deepspeed_zero were written by DeepSpeed 0.19.8's own
``save_checkpoint`` in real 2-process gloo jobs (``make_folders.py`` next to them, stored
because a job takes longer than a fast test may): ZeRO-1, ZeRO-2 with ``parameter_alignment``
(non-zero ``param_alignment_paddings``) and ZeRO-3, each of a model with a tied weight
(``head.weight`` is ``emb.weight``), frozen parameters, two parameter groups, odd element
counts and float and int buffers. Every check compares with DeepSpeed's own merge of the same
folder (``get_fp32_state_dict_from_zero_checkpoint``), bitwise.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from helpers import flip_byte, object_path

import stepvault
from stepvault.distributed.planners import decode_value_bytes
from stepvault.errors import StepvaultError
from stepvault.format.settings import DEFAULT_STORE_SETTINGS
from stepvault.integrations.deepspeed import load_fp32_state_dict
from stepvault.ops import import_checkpoint
from stepvault.ops.migrate.deepspeed import (
    TensorRef,
    read_tag,
    register_deepspeed_types,
)
from stepvault.ops.migrate.deepspeed_merge import consolidate
from stepvault.store import Store

DATA = Path(__file__).parent / "data" / "deepspeed_zero"
TAG = "global_step3"


def _folders_module() -> Any:
    """make_folders.py: the model the folders were written from."""
    spec = importlib.util.spec_from_file_location("ds_make_folders", DATA / "make_folders.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _deepspeeds_own(stage: int) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(DATA / f"zero{stage}"), tag=TAG)


def _assert_bitwise(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, ordered: bool = True
) -> None:
    assert list(got) == list(want) if ordered else sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), name
        assert torch.equal(g, w), name


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_consolidation_equals_deepspeeds_own_merge(stage):
    files = read_tag(str(DATA / f"zero{stage}" / TAG), trust=True)
    got = consolidate(files)
    want = _deepspeeds_own(stage)
    model = _folders_module().build()  # frozen weights never change: the built ones
    frozen = {f"frozen.{k}": v for k, v in model.frozen.state_dict().items()}
    if stage == 1:
        # ZeRO-1 records no frozen_param_shapes, so DeepSpeed's merge leaves the frozen
        # parameters out; the module holds them whole and the import keeps them
        assert not set(frozen) & set(want)
        _assert_bitwise({k: v for k, v in got.items() if k not in frozen}, want)
    else:
        _assert_bitwise(got, want)
    for name, value in frozen.items():
        assert torch.equal(got[name], value), name
    assert got["head.weight"] is got["emb.weight"]  # tied, as in DeepSpeed's merge
    assert got["count"].dtype == torch.int64 and got["scale"].dtype == torch.float32
    # the model loads it whole, nothing missing or unexpected
    assert not model.load_state_dict(got).missing_keys


def test_consolidation_refuses_a_missing_rank_and_model_parallel_files():
    files = read_tag(str(DATA / "zero2" / TAG), trust=True)
    del files["zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    with pytest.raises(StepvaultError, match="2 ranks but 1"):
        consolidate(files)
    # a tensor-parallel checkpoint's second model-parallel rank: refused, not mis-joined
    files = read_tag(str(DATA / "zero2" / TAG), trust=True)
    files["zero_pp_rank_0_mp_rank_01_optim_states.pt"] = files[
        "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    ]
    with pytest.raises(StepvaultError, match="ds_to_universal"):
        consolidate(files)


def _moment_objects(store_root: Path, ckpt: Any) -> set[str]:
    """The objects of the imported optimizer moments (exp_avg, exp_avg_sq), checked to
    hold no other tensor of the checkpoint."""
    register_deepspeed_types()
    tensors = ckpt.manifest.tensors
    names: set[str] = set()
    for file, packed in ckpt.load()["deepspeed"].items():
        if not file.endswith("_optim_states.pt"):
            continue
        opt = decode_value_bytes(bytes(packed["tree"]))["optimizer_state_dict"]
        base = opt.get("base_optimizer_state") or opt.get("optimizer_state_dict")
        for slot in base["state"].values():
            for key in ("exp_avg", "exp_avg_sq"):
                assert isinstance(slot[key], TensorRef)
                names.add(f"deepspeed/{file}/tensors/t{slot[key].index}")

    def digests(entries: Any) -> set[str]:
        return {str(c[0]) for e in entries for c in e.chunks}

    moments = digests(tensors[n] for n in names)
    others = digests(e for n, e in tensors.items() if n not in names)
    assert moments and not moments & others
    return moments


@pytest.mark.parametrize("stage", [2, 3])
def test_load_fp32_state_dict_reads_the_weights_not_the_moments(tmp_path, stage):
    root = tmp_path / "store"
    # every tensor in an object of its own (as a collective save writes them), so damage
    # to the moments' objects touches no weight
    Store.open(root, create=True, defaults={**DEFAULT_STORE_SETTINGS, "small_tensor": 1})
    import_checkpoint(root, DATA / f"zero{stage}" / TAG, run="ds", format="deepspeed", trust=True)
    ckpt = stepvault.open(str(root)).checkpoint("ds")
    moments = _moment_objects(root, ckpt)
    want = _deepspeeds_own(stage)
    _assert_bitwise(load_fp32_state_dict(root, "ds"), want)
    for digest in moments:
        flip_byte(object_path(root, digest))
    with pytest.raises(StepvaultError):  # the damage is there for whoever reads it
        stepvault.open(str(root)).checkpoint("ds").load()
    # the weights' bytes are all it reads: every one verified, the moments never
    _assert_bitwise(load_fp32_state_dict(root, "ds", step=3), want)


def _cli(*args: str) -> str:
    """The ``stepvault`` command, run in this process (a new one would take longer than
    the whole test)."""
    from typer.testing import CliRunner

    from stepvault.cli.main import app

    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output[-4000:]
    return result.output


def test_import_of_a_zero3_folder_restores_and_exports_the_right_weights(tmp_path):
    from safetensors.torch import load_file

    root = tmp_path / "store"
    _cli("--root", str(root), "import", str(DATA / "zero3"), "--run", "z3", "--trust")
    want = _deepspeeds_own(3)
    # restored into the plain model (DeepSpeed's own files, kept under 'deepspeed', are not
    # part of it): the tied head and the frozen layer included
    model = _folders_module().build(seed=1)
    stepvault.restore(str(root), {"model": model}, run="z3", strict=False)
    assert model.head.weight is model.emb.weight
    _assert_bitwise(dict(model.state_dict()), want, ordered=False)
    # exported as safetensors: every weight DeepSpeed's merge gives (a tied copy may be
    # left out: the model ties it again)
    out = tmp_path / "model.safetensors"
    _cli("--root", str(root), "export", "z3@3", "-o", str(out), "--format", "safetensors")
    exported = load_file(str(out))
    assert set(want) - set(exported) <= {"head.weight"}
    for name, value in exported.items():
        assert torch.equal(value, want[name]), name
    # and read back as weights (what a DeepSpeed checkpoint of the store gives)
    _assert_bitwise(load_fp32_state_dict(root, "z3"), want)


def _torchrun(*args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    done = subprocess.run(
        [*cmd, "2", str(DATA / "make_folders.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,  # a loaded 2-core machine
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.extended  # two 2-process DeepSpeed jobs: outside CI's runs (-m extended)
def test_a_zero3_import_resumes_as_deepspeeds_own_load_of_the_folder(tmp_path):
    root = tmp_path / "store"
    import_checkpoint(root, DATA / "zero3" / TAG, run="z3", trust=True)
    for source in ("stepvault", "deepspeed"):
        out = _torchrun(
            *("--stage", "3", "--resume-from", source, "--root", str(root), "--run-name", "z3"),
            *("--out", str(tmp_path / source)),
        )
        assert source != "stepvault" or "RESUMED 3" in out, out[-3000:]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ours = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "stepvault"))
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "deepspeed"))
    # one step after each resume: weights, frozen and tied ones too, bitwise the same (the
    # step used the restored Adam moments)
    _assert_bitwise(ours, theirs)
    before = _deepspeeds_own(3)
    assert not torch.equal(ours["emb.weight"], before["emb.weight"])  # it trained
    assert torch.equal(ours["frozen.weight"], before["frozen.weight"])
