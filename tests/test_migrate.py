"""Migration of existing checkpoints: HF Trainer folders, Lightning .ckpt, torch/safetensors files.

Every input is made by the real library (torch.save, safetensors, a real Lightning Trainer, a
real transformers Trainer); every imported tensor must come back bitwise.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import stepvault
from stepvault.cli.main import app
from stepvault.errors import UntrustedInputError
from stepvault.ops.migrate import (
    detect_format,
    hf_rng_to_stepvault,
    import_checkpoint,
    to_lightning_checkpoint,
)


def by_name(sd):
    """A state dict in name order (safetensors files keep their own order)."""
    return dict(sorted(sd.items()))


def assert_same(a, b, path="root"):
    """Deep equality; tensors and arrays bitwise (dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        a8 = a.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a8, b.detach().contiguous().reshape(-1).view(torch.uint8)), path
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{path}: {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert type(a) is type(b) and (a == b or (a != a and b != b)), f"{path}: {a!r} != {b!r}"


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


# --------------------------------------------------------------------------- torch files


def _odd_tensors():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 7, generator=g)
    w[0, 0] = float("nan")
    w[0, 1] = -0.0
    return {
        "fc.weight": w,
        "fc.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "emb.weight": torch.randn(11, 3, generator=g).to(torch.float16),
        "q.codes": torch.randint(-128, 127, (9,), dtype=torch.int8, generator=g),
        "mask": torch.rand(4, generator=g) > 0.5,
        "count": torch.tensor(7, dtype=torch.int64),
    }


def test_state_dict_file_round_trips_bitwise(tmp_path):
    sd = _odd_tensors()
    torch.save(sd, tmp_path / "weights.pt")
    root = tmp_path / "store"
    report = import_checkpoint(root, tmp_path / "weights.pt", run="old", step=12)
    assert (report.format, report.step, report.entries) == ("torch", 12, {"model": "module"})
    ckpt = stepvault.open(root).checkpoint("old@12")
    assert_same(sd, ckpt.load()["model"])
    assert torch.equal(ckpt.tensor("model/emb.weight"), sd["emb.weight"])  # lazy read
    assert stepvault.ops.verify(root, deep=True).ok


def test_dict_of_state_dicts_restores_into_live_objects(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
    saved = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "step": 120,
        "epoch": 3,
        "extra": {"hist": np.arange(5, dtype=np.float32), "best": 0.25, "name": "exp"},
    }
    torch.save(saved, tmp_path / "train.pth")
    root = tmp_path / "store"
    report = import_checkpoint(root, tmp_path / "train.pth", run="old")
    assert report.step == 120  # from the file's "step"
    assert report.entries == {
        "model": "module",
        "optimizer": "optimizer",
        "scheduler": "stateful",
        "step": "value",
        "epoch": "value",
        "extra": "stateful",
    }
    assert stepvault.open(root).checkpoint("old@120").epoch == 3

    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2)
    live = {
        "model": model2,
        "optimizer": opt2,
        "scheduler": sched2,
        "step": 0,
        "epoch": 0,
        "extra": {},
    }
    info = stepvault.restore(root, live, run="old")
    assert info.step == 120 and live["step"] == 120
    assert_same(model.state_dict(), model2.state_dict())
    assert_same(opt.state_dict(), opt2.state_dict())
    assert_same(sched.state_dict(), sched2.state_dict())
    assert_same(saved["extra"], live["extra"])


def _touch_marker(path):
    """What the hostile pickle below runs when (and only when) it is fully unpickled."""
    with open(path, "w") as f:
        f.write("code from the file ran")
    return {"w": torch.ones(2)}


class _Hostile:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (_touch_marker, (self.marker,))


def test_arbitrary_pickle_is_refused_without_trust_and_never_runs(tmp_path):
    marker = tmp_path / "marker"
    src = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "payload": _Hostile(str(marker))}, src)
    root = tmp_path / "store"

    with pytest.raises(UntrustedInputError, match=r"_touch_marker.*trust=True"):
        import_checkpoint(root, src, run="r", step=1)
    res = cli("--root", root, "import", src, "--run", "r", "--step", "1")
    assert res.exit_code == 2 and "--trust" in res.output
    assert not marker.exists(), "the pickle's code ran without --trust"
    assert not root.exists(), "a refused import must not touch the store"

    # With explicit trust the file is really unpickled: the marker proves this test can fail.
    res = cli("--root", root, "import", src, "--run", "r", "--step", "1", "--trust")
    assert res.exit_code == 0, res.output
    assert marker.exists()
    assert_same(stepvault.open(root).checkpoint("r@1").load()["payload"], {"w": torch.ones(2)})


def test_whole_module_pickle_needs_trust_and_becomes_a_state_dict(tmp_path):
    model = torch.nn.Linear(3, 2)
    torch.save({"model": model, "step": 5}, tmp_path / "m.pt")
    root = tmp_path / "store"
    with pytest.raises(UntrustedInputError, match=r"torch\.nn\.modules\.linear\.Linear"):
        import_checkpoint(root, tmp_path / "m.pt", run="r")
    report = import_checkpoint(root, tmp_path / "m.pt", run="r", trust=True)
    assert report.step == 5 and report.entries["model"] == "module"
    assert_same(dict(model.state_dict()), stepvault.open(root).checkpoint("r@5").load()["model"])


def test_safetensors_file_import_and_export_round_trip(tmp_path):
    sd = {k: v for k, v in _odd_tensors().items() if v.dim() > 0}
    save_file(sd, tmp_path / "w.safetensors")
    root = tmp_path / "store"
    res = cli("--root", root, "import", tmp_path / "w.safetensors", "--run", "w", "--step", "0")
    assert res.exit_code == 0, res.output
    out = tmp_path / "out.safetensors"
    assert cli("--root", root, "export", "w@0", "-o", out).exit_code == 0
    from safetensors.torch import load_file

    assert_same(by_name(sd), by_name(load_file(out)))


# --------------------------------------------------------------------------- Lightning


def test_real_lightning_checkpoint(tmp_path):
    lightning = pytest.importorskip("lightning")

    class Tiny(lightning.LightningModule):
        def __init__(self, hidden: int = 6):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Linear(hidden, 1))

        def training_step(self, batch, idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=1e-2)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1)]

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 3)), 4)
    trainer = lightning.Trainer(
        max_steps=6,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        accelerator="cpu",
        default_root_dir=tmp_path,
    )
    trainer.fit(Tiny(), data)
    ckpt_path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt_path)
    original = torch.load(ckpt_path, weights_only=True)

    root = tmp_path / "store"
    assert detect_format(ckpt_path) == "lightning"
    report = import_checkpoint(root, ckpt_path, run="lit")
    assert report.step == original["global_step"] == 6
    assert report.entries == {
        "model": "module",
        "optimizer": "optimizer",
        "scheduler": "stateful",
        "lightning": "value",
    }
    ckpt = stepvault.open(root).checkpoint("lit@6")
    assert ckpt.epoch == original["epoch"]
    tree = ckpt.load()
    assert_same(dict(original["state_dict"]), tree["model"])
    # Everything is there: Lightning's own dict comes back whole, bitwise.
    rebuilt = to_lightning_checkpoint(tree, ckpt.metadata["lightning_layout"])
    assert_same(
        {k: dict(v) if k == "state_dict" else v for k, v in original.items()},
        {k: rebuilt[k] for k in original},
    )

    # The same file under a .pt name is still recognised as Lightning.
    shutil.copy(ckpt_path, tmp_path / "renamed.pt")
    assert import_checkpoint(root, tmp_path / "renamed.pt", run="lit2").format == "lightning"


# --------------------------------------------------------------------------- Hugging Face


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """Real ``checkpoint-2`` and ``checkpoint-4`` folders of a transformers Trainer (tiny GPT-2)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    out = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=8,
        n_head=2,
        vocab_size=32,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
    )

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            ids = (torch.arange(8) * (i + 1)) % 32
            return {"input_ids": ids, "labels": ids}

    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=4,
        save_steps=2,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=2,
        seed=0,
    )
    trainer = transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=Tokens()
    )
    trainer.train()
    return out / "checkpoint-4", transformers, config


def test_real_hf_trainer_checkpoint(hf_checkpoint, tmp_path):
    folder, transformers, config = hf_checkpoint
    root = tmp_path / "store"
    res = cli("--root", root, "import", folder, "--run", "hf", "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["step"] == 4 and report["format"] == "hf"
    assert report["entries"] == {
        "model": "module",
        "optimizer": "optimizer",
        "scheduler": "stateful",
        "rng": "stateful",
        "trainer_state": "stateful",
    }
    skipped = {s["file"]: s["reason"] for s in report["skipped"]}
    assert "full pickle" in skipped["training_args.bin"]

    from safetensors.torch import load_file

    ckpt = stepvault.open(root).checkpoint("hf@4")
    tree = ckpt.load()
    assert_same(by_name(load_file(folder / "model.safetensors")), by_name(tree["model"]))
    assert_same(torch.load(folder / "optimizer.pt", weights_only=True), tree["optimizer"])
    assert_same(torch.load(folder / "scheduler.pt", weights_only=True), tree["scheduler"])
    assert_same(json.loads((folder / "trainer_state.json").read_text()), tree["trainer_state"])
    assert ckpt.metadata["config"]["n_embd"] == 8

    # Resume the Trainer's own objects from it: model, optimizer, scheduler and RNGs.
    trainer = transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config),
        args=transformers.TrainingArguments(
            output_dir=str(tmp_path / "o"), report_to=[], use_cpu=True, max_steps=4
        ),
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    rng = stepvault.RNGState()
    live = {
        "model": trainer.model,
        "optimizer": trainer.optimizer,
        "scheduler": trainer.lr_scheduler,
        "rng": rng,
        "trainer_state": {},
    }
    assert stepvault.restore(root, live, run="hf").step == 4
    assert_same(
        by_name(load_file(folder / "model.safetensors")), by_name(trainer.model.state_dict())
    )
    assert_same(
        torch.load(folder / "optimizer.pt", weights_only=True), trainer.optimizer.state_dict()
    )
    assert trainer.lr_scheduler.state_dict()["last_epoch"] == 4
    after_restore = (random.random(), np.random.rand(), torch.rand(3))
    from transformers.trainer_pt_utils import safe_globals

    with safe_globals():
        hf_rng = torch.load(folder / "rng_state.pth", weights_only=True)
    random.setstate(hf_rng["python"])
    np.random.set_state(hf_rng["numpy"])
    torch.set_rng_state(hf_rng["cpu"])
    assert_same(after_restore, (random.random(), np.random.rand(), torch.rand(3)))

    # With trust, training_args.bin is imported too, as plain values in the metadata.
    assert (
        cli("--root", root, "import", folder, "--run", "hf", "--step", "5", "--trust").exit_code
        == 0
    )
    args = stepvault.open(root).checkpoint("hf@5").metadata["training_args"]
    assert args["max_steps"] == 4 and args["per_device_train_batch_size"] == 4


def test_hf_output_dir_imports_every_checkpoint_in_step_order(hf_checkpoint, tmp_path):
    folder = hf_checkpoint[0]
    output_dir = folder.parent
    root = tmp_path / "store"
    res = cli("--root", root, "import", output_dir, "--run", "hf", "--step", "9")
    assert res.exit_code == 2 and "step= applies to one" in " ".join(res.output.split())
    with pytest.raises(stepvault.errors.StepvaultError, match="import_checkpoints"):
        import_checkpoint(root, output_dir, run="hf")  # the single-checkpoint API says so
    res = cli("--root", root, "import", output_dir, "--run", "hf", "--json")
    assert res.exit_code == 0, res.output
    assert [r["step"] for r in json.loads(res.output)] == [2, 4]
    vault = stepvault.open(root)
    assert vault.steps("hf") == [2, 4]
    assert vault.checkpoint("hf@4").manifest.parent_step == 2
    from safetensors.torch import load_file

    for step in (2, 4):
        expected = load_file(output_dir / f"checkpoint-{step}" / "model.safetensors")
        assert_same(by_name(expected), by_name(vault.checkpoint("hf", step).load()["model"]))


def test_hf_rng_layout_conversion_rejects_foreign_layouts():
    assert hf_rng_to_stepvault({"cpu": torch.get_rng_state()}) is None
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.get_rng_state(),
        "cuda": torch.zeros(16, dtype=torch.uint8),
    }
    out = hf_rng_to_stepvault(rng)
    assert out["cuda"][0] is rng["cuda"] and out["torch"] is rng["cpu"]


def test_hf_sharded_safetensors_and_sharded_bin(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # Tied embeddings (GPT-2's default): save_pretrained writes the shared tensor once.
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    st_dir = tmp_path / "checkpoint-7"
    model.save_pretrained(st_dir, max_shard_size="4KB")
    assert (st_dir / "model.safetensors.index.json").exists()
    expected = {k: v for k, v in model.state_dict().items()}
    root = tmp_path / "store"
    report = import_checkpoint(root, st_dir, run="sharded")
    assert report.step == 7  # from the folder name (no trainer_state.json)
    tree = stepvault.open(root).checkpoint("sharded@7").load()
    assert set(tree["model"]) == set(expected) - {"lm_head.weight"}
    assert all(torch.equal(tree["model"][k], expected[k]) for k in tree["model"])
    # A strict restore does not require the tied name: restoring wte restores lm_head.
    fresh = transformers.GPT2LMHeadModel(config)
    stepvault.restore(root, {"model": fresh}, run="sharded")
    assert_same(expected, dict(fresh.state_dict()))
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    untied = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(**{**config.to_dict(), "tie_word_embeddings": False})
    )
    with pytest.raises(stepvault.errors.StateMismatchError, match=r"lm_head\.weight"):
        stepvault.restore(root, {"model": untied}, run="sharded")  # untied: truly missing

    # The old pytorch_model.bin layout: torch.save shards plus an index.
    bin_dir = tmp_path / "checkpoint-9"
    bin_dir.mkdir()
    names = list(expected)
    halves = {
        "pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
        "pytorch_model-00002-of-00002.bin": names[len(names) // 2 :],
    }
    for fname, keys in halves.items():
        torch.save({k: expected[k] for k in keys}, bin_dir / fname)
    weight_map = {k: f for f, keys in halves.items() for k in keys}
    (bin_dir / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    import_checkpoint(root, bin_dir, run="bin")
    assert_same(expected, stepvault.open(root).checkpoint("bin@9").load()["model"])

    # A shard named in the index but missing is a clear error, and nothing is written.
    os.remove(bin_dir / "pytorch_model-00002-of-00002.bin")
    with pytest.raises(
        stepvault.errors.StepvaultError, match=r"pytorch_model-00002-of-00002\.bin.*missing"
    ):
        import_checkpoint(root, bin_dir, run="bin", step=10)
    assert stepvault.open(root).steps("bin") == [9]


def test_peft_adapter_folder_and_duplicate_weight_layouts(tmp_path):
    # What a Trainer writes for a LoRA model: adapter weights, adapter config, optimizer state
    # of the adapter's parameters.
    lora = torch.nn.ParameterDict(
        {"a": torch.nn.Parameter(torch.randn(4, 16)), "b": torch.nn.Parameter(torch.zeros(16, 4))}
    )
    opt = torch.optim.AdamW(lora.parameters())
    (lora["a"].sum() + lora["b"].sum()).backward()
    opt.step()
    folder = tmp_path / "checkpoint-30"
    folder.mkdir()
    adapter = {
        "base_model.model.q_proj.lora_A.weight": lora["a"].detach().clone(),
        "base_model.model.q_proj.lora_B.weight": lora["b"].detach().clone(),
    }
    save_file(adapter, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    (folder / "tokenizer.json").write_text("{}")
    root = tmp_path / "store"
    report = import_checkpoint(root, folder, run="lora")
    assert report.step == 30 and report.entries == {"adapter": "module", "optimizer": "optimizer"}
    assert report.skipped == []  # the tokenizer and adapter config are attachments
    assert report.attachments == ["adapter_config.json", "tokenizer.json"]
    ckpt = stepvault.open(root).checkpoint("lora@30")
    assert ckpt.metadata["adapter_config"] == {"peft_type": "LORA", "r": 4}
    assert_same(by_name(adapter), by_name(ckpt.load()["adapter"]))
    assert_same(opt.state_dict(), ckpt.load()["optimizer"])

    # Both layouts of the full weights: safetensors wins, the .bin is reported as skipped.
    both = tmp_path / "checkpoint-31"
    both.mkdir()
    save_file({"w": torch.ones(3)}, both / "model.safetensors")
    torch.save({"w": torch.zeros(3)}, both / "pytorch_model.bin")
    report = import_checkpoint(root, both, run="both")
    assert "model.safetensors was imported" in dict(report.skipped)["pytorch_model.bin"]
    assert torch.equal(stepvault.open(root).checkpoint("both@31").tensor("model/w"), torch.ones(3))


# --------------------------------------------------------------------------- bad input


def test_bad_inputs_give_clear_errors(tmp_path):
    root = tmp_path / "store"
    (tmp_path / "empty").mkdir()
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("hello")
    torch.save({"w": torch.ones(1000)}, tmp_path / "full.pt")
    data = (tmp_path / "full.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    torch.save({"w": torch.ones(2)}, tmp_path / "nostep.pt")
    cases = [
        (tmp_path / "missing.pt", [], "no such file"),
        (tmp_path / "empty", [], "without model weights"),
        (tmp_path / "dcp", [], "import-dcp"),
        (tmp_path / "notes.txt", [], "--format"),
        (tmp_path / "cut.pt", ["--step", "1"], "truncated"),
        (tmp_path / "junk.safetensors", ["--step", "1"], "not a valid safetensors"),
        (tmp_path / "nostep.pt", [], "--step N"),
        (tmp_path / "empty", ["--format", "torch", "--step", "1"], "needs a file"),
        (tmp_path / "full.pt", ["--format", "tf"], "format must be one of"),
    ]
    for path, extra, message in cases:
        res = cli("--root", root, "import", path, "--run", "r", *extra)
        assert res.exit_code == 2, (path, res.output)
        assert message in " ".join(res.output.split()), (path, res.output)
    assert not root.exists()

    with pytest.raises(stepvault.errors.InvalidNameError):
        import_checkpoint(root, tmp_path / "full.pt", run="../escape", step=1)
    import_checkpoint(root, tmp_path / "full.pt", run="r", step=1)
    with pytest.raises(stepvault.errors.CheckpointExistsError):
        import_checkpoint(root, tmp_path / "full.pt", run="r", step=1)
    import_checkpoint(root, tmp_path / "nostep.pt", run="r", step=1, overwrite=True)
    assert list(stepvault.open(root).checkpoint("r@1").load()["model"]["w"].shape) == [2]
