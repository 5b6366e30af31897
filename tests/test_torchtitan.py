"""torchtitan through stepvault (issue 30, item 4): a real torchtitan job — its own
Trainer and entry point, the llama3 debug model under FSDP2, 2 processes under torchrun
over gloo on CPU — checkpointed by ``StepvaultCheckpointManager`` from its config.

torchtitan cannot share the dev environment (its ``datasets`` needs a huggingface-hub
that breaks transformers), so the module fixture builds ``.venv-torchtitan`` in the
repository once (tests/torchtitan_env.py) and skips only when pip cannot reach the
registry. Marked ``extended`` (``-m extended``): the build and the jobs (~3 min) do not fit
CI's 30 minutes. The job's tokenizer and
dataset are made by the test (tests/scripts/torchtitan_assets.py); the CPU patches
torchtitan needs are test-only (tests/scripts/torchtitan_train.py, torchtitan_configs.py).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torchtitan_env
from ddp_util import ENV, kill_job, kill_job_when_saved, run_job
from integration_util import damage_newest

import stepvault
from stepvault.store import Store

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
RUN = "llama3"
STEPS = 12  # checkpoints every 3 steps (torchtitan_configs.INTERVAL)


@pytest.fixture(scope="module")
def tt_python() -> Path:
    """The torchtitan environment's python (tests/torchtitan_env.py: built once)."""
    try:
        return torchtitan_env.build()
    except torchtitan_env.RegistryUnreachable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def assets(tt_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tokenizer and text dataset the debug config reads (made here, not downloaded)."""
    root = tmp_path_factory.mktemp("torchtitan-assets")
    subprocess.run(
        [str(tt_python), str(SCRIPTS / "torchtitan_assets.py"), str(root)], check=True, env=ENV
    )
    return root


#: torchtitan's options for each parallel layout of the 2 ranks (the default: FSDP2 over both).
LAYOUTS = {
    "tp": [
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--parallelism.tensor_parallel_degree",
        "2",
    ],
    "pp": [
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--training.disable_cuda_graphs",  # torchtitan refuses PP with its CUDA-graph flag on
    ],
    # 4 ranks: FSDP2 over 2 data-parallel ranks, each pair tensor parallel.
    "dp2_tp2": [
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
    ],
}
#: processes per layout (2 unless named)
NPROC = {"dp2_tp2": 4}


def _job(
    python: Path, assets: Path, dump: Path, out: Path, *extra: str, nproc: int = 2
) -> list[str]:
    return [
        str(python),
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(SCRIPTS / "torchtitan_train.py"),
        str(assets),
        str(dump),
        str(out),
        *extra,
    ]


def _ranks(out: Path, nproc: int = 2) -> list[dict]:
    """Each rank's end state (its shards' digests, lr, step, data position)."""
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def _same(a: dict, b: dict) -> dict:
    """The parts of a rank's end state that must be equal after a resume."""
    keys = ("step", "ntokens_seen", "model", "optimizer", "moments", "lr", "data")
    return {k: (a[k], b[k]) for k in keys if a[k] != b[k]}


@pytest.fixture(scope="module")
def reference(tt_python: Path, assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 12-step job checkpointed through stepvault; its dump folder."""
    dump = tmp_path_factory.mktemp("torchtitan-reference")
    run_job(_job(tt_python, assets, dump, dump / "out", "--full-weights"), timeout=600)
    return dump


def _killed_after(cmd: list[str], committed: Path, out: Path, nproc: int = 2) -> int:
    """Start the job, SIGKILL every process of it once ``committed`` exists and every rank
    stalled after it (torchtitan's own checkpoints: a folder, no stepvault store to watch);
    its exit status."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 600
        while not (
            committed.exists() and all((out / f"stalled{r}").exists() for r in range(nproc))
        ):
            assert proc.poll() is None, f"the job ended before it was killed: {proc.stderr.read()}"
            assert time.time() < deadline, "the job wrote no checkpoint in time"
            time.sleep(0.2)
        kill_job(proc.pid)
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            kill_job(proc.pid)
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


@pytest.mark.extended
def test_torchtitan_job_killed_damaged_and_resumed_is_bitwise(
    tt_python, assets, reference, tmp_path
):
    """The same job SIGKILLed after its step-6 checkpoint is committed, that checkpoint
    damaged in one object only it uses (a shard of one rank): started again, both ranks
    resume from step 3, say they skipped 6, and end with every rank's weight shards, AdamW
    moments, lr, data position and step bitwise equal to the uninterrupted job's."""
    want = _ranks(reference / "out")
    assert [r["step"] for r in want] == [STEPS, STEPS]
    assert want[0]["moments"] > 0  # the optimizer has state: it is compared
    ref_root = reference / "checkpoint"
    # Retention is stepvault's keep policy (keep_last=3), not torchtitan's keep_latest_k.
    assert stepvault.open(ref_root).steps(RUN) == [6, 9, 12]
    assert stepvault.open(ref_root).manifest(RUN, 12).sharded  # every rank wrote its shards

    dump = tmp_path / "job"
    root = dump / "checkpoint"
    out = tmp_path / "out"
    steps, code = kill_job_when_saved(
        _job(tt_python, assets, dump, out, "--stall-after", "7"),
        root,
        RUN,
        min_step=6,
        timeout=600,
    )
    assert code != 0 and steps == [3, 6]
    assert not (out / "rank0.json").exists()  # it never finished

    assert damage_newest(root, RUN) == 6
    run_job(_job(tt_python, assets, dump, out), timeout=600)
    got = _ranks(out)
    assert [(r["resumed"], r["skipped"], r["first_step"]) for r in got] == [(3, [6], 4)] * 2
    for rank in range(2):
        assert not _same(got[rank], want[rank]), f"rank {rank}: {_same(got[rank], want[rank])}"
    assert stepvault.ops.verify(root, deep=True).ok  # the damaged checkpoint was quarantined


@pytest.mark.reference
def test_torchtitan_own_dcp_resume_ends_where_stepvault_does(
    tt_python, assets, reference, tmp_path
):
    """torchtitan's own DCP checkpointer on the same job, SIGKILLed after its step-6
    checkpoint and resumed, ends bitwise where the stepvault job does: both resumes are
    exact, and saving through stepvault changes nothing in training."""
    dump, out = tmp_path / "own", tmp_path / "own-out"
    job = _job(tt_python, assets, dump, out, "--checkpointer", "dcp")
    assert _killed_after([*job, "--stall-after", "7"], dump / "checkpoint/step-6/.metadata", out)
    run_job(job, timeout=600)
    got, want = _ranks(out), _ranks(reference / "out")
    assert [r["first_step"] for r in got] == [7, 7]  # resumed from its step-6 checkpoint
    for rank in range(2):
        assert not _same(got[rank], want[rank]), f"rank {rank}: {_same(got[rank], want[rank])}"


@pytest.mark.extended
def test_torchtitan_config_refuses_keep_latest_k(tt_python):
    """torchtitan's retention setting is refused with the stepvault one to use instead; an
    exit code out of range for the preemption save is refused naming the setting."""
    code = (
        "from stepvault.integrations.torchtitan import StepvaultCheckpointManager as M\n"
        "for bad in ({'keep_latest_k': 5}, {'preemption_exit_code': 300}):\n"
        "    try:\n        M.Config(enable=True, **bad)\n"
        "    except ValueError as e:\n        print(e)\n"
    )
    out = subprocess.run(
        [str(tt_python), "-c", code], capture_output=True, text=True, env=ENV, check=True
    )
    keep, exit_code = out.stdout.splitlines()
    assert "keep_last" in keep and "keep_latest_k=0" in keep, out.stdout + out.stderr
    assert "preemption_exit_code=300" in exit_code and "0..255" in exit_code, out.stdout


@pytest.mark.extended
@pytest.mark.reference
@pytest.mark.parametrize("layout", ["tp", "pp", "dp2_tp2"])
def test_torchtitan_tp_and_pp_killed_and_resumed_end_where_torchtitans_own_resume_does(
    tt_python, assets, layout, tmp_path
):
    """Tensor parallel (dp_shard 1 x tp 2: every weight a DTensor sharded by TP),
    pipeline parallel (pp 2: each rank holds its own stages' plain tensors) and 4 ranks
    (dp_shard 2 x tp 2: FSDP2 and TP on a 2-D mesh, two dataloader positions): the job
    checkpointed through stepvault, SIGKILLed after its step-6 commit and resumed, ends
    with every rank's shards, AdamW moments, lr, data position and step bitwise equal to
    the same job under torchtitan's own DCP checkpointer, SIGKILLed after its step-6
    folder and resumed."""
    opts, nproc = LAYOUTS[layout], NPROC.get(layout, 2)
    dump, out = tmp_path / "sv", tmp_path / "sv-out"
    root = dump / "checkpoint"
    steps, code = kill_job_when_saved(
        _job(tt_python, assets, dump, out, *opts, "--stall-after", "7", nproc=nproc),
        root,
        RUN,
        min_step=6,
        timeout=600,
    )
    assert code != 0 and steps == [3, 6]
    assert stepvault.open(root).manifest(RUN, 6).sharded  # each rank wrote its own part
    run_job(_job(tt_python, assets, dump, out, *opts, nproc=nproc), timeout=600)
    got = _ranks(out, nproc)
    assert [(r["resumed"], r["skipped"], r["first_step"]) for r in got] == [(6, [], 7)] * nproc

    own, own_out = tmp_path / "own", tmp_path / "own-out"
    job = _job(tt_python, assets, own, own_out, *opts, "--checkpointer", "dcp", nproc=nproc)
    committed = own / "checkpoint/step-6/.metadata"
    assert _killed_after([*job, "--stall-after", "7"], committed, own_out, nproc)
    run_job(job, timeout=600)
    want = _ranks(own_out, nproc)
    assert [r["first_step"] for r in want] == [7] * nproc
    assert all(r["moments"] > 0 for r in want)
    for rank in range(nproc):
        assert not _same(got[rank], want[rank]), f"rank {rank}: {_same(got[rank], want[rank])}"


@pytest.mark.extended
def test_torchtitan_sigterm_to_every_rank_saves_once_exits_143_and_resumes_bitwise(
    tt_python, assets, reference, tmp_path
):
    """A preemption notice: SIGTERM to torchrun and both ranks while they are in step 8
    (a step interval=3 would not save at). Each rank finishes the step, the ranks write
    one collective checkpoint of step 8 and exit with 143 (stepvault's OnSignal); started
    again, they resume from 8 and end bitwise where the uninterrupted job does."""
    dump, out = tmp_path / "job", tmp_path / "out"
    root = dump / "checkpoint"
    proc = subprocess.Popen(
        _job(tt_python, assets, dump, out, "--stall-after", "7"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 600
        while not all((out / f"stalled{r}").exists() for r in range(2)):
            assert proc.poll() is None, f"the job ended before the signal: {proc.stderr.read()}"
            assert time.time() < deadline, "the job did not reach step 8 in time"
            time.sleep(0.2)
        kill_job(proc.pid, signal.SIGTERM)  # torchrun forwards it too: both ways, once
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            kill_job(proc.pid)
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()
    assert [(out / f"exit{r}").read_text() for r in range(2)] == ["143", "143"]
    assert stepvault.open(root).steps(RUN) == [3, 6, 8]
    assert not (out / "rank0.json").exists()

    run_job(_job(tt_python, assets, dump, out), timeout=600)
    got, want = _ranks(out), _ranks(reference / "out")
    assert [(r["resumed"], r["first_step"]) for r in got] == [(8, 9)] * 2
    for rank in range(2):
        assert not _same(got[rank], want[rank]), f"rank {rank}: {_same(got[rank], want[rank])}"


@pytest.mark.extended
def test_torchtitan_fsdp_checkpoint_into_tensor_parallel_refuses_the_data_then_reshards(
    tt_python, assets, reference, tmp_path
):
    """The FSDP2 job's checkpoint (2 data-parallel ranks) resumed by the same job laid out
    as tensor parallel (1 data-parallel rank): the dataloader position is per dp rank, so
    the resume is refused, saying why and what to do; with ``dataloader`` excluded from
    loading (what the refusal names) the weights and optimizer reshard from FSDP2's row
    shards to TP's layout, and the full weights equal the FSDP2 job's, bitwise."""
    dump = tmp_path / "tp"
    shutil.copytree(reference / "checkpoint", dump / "checkpoint")
    out = tmp_path / "out"
    proc = subprocess.run(
        _job(tt_python, assets, dump, out, *LAYOUTS["tp"]),
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert proc.returncode != 0
    assert "data-parallel" in proc.stderr and "exclude_from_loading" in proc.stderr, proc.stderr[
        -3000:
    ]
    assert not (out / "rank0.json").exists()

    # At step 12 of 12 the loop has nothing left to run: the end state is the loaded one.
    opts = [*LAYOUTS["tp"], "--checkpoint.exclude_from_loading", "dataloader", "--full-weights"]
    run_job(_job(tt_python, assets, dump, out, *opts), timeout=600)
    assert [r["resumed"] for r in _ranks(out)] == [12, 12]
    got = safetensors.torch.load_file(str(out / "weights.safetensors"))
    want = safetensors.torch.load_file(str(reference / "out" / "weights.safetensors"))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.extended
def test_torchtitan_checkpoint_exports_to_safetensors(reference, tmp_path):
    """``stepvault export`` of the FSDP2 job's last checkpoint (its model shards of two
    ranks, joined one tensor at a time) holds the job's full weights bitwise, under
    torchtitan's names."""
    target = tmp_path / "llama3.safetensors"
    stepvault.ops.export_weights(
        Store.open(reference / "checkpoint"), RUN, 12, target, module="model"
    )
    got = safetensors.torch.load_file(str(target))
    want = safetensors.torch.load_file(str(reference / "out" / "weights.safetensors"))
    assert sorted(got) == sorted(want) and len(want) > 10
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.extended
def test_torchtitan_checkpoint_exports_a_hugging_face_folder_from_pretrained_loads(
    tt_python, reference, tmp_path
):
    """``export_hf`` with torchtitan's own llama3 state-dict adapter: the FSDP2 job's last
    checkpoint becomes a Hugging Face folder that ``LlamaForCausalLM.from_pretrained``
    loads with no missing or unexpected key, each tensor bitwise the job's full weights
    mapped by the adapter (names, q/k permutation). The export runs in the torchtitan
    environment; ``from_pretrained`` here (transformers cannot share that environment)."""
    transformers = pytest.importorskip("transformers")
    folder, expected = tmp_path / "hf", tmp_path / "expected.safetensors"
    subprocess.run(
        [
            str(tt_python),
            str(SCRIPTS / "torchtitan_export_hf.py"),
            str(reference / "checkpoint"),
            RUN,
            "12",
            str(folder),
            str(reference / "out" / "weights.safetensors"),
            str(expected),
        ],
        check=True,
        env=ENV,
        timeout=600,
    )
    model, info = transformers.LlamaForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    got, want = model.state_dict(), safetensors.torch.load_file(str(expected))
    assert sorted(got) == sorted(want) and "model.layers.5.self_attn.q_proj.weight" in want
    assert all(torch.equal(got[k], want[k]) for k in want)
