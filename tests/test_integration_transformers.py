"""Hugging Face Trainer integration, tested with a real Trainer on a tiny GPT-2 (CPU)."""

from __future__ import annotations

import os
import warnings

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from helpers import final_digest, same_weights  # noqa: E402
from integration_util import (  # noqa: E402
    damage_newest,
    first_saves_asynchronous,
    kill_when_saved,
    run_example,
    run_example_here,
)
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    TrainerCallback,
    TrainingArguments,
)

import stepvault  # noqa: E402
from stepvault import Every, KeepBest, KeepLast  # noqa: E402
from stepvault.integrations.transformers import StepvaultCallback, StepvaultTrainer  # noqa: E402

#: one_thread (tests/conftest.py): tiny models are faster, and steadier, on one thread
pytestmark = pytest.mark.usefixtures("one_thread")


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 64, (40, 16), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def _train(tmp_path, root, *, stop=None, resume=None, save="policy", **args):
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    options = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=15,
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
    options.update(args)
    policy = Every(steps=4) if save == "policy" else None
    ckpt = StepvaultCallback(root, run="gpt", save=policy, keep=KeepLast(2))
    trainer = StepvaultTrainer(
        model=model,
        args=TrainingArguments(**options),
        train_dataset=Tokens(),
        callbacks=[ckpt] + ([StopAt(stop)] if stop else []),
    )
    trainer.train(resume_from_checkpoint=resume)
    return model, ckpt, trainer


def test_stop_and_resume_is_bitwise_equal(tmp_path):
    reference, _, _ = _train(tmp_path, tmp_path / "ref")
    _, first, _ = _train(tmp_path, tmp_path / "s", stop=9)
    assert first.has_checkpoint and stepvault.open(tmp_path / "s").steps("gpt") == [4, 8]
    resumed, ckpt, trainer = _train(tmp_path, tmp_path / "s", resume=True)
    assert ckpt.last_restore.step == 8
    assert same_weights(reference, resumed)
    assert trainer.state.global_step == 15
    # The restored TrainerState carried the log history of the first 8 steps.
    assert [e["step"] for e in trainer.state.log_history if "loss" in e][:8] == list(range(1, 9))
    vault = stepvault.open(tmp_path / "s")
    assert vault.steps("gpt") == [8, 12]  # KeepLast(2)
    ckpt12 = vault.checkpoint("gpt", 12)
    assert "loss" in ckpt12.metrics and "learning_rate" in ckpt12.metrics
    assert ckpt12.metadata["model_config"]["n_layer"] == 2
    assert not [d for d in os.listdir(tmp_path / "out") if d.startswith("checkpoint-")]
    # The staging was prepared at train start (and again after a fresh Adam's first step):
    # the first save of the fresh run (4) and of the resumed one (12) only copied.
    assert first_saves_asynchronous(tmp_path / "s", "gpt") == {4: True, 8: True, 12: True}


def test_resume_falls_back_past_a_damaged_checkpoint(tmp_path):
    _train(tmp_path, tmp_path / "s", stop=9)
    assert damage_newest(tmp_path / "s", "gpt") == 8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, ckpt, trainer = _train(tmp_path, tmp_path / "s", resume=True)
    assert ckpt.last_restore.step == 4
    assert [s.step for s in ckpt.last_restore.skipped] == [8]
    assert any("skipped damaged checkpoint gpt@8" in str(w.message) for w in caught)
    assert trainer.state.global_step == 15


def test_without_a_policy_the_save_strategy_decides(tmp_path):
    _train(tmp_path, tmp_path / "s", save=None, save_strategy="steps", save_steps=5)
    assert stepvault.open(tmp_path / "s").steps("gpt") == [10, 15]  # 5 was dropped by KeepLast
    assert first_saves_asynchronous(tmp_path / "s", "gpt") == {5: True, 10: True, 15: True}
    assert not [d for d in os.listdir(tmp_path / "out") if d.startswith("checkpoint-")]


def test_eval_metrics_are_checkpoint_metrics_for_keep_best(tmp_path):
    class Record(TrainerCallback):
        def __init__(self) -> None:
            self.seen: dict[int, float] = {}

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            self.seen[state.global_step] = metrics["eval_loss"]

    record = Record()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    ckpt = StepvaultCallback(
        tmp_path / "s",
        run="gpt",
        save=Every(steps=3),
        keep=KeepBest(1, metric="eval_loss", mode="max") | KeepLast(1),
    )
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=12,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        report_to=[],
        use_cpu=True,
        eval_strategy="steps",
        eval_steps=3,
        logging_steps=3,
        disable_tqdm=True,
        seed=0,
    )
    trainer = StepvaultTrainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=Tokens(),
        eval_dataset=Tokens(),
        callbacks=[ckpt, record],
    )
    trainer.train()
    assert sorted(record.seen) == [3, 6, 9, 12]
    # mode="max" (the *worst* loss) so that the kept step is not simply the last one, which
    # it would be here since the eval loss keeps falling.
    best = max(record.seen, key=lambda step: (record.seen[step], step))
    assert best != 12
    summaries = {c.step: c for c in stepvault.open(tmp_path / "s").checkpoints("gpt")}
    assert set(summaries) == {best, 12}
    assert summaries[best].metrics["eval_loss"] == pytest.approx(record.seen[best])


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="No valid checkpoint found in stepvault run 'gpt'"):
        _train(tmp_path, tmp_path / "s", resume=True)


@pytest.mark.slow
def test_example_killed_with_sigkill_resumes_to_the_same_weights(tmp_path):
    args = ["--run", "hf", "--max-steps", "24", "--save-every", "6"]
    here = run_example_here("hf_trainer.py", "--root", str(tmp_path / "a"), *args)
    reference = final_digest(here)
    root = tmp_path / "b"
    steps = kill_when_saved(
        "hf_trainer.py",
        root,
        "hf",
        "--root",
        str(root),
        *args,
        "--step-sleep",
        "0.05",
        min_step=12,
    )
    assert steps and steps[-1] < 24
    out = run_example("hf_trainer.py", "--root", str(root), *args)
    assert f"RESUMED {steps[-1]}" in out
    assert final_digest(out) == reference
    assert stepvault.ops.verify(root, deep=True).ok
