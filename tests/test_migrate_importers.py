"""stepvault.ops.migrate: one importer per source format behind one interface."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from stepvault.errors import StepvaultError
from stepvault.ops.migrate import (
    FORMATS,
    IMPORTERS,
    Importer,
    UntrustedInputError,
    detect_format,
    read_checkpoint,
)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """One small checkpoint of every format, by format name."""
    tmp_path = tmp_path_factory.mktemp("sources")
    weights = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}
    hf = tmp_path / "checkpoint-7"
    hf.mkdir()
    save_file(weights, hf / "model.safetensors")
    torch.save({"state_dict": weights, "global_step": 3, "epoch": 0}, tmp_path / "m.ckpt")
    torch.save(weights, tmp_path / "m.pt")
    save_file(weights, tmp_path / "m.safetensors")
    dcp.save({"model": weights}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")))
    ds = tmp_path / "global_step5"  # DeepSpeed file names (contents: test_sharded_deepspeed)
    ds.mkdir()
    torch.save({"module": weights}, ds / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {}}, ds / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return weights, {
        "hf": str(hf),
        "lightning": str(tmp_path / "m.ckpt"),
        "torch": str(tmp_path / "m.pt"),
        "safetensors": str(tmp_path / "m.safetensors"),
        "dcp": str(tmp_path / "dcp"),
        "deepspeed": str(ds),
    }


def test_every_importer_recognises_its_own_format_and_no_other(sources):
    _, paths = sources
    assert set(IMPORTERS) == set(paths)
    for name, importer in IMPORTERS.items():
        assert isinstance(importer, Importer) and importer.name == name
        claimed = {fmt for fmt, path in paths.items() if importer.detect(path)}
        assert claimed == {name}, (name, claimed)
    assert FORMATS == ("hf", "lightning", "torch", "safetensors", "deepspeed")


def test_each_importer_reads_the_tensors_bitwise(sources):
    weights, paths = sources
    for name in FORMATS:
        if name == "deepspeed":  # full pickles: read with trust in test_sharded_deepspeed
            continue
        imported = read_checkpoint(paths[name], trust=False)
        assert imported.format == name
        assert imported.kinds["model"] == "module"
        model = imported.tree["model"]
        assert set(model) == set(weights)
        assert all(torch.equal(model[k], v) for k, v in weights.items()), name
    assert read_checkpoint(paths["hf"]).step == 7  # from the folder name
    assert read_checkpoint(paths["lightning"]).step == 3


def test_dcp_reads_only_with_trust_and_points_to_its_own_command(sources):
    weights, paths = sources
    with pytest.raises(StepvaultError, match="import-dcp"):
        detect_format(paths["dcp"])
    with pytest.raises(ValueError, match="format must be one of"):
        read_checkpoint(paths["dcp"], format="dcp")  # type: ignore[arg-type]
    with pytest.raises(UntrustedInputError, match="trust=True"):
        IMPORTERS["dcp"].read(paths["dcp"])
    imported = IMPORTERS["dcp"].read(paths["dcp"], trust=True)
    assert imported.format == "dcp" and imported.kinds == {"model": "module"}
    assert all(torch.equal(imported.tree["model"][k], v) for k, v in weights.items())


def test_a_file_format_given_a_directory_says_it_needs_a_file(sources):
    _, paths = sources
    with pytest.raises(StepvaultError, match="needs a file"):
        read_checkpoint(paths["hf"], format="torch")
