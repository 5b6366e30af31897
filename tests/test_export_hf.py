"""Deployable exports (issue 19): a real HF Trainer run becomes a folder that transformers'
own loaders (from_pretrained, AutoTokenizer, pipeline) load without a warning."""

from __future__ import annotations

import json
import logging
import os
import warnings

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch  # noqa: E402
from helpers import cli  # noqa: E402
from safetensors import safe_open  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    TrainingArguments,
)

import stepvault  # noqa: E402
from stepvault import Every  # noqa: E402
from stepvault.integrations._attachments import transformers_files  # noqa: E402
from stepvault.integrations.transformers import StepvaultCallback, StepvaultTrainer  # noqa: E402

WORDS = [f"w{i}" for i in range(56)]
SPECIAL = ["[UNK]", "[PAD]", "[BOS]", "[EOS]", "[CLS]", "[SEP]", "[MASK]"]


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer built here with `tokenizers` (nothing downloaded)."""
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


class Sentences(torch.utils.data.Dataset):
    def __init__(self, tokenizer) -> None:
        g = torch.Generator().manual_seed(0)
        idx = torch.randint(0, len(WORDS), (24, 12), generator=g)
        texts = [" ".join(WORDS[i] for i in row) for row in idx.tolist()]
        self.ids = tokenizer(texts, return_tensors="pt")["input_ids"]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=2,
        eos_token_id=3, pad_token_id=1,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def bert() -> BertForMaskedLM:
    config = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16, pad_token_id=1,
    )  # fmt: skip
    return BertForMaskedLM(config)


def train(root, make_model, run: str, steps: int = 4):
    torch.manual_seed(0)
    tokenizer = make_tokenizer()
    model = make_model()
    args = TrainingArguments(
        output_dir=str(root) + "-out",
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    ckpt = StepvaultCallback(root, run=run, save=Every(steps=steps), async_save=False)
    trainer = StepvaultTrainer(
        model=model,
        args=args,
        train_dataset=Sentences(tokenizer),
        processing_class=tokenizer,
        callbacks=[ckpt],
    )
    trainer.train()
    return model.eval(), tokenizer


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record) -> None:
        self.records.append(record.getMessage())


def load_quietly(load, *args, **kwargs):
    """Call a transformers loader; return its result and every warning/log it emitted."""
    handler = Captured()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = load(*args, **kwargs)
    finally:
        logger.removeHandler(handler)
    return result, handler.records + [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf") / "store"
    model, tokenizer = train(root, gpt2, "gpt")
    return root, model, tokenizer


def _ids(tokenizer):
    return tokenizer(["w1 w2 w3 w4 w5"], return_tensors="pt")["input_ids"]


def test_gpt2_export_loads_with_no_warnings_and_same_logits(gpt_run, tmp_path):
    root, model, tokenizer = gpt_run
    out = tmp_path / "gpt-export"
    res = cli(root, "export", "gpt@4", "-o", str(out))  # hf: the default, config attached
    assert res.exit_code == 0, res.output
    files = sorted(os.listdir(out))
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        assert name in files
    assert "generation_config.json" in files and "stepvault-export.json" in files
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    loaded, messages = load_quietly(AutoModelForCausalLM.from_pretrained, out)
    assert messages == []
    tok, messages = load_quietly(AutoTokenizer.from_pretrained, out)
    assert messages == []
    ids = _ids(tokenizer)
    assert torch.equal(tok(["w1 w2 w3 w4 w5"], return_tensors="pt")["input_ids"], ids)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)  # bitwise


def test_tied_embeddings_are_left_out_and_reload_tied(gpt_run, tmp_path):
    root, model, _ = gpt_run
    out = tmp_path / "tied"
    assert cli(root, "export", "gpt@4", "-o", str(out), "--format", "hf").exit_code == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_bfloat16_export_sharded_with_index_and_close_logits(gpt_run, tmp_path):
    root, model, tokenizer = gpt_run
    out = tmp_path / "bf16"
    res = cli(
        root, "export", "gpt@4", "-o", str(out), "--dtype", "bfloat16", "--max-shard-size", "20KB"
    )
    assert res.exit_code == 0, res.output
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded, messages = load_quietly(AutoModelForCausalLM.from_pretrained, out)
    assert messages == []
    assert loaded.transformer.wte.weight.dtype == torch.bfloat16
    ids = _ids(tokenizer)
    with torch.no_grad():
        got = loaded.eval()(ids).logits.float()
        want = model(ids).logits
    assert torch.allclose(got, want, atol=0.1, rtol=0.05)
    assert (got - want).abs().max() > 0  # it really was cast


def test_pipeline_text_generation_runs_from_the_folder(gpt_run, tmp_path):
    root, _, _ = gpt_run
    out = tmp_path / "pipe"
    assert cli(root, "export", "gpt@4", "-o", str(out)).exit_code == 0
    generate = transformers.pipeline("text-generation", model=str(out), device="cpu")
    text = generate("w1 w2", max_new_tokens=3, do_sample=False)[0]["generated_text"]
    assert text.startswith("w1 w2") and len(text.split()) >= 3


def test_model_card_names_the_provenance(gpt_run, tmp_path):
    root, _, _ = gpt_run
    out = tmp_path / "card"
    assert cli(root, "export", "gpt@4", "-o", str(out)).exit_code == 0
    card = (out / "README.md").read_text()
    record = json.loads((out / "stepvault-export.json").read_text())
    assert "`gpt@4`" in card and record["source"]["manifest_blake3"] in card
    assert "loss=" in card and "code commit" in card and "data fingerprint" in card
    assert card.startswith("---\nlibrary_name: transformers")


def test_verify_export_catches_a_changed_byte_and_registry_hashes(gpt_run, tmp_path):
    root, _, _ = gpt_run
    out = tmp_path / "deployed"
    res = cli(root, "register", "tiny-gpt", "gpt@4", "--export", str(out))
    assert res.exit_code == 0, res.output
    assert cli(root, "verify-export", str(out)).exit_code == 0
    ok = cli(root, "verify-export", str(out), "--model", "tiny-gpt")
    assert ok.exit_code == 0, ok.output
    assert "registry" in ok.output
    path = out / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    bad = cli(root, "verify-export", str(out))
    assert bad.exit_code == 1
    assert "model.safetensors: content changed" in " ".join(bad.output.split())
    # Re-writing the folder's own record does not fool a check against the registry.
    record = json.loads((out / "stepvault-export.json").read_text())
    from stepvault.ops.export_hf import file_blake3

    for f in record["files"]:
        f["blake3"] = file_blake3(out / f["path"])
    (out / "stepvault-export.json").write_text(json.dumps(record))
    assert cli(root, "verify-export", str(out)).exit_code == 0
    assert cli(root, "verify-export", str(out), "--model", "tiny-gpt@v1").exit_code == 1


def test_promote_with_export_records_the_files(gpt_run, tmp_path):
    root, _, _ = gpt_run
    out = tmp_path / "stable"
    res = cli(root, "promote", "tiny-gpt2", "gpt@4", "--alias", "stable", "--export", str(out))
    assert res.exit_code == 0, res.output
    from stepvault.registry import Registry

    version = Registry(str(root)).resolve("tiny-gpt2@stable")
    names = {f["name"] for f in version.export["files"]}
    assert {"config.json", "model.safetensors", "stepvault-export.json"} <= names
    assert version.export["options"]["format"] == "hf"
    assert cli(root, "verify-export", str(out), "--model", "tiny-gpt2@stable").exit_code == 0


def test_bert_export_round_trip(tmp_path):
    root = tmp_path / "store"
    model, tokenizer = train(root, bert, "bert", steps=2)
    out = tmp_path / "bert-export"
    res = cli(root, "export", "bert@2", "-o", str(out))
    assert res.exit_code == 0, res.output
    loaded, messages = load_quietly(AutoModelForMaskedLM.from_pretrained, out)
    assert messages == []
    tok, messages = load_quietly(AutoTokenizer.from_pretrained, out)
    assert messages == []
    ids = tok(["w1 w2 [MASK] w4"], return_tensors="pt")["input_ids"]
    assert torch.equal(ids, tokenizer(["w1 w2 [MASK] w4"], return_tensors="pt")["input_ids"])
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)
    decoder = loaded.cls.predictions.decoder.weight
    assert decoder.data_ptr() == loaded.bert.embeddings.word_embeddings.weight.data_ptr()


def test_untied_head_is_kept_and_reloads_untied(tmp_path):
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, bos_token_id=2,
        eos_token_id=3, tie_word_embeddings=False,
    )  # fmt: skip
    model = GPT2LMHeadModel(config).eval()
    root = tmp_path / "s"
    stepvault.save(root, {"model": model}, run="u", step=1, attachments=transformers_files(model))
    out = tmp_path / "out"
    assert cli(root, "export", "u@1", "-o", str(out)).exit_code == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in set(f.keys())
    loaded, messages = load_quietly(AutoModelForCausalLM.from_pretrained, out)
    assert messages == []
    assert loaded.lm_head.weight.data_ptr() != loaded.transformer.wte.weight.data_ptr()
    ids = torch.tensor([[4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)


class _Holder(torch.nn.Module):
    """A module holding a transformers model, as a LightningModule does (``self.net``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.head = torch.nn.Linear(2, 2)  # not the model's: left out by the prefix
        self.net = model


def test_config_given_at_export_a_path_or_the_module_holding_the_model(tmp_path):
    from stepvault.errors import ExportError
    from stepvault.ops.export_hf import export_checkpoint
    from stepvault.store import Store

    torch.manual_seed(0)
    model = gpt2().eval()
    holder = _Holder(model)
    root = tmp_path / "s"
    stepvault.save(root, {"model": holder}, run="h", step=1)  # no config.json attached
    store = Store.open(root)
    ids = torch.tensor([[4, 5, 6, 7]])
    with torch.no_grad():
        want = model(ids).logits

    # the holder itself: its PreTrainedModel's config (architectures set) and prefix "net."
    report = export_checkpoint(store, "h", 1, tmp_path / "a", config=holder)
    assert report.format == "hf" and report.tied == {"lm_head.weight": "transformer.wte.weight"}
    loaded, messages = load_quietly(AutoModelForCausalLM.from_pretrained, tmp_path / "a")
    assert messages == []  # no missing or unexpected weight (the holder's head left out)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, want)

    # the CLI: a folder save_pretrained wrote, and the prefix by hand
    model.save_pretrained(tmp_path / "cfg")
    out = tmp_path / "b"
    done = cli(root, "export", "h@1", "-o", str(out), "--config", str(tmp_path / "cfg"),
               "--strip-prefix", "net.", "--include", "^net\\.")  # fmt: skip
    assert done.exit_code == 0, done.output
    loaded, messages = load_quietly(AutoModelForCausalLM.from_pretrained, out)
    assert messages == []
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, want)

    # what cannot work says why and what to give instead; nothing is written
    with pytest.raises(ExportError, match="no such file"):
        export_checkpoint(store, "h", 1, tmp_path / "c", config=tmp_path / "missing")
    with pytest.raises(ExportError, match="holds no transformers PreTrainedModel"):
        export_checkpoint(store, "h", 1, tmp_path / "c", config=torch.nn.Linear(2, 2))
    with pytest.raises(ExportError, match="does not apply to format 'safetensors'"):
        export_checkpoint(store, "h", 1, tmp_path / "c", format="safetensors", config=holder)
    assert not (tmp_path / "c").exists()


def test_a_failed_export_leaves_no_file_under_its_name(gpt_run, tmp_path):
    """The streamed writer writes beside the final name and renames at the end."""
    from stepvault.ops.export import export_weights
    from stepvault.store import Store

    out = tmp_path / "w.safetensors"

    def fail_midway(done: int, total: int | None) -> None:
        if done > (total or 0) // 2:
            raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        export_weights(Store.open(gpt_run[0]), "gpt", None, out, progress=fail_midway)
    assert list(tmp_path.iterdir()) == []
