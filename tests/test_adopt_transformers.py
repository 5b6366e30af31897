"""Adopting a Hugging Face Trainer run: a ``checkpoint-N`` folder written by the real Trainer
(tiny GPT-2 with tied embeddings, built from a local config; nothing downloaded) is imported
with the real ``stepvault import`` command, then training continues through
``StepvaultTrainer(...).train(resume_from_checkpoint=True)``.

What is compared: after M more steps, the model's weights (every state-dict tensor), the
optimizer's state and the logged losses of the continued steps are bitwise equal to the
Trainer's own resume from the same ``checkpoint-N`` folder (whose resume is itself exact on
CPU: same weights, optimizer, scheduler, RNG and data position).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import torch  # noqa: E402
from helpers import same_weights  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

import stepvault  # noqa: E402
from stepvault.integrations.transformers import StepvaultCallback, StepvaultTrainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

N, TOTAL = 4, 8  # the Trainer saves checkpoint-4; both resumes train on to step 8


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 64, (40, 16), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _tokenizer() -> PreTrainedTokenizerFast:
    """A 64-token word-level tokenizer built in memory (the files a real one saves)."""
    vocab = {f"w{i}": i for i in range(63)} | {"<unk>": 63}
    model = tokenizers.models.WordLevel(vocab, unk_token="<unk>")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="w0")


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )  # tie_word_embeddings: True (GPT-2's default)
    return GPT2LMHeadModel(config)


def _args(out, **extra) -> TrainingArguments:
    options = dict(
        output_dir=str(out),
        max_steps=TOTAL,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        warmup_steps=2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    return TrainingArguments(**(options | extra))


def _losses(trainer) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """The Trainer's run (checkpoint-4 and -8 folders) and its own resume from checkpoint-4."""
    transformers.logging.set_verbosity_error()
    out = tmp_path_factory.mktemp("hf-out")
    trainer = Trainer(
        model=_model(),
        args=_args(out, save_strategy="steps", save_steps=N),
        train_dataset=Tokens(),
        processing_class=_tokenizer(),  # saved in the folder: tokenizer.json...
        data_collator=transformers.default_data_collator,  # the one the others use
    )
    trainer.train()
    folder = out / f"checkpoint-{N}"
    resumed = Trainer(
        model=_model(),
        args=_args(tmp_path_factory.mktemp("hf-resume")),
        train_dataset=Tokens(),
    )
    resumed.train(resume_from_checkpoint=str(folder))
    return folder, resumed


def _import(root, folder, *args):
    """``stepvault --root ROOT import FOLDER --run hf ...`` in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "stepvault.cli.main", "--root", str(root), "import",
         str(folder), "--run", "hf", *args],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip


def _continue(tmp_path, root, resume=True, every=N):
    save = stepvault.Every(steps=every) if every else None  # None: save_strategy "no"
    ckpt = StepvaultCallback(root, run="hf", save=save)
    trainer = StepvaultTrainer(
        model=_model(), args=_args(tmp_path / "out"), train_dataset=Tokens(), callbacks=[ckpt]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=resume)
    ours = [str(w.message) for w in caught if "stepvault" in str(w.message)]
    return trainer, ckpt, ours


def test_imported_trainer_checkpoint_continues_like_the_trainers_own_resume(hf_run, tmp_path):
    folder, reference = hf_run
    from safetensors.torch import load_file

    assert "lm_head.weight" not in load_file(folder / "model.safetensors")  # tied: written once
    root = tmp_path / "store"
    res = _import(root, folder, "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["step"] == N and report["missing"] == {}
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert name in report["attachments"]

    ckpt = stepvault.open(root).checkpoint(f"hf@{N}")
    history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    logged = next(e for e in history if e.get("step") == N and "loss" in e)
    assert ckpt.metrics["loss"] == logged["loss"]
    assert ckpt.metrics["learning_rate"] == logged["learning_rate"]

    trainer, cb, warned = _continue(tmp_path, root)
    assert cb.last_restore.step == N and warned == []
    assert trainer.state.global_step == TOTAL
    assert same_weights(reference.model, trainer.model)  # bitwise, every tensor
    # Still tied after the restore: one tensor under both names.
    assert trainer.model.lm_head.weight is trainer.model.transformer.wte.weight
    ref_opt, opt = reference.optimizer.state_dict(), trainer.optimizer.state_dict()
    assert ref_opt["param_groups"] == opt["param_groups"]
    for i, state in ref_opt["state"].items():
        assert all(torch.equal(state[k], opt["state"][i][k]) for k in state)
    # The continued steps logged the same losses, bitwise; the first N came from the import.
    assert _losses(trainer) == _losses(reference)
    assert sorted(_losses(trainer)) == list(range(1, TOTAL + 1))
    # The StepvaultTrainer's own checkpoint of step 8 is in the same run.
    assert stepvault.open(root).steps("hf") == [N, TOTAL]

    # Also through a plain restore: the tied lm_head.weight is not required (strict).
    reference_wte = load_file(folder / "model.safetensors")["transformer.wte.weight"]
    model = _model()
    stepvault.restore(root, {"model": model}, run="hf", step=N, strict=False)
    assert torch.equal(model.lm_head.weight, reference_wte)
    model = _model()
    holder = {"model": model} | dict.fromkeys(["optimizer", "scheduler", "rng", "trainer_state"])
    stepvault.restore(root, holder, run="hf", step=N)
    assert model.lm_head.weight is model.transformer.wte.weight
    model = _model()
    stepvault.restore(root, holder | {"model": model}, run="hf", step=N, assign=True)
    assert model.lm_head.weight is model.transformer.wte.weight  # assign= keeps the tie
    assert torch.equal(model.lm_head.weight, reference_wte)


def test_export_of_an_import_loads_with_from_pretrained(hf_run, tmp_path):
    folder, _ = hf_run
    root = tmp_path / "store"
    assert _import(root, folder).returncode == 0
    out = tmp_path / "exported"
    from typer.testing import CliRunner

    from stepvault.cli.main import app

    res = CliRunner().invoke(app, ["--root", str(root), "export", f"hf@{N}", "-o", str(out)])
    assert res.exit_code == 0, res.output
    model = AutoModelForCausalLM.from_pretrained(out)
    original = AutoModelForCausalLM.from_pretrained(folder)
    assert same_weights(original, model)
    assert model.lm_head.weight is model.transformer.wte.weight
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("w1 w2 w3")["input_ids"] == [1, 2, 3]
    assert model.generation_config.eos_token_id == 0


def test_incomplete_folder_is_reported_and_its_resume_warns(hf_run, tmp_path):
    folder, _ = hf_run
    partial = tmp_path / f"checkpoint-{N}"
    shutil.copytree(folder, partial)
    (partial / "optimizer.pt").unlink()
    (partial / "rng_state.pth").unlink()
    root = tmp_path / "store"
    res = _import(root, partial)
    assert res.returncode == 0, res.stderr
    assert f"missing optimizer: no optimizer.pt in checkpoint-{N}" in res.stdout
    assert f"missing rng: no rng_state.pth in checkpoint-{N}" in res.stdout
    report = json.loads(_import(root, partial, "--json", "--overwrite").stdout)
    assert report["missing"] == {
        "optimizer": f"no optimizer.pt in checkpoint-{N}",
        "rng": f"no rng_state.pth in checkpoint-{N}",
    }
    missing = stepvault.open(root).checkpoint(f"hf@{N}").metadata["missing"]
    assert set(missing) == {"optimizer", "rng"}

    trainer, _, warned = _continue(tmp_path, root)
    assert trainer.state.global_step == TOTAL
    assert len(warned) == 1, warned
    assert f"hf@{N}" in warned[0] and str(partial) in warned[0]
    assert "optimizer (no optimizer.pt" in warned[0] and "rng (no rng_state.pth" in warned[0]
    assert "scheduler" not in warned[0]


def test_output_dir_import_continues_from_a_chosen_step(hf_run, tmp_path):
    folder, reference = hf_run
    root = tmp_path / "store"
    res = _import(root, folder.parent, "--json")  # the output_dir: checkpoint-4 and -8
    assert res.returncode == 0, res.stderr
    assert [r["step"] for r in json.loads(res.stdout)] == [N, TOTAL]
    vault = stepvault.open(root)
    history = json.loads((folder.parent / f"checkpoint-{TOTAL}" / "trainer_state.json").read_text())
    for step in (N, TOTAL):
        logged = next(e for e in history["log_history"] if e.get("step") == step and "loss" in e)
        assert vault.checkpoint("hf", step).metrics["loss"] == logged["loss"]
    # resume_from_checkpoint=<int>: exactly that step of the imported run.
    trainer, cb, warned = _continue(tmp_path, root, resume=N, every=None)
    assert cb.last_restore.step == N and warned == []
    assert same_weights(reference.model, trainer.model)
