"""Migrate existing checkpoints into a store: Hugging Face, Lightning, ``torch.save`` files, DCP.

Supported inputs (``format=`` forces one, otherwise it is detected):

``hf``
    A ``transformers.Trainer`` ``checkpoint-N`` folder: ``model.safetensors`` (or a sharded
    set with ``model.safetensors.index.json``), or ``pytorch_model.bin`` (sharded likewise),
    plus ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``, ``rng_state*.pth``,
    ``trainer_state.json``, ``config.json``; ``training_args.bin`` only with ``trust=True``.
    A PEFT checkpoint's ``adapter_model.safetensors``/``.bin`` stands for the weights. A
    Trainer ``output_dir`` imports each of its ``checkpoint-N`` folders
    (:func:`import_checkpoints`).
``lightning``
    A Lightning ``.ckpt`` file.
``torch``
    A ``.pt``/``.pth``/``.bin`` file holding a state dict, or a dict of state dicts and values.
``safetensors``
    One ``.safetensors`` file (the weights of a model).
``dcp``
    A ``torch.distributed.checkpoint`` directory, through :func:`import_dcp` (``stepvault
    import-dcp``) only: its metadata is a pickle, so it needs ``trust=True`` up front. An
    Accelerate FSDP ``save_state`` folder (``pytorch_model_fsdp_0/``, ``optimizer_0/``,
    ``scheduler.bin``, ``random_states_<rank>.pkl``) goes the same way and becomes one
    checkpoint in ``AcceleratorCheckpointer``'s layout (:mod:`.fsdp`); a Trainer FSDP
    ``checkpoint-N`` is an ``hf`` folder whose model and optimizer are read likewise.
    FSDP files written one per rank without DCP (``pytorch_model_fsdp_<i>_rank<r>.bin``,
    ``optimizer_<i>_rank<r>.bin``: Accelerate's ``use_dcp=False``; ``LOCAL_STATE_DICT``'s
    ``pytorch_model_fsdp_rank<r>.bin``) are refused, naming the way out
    (:func:`.dcp.per_rank_fsdp_refusal`).

Each format is one module here with one :class:`Importer` (``detect(path)``, ``read(path)``
→ :class:`ImportedState`, the tensors and values in memory); :data:`IMPORTERS` lists them
in detection order, and committing is shared (:func:`commit_imported`). A new format is a
new module with an importer, added to :data:`IMPORTERS`.

Safety: safetensors files are read with the ``safetensors`` library (no pickle). Pickled
files are read with ``torch.load(weights_only=True)`` — tensors, containers and plain values
only, plus plain numpy arrays (HF's RNG files hold some). A file that needs anything else
(an arbitrary class, a function) would run code chosen by whoever wrote it: it is refused
with :class:`UntrustedInputError` unless the caller passes ``trust=True``, which is unsafe
for files from others. Once imported, the checkpoint is in stepvault's pickle-free format and
safe to share.

The imported checkpoint is an ordinary one (``run@step``): tensors are stored bitwise as
read, it restores with :func:`stepvault.restore`, reads lazily with :func:`stepvault.open`
and exports with ``stepvault export``. Its top-level entries (see :data:`LAYOUTS`) use the
names a stepvault training state usually has: ``model``, ``optimizer``, ``scheduler``, ...
"""

from __future__ import annotations

from ...errors import UntrustedInputError
from .base import ImportedState, Importer, kind_for
from .commit import ImportReport, commit_imported, import_checkpoint, import_checkpoints
from .dcp import DcpImporter, import_dcp
from .hf import (
    HFImporter,
    hf_checkpoint_folders,
    hf_rng_to_stepvault,
    is_hf_checkpoint,
    read_hf_checkpoint,
)
from .lightning import LightningImporter, read_lightning_checkpoint, to_lightning_checkpoint
from .pickles import load_pickle
from .registry import FORMATS, IMPORTERS, LAYOUTS, Format, detect_format, read_checkpoint
from .safetensors_file import SafetensorsImporter, load_safetensors, read_safetensors_file
from .torch_file import TorchImporter, read_torch_file

__all__ = [
    "FORMATS",
    "IMPORTERS",
    "LAYOUTS",
    "DcpImporter",
    "Format",
    "HFImporter",
    "ImportReport",
    "ImportedState",
    "Importer",
    "LightningImporter",
    "SafetensorsImporter",
    "TorchImporter",
    "UntrustedInputError",
    "commit_imported",
    "detect_format",
    "hf_checkpoint_folders",
    "hf_rng_to_stepvault",
    "import_checkpoint",
    "import_checkpoints",
    "import_dcp",
    "is_hf_checkpoint",
    "kind_for",
    "load_pickle",
    "load_safetensors",
    "read_checkpoint",
    "read_hf_checkpoint",
    "read_lightning_checkpoint",
    "read_safetensors_file",
    "read_torch_file",
    "to_lightning_checkpoint",
]
