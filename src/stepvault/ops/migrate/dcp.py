"""torch.distributed.checkpoint (DCP) directories.

DCP's ``.metadata`` and its non-tensor values are pickles: reading them can run code chosen
by whoever wrote the checkpoint. The importer therefore refuses unless the caller says
``trust=True``, after which the data is re-stored in stepvault's pickle-free format — the
imported checkpoint is safe to share from then on. It has its own entry point
(:func:`import_dcp`, ``stepvault import-dcp``) because the step must be given and trust is
needed up front; :func:`detect_format` points there.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from ...core.info import SaveInfo
from ...core.write import save
from ...errors import StepvaultError, UntrustedInputError
from .base import ImportedState, Importer, kind_for


class DcpImporter(Importer):
    name = "dcp"
    layout: ClassVar[dict[str, str]] = {"<key>": "each top-level key of the saved state dict"}
    directory = True
    elsewhere = "a torch.distributed.checkpoint directory; use `stepvault import-dcp`"

    def detect(self, path: str) -> bool:
        return os.path.isdir(path) and ".metadata" in os.listdir(path)

    def read(self, path: str, *, trust: bool = False) -> ImportedState:
        """Load the whole DCP checkpoint into memory in this process (no process group)."""
        if not trust:
            raise UntrustedInputError(
                f"{path}: a torch.distributed.checkpoint directory stores its metadata (and "
                "any non-tensor values) as pickles, which can execute code when loaded. Import "
                "only checkpoints you made or trust, and then pass trust=True (CLI: --trust)"
            )
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise StepvaultError(f"{path}: not a DCP checkpoint directory (no .metadata file)")
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        state: dict[str, Any] = {}
        _load_state_dict(
            state,
            storage_reader=FileSystemReader(path),
            planner=_EmptyStateDictLoadPlanner(),
            no_dist=True,
        )
        kinds = {k: kind_for(v) for k, v in state.items()}
        return ImportedState("dcp", os.path.abspath(path), state, kinds, files=[".metadata"])


def import_dcp(
    root: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    run: str,
    step: int,
    trust: bool = False,
    codec: str | None = None,
) -> SaveInfo:
    """Import the DCP checkpoint directory ``path`` as ``run@step`` (single process)."""
    imported = DcpImporter().read(os.fspath(path), trust=trust)
    # Saved like any state (stepvault.save classifies the entries itself).
    return save(
        root,
        imported.tree,
        run=run,
        step=step,
        codec=codec,
        collective=False,
        metadata={"imported_from": imported.source, "format": "dcp"},
    )
