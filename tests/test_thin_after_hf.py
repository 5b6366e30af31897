"""A thinned checkpoint of a real HF Trainer run still exports as a model folder that
``from_pretrained`` loads, with the weights it was saved with."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch
from test_export_hf import gpt2, train
from transformers import AutoModelForCausalLM

from stepvault import KeepLast, ThinAfter
from stepvault.catalog import apply_retention, checkpoint_records
from stepvault.ops.export_hf import export_folder
from stepvault.store import Store


@pytest.mark.slow  # two HF Trainer runs: ~10 s on the shared CI machine
def test_a_thinned_trainer_checkpoint_exports_and_loads_with_from_pretrained(tmp_path):
    root = tmp_path / "store"
    train(root, gpt2, "gpt", steps=4)  # the trainer's full state at step 4
    model, _ = train(root, gpt2, "gpt", steps=2)  # and at step 2
    store = Store.open(root)
    keep = KeepLast(2) | ThinAfter(steps=1)
    result = apply_retention(store, "gpt", keep, checkpoint_records(store, "gpt"))
    assert result.thinned == [2]  # 4 is the newest full checkpoint: never thinned
    assert {r.step: r.kind for r in checkpoint_records(store, "gpt")} == {2: "weights", 4: "full"}
    out = tmp_path / "export"
    export_folder(store, "gpt", 2, out)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    expected = model.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())
