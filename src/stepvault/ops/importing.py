"""Import foreign checkpoints into a store (DCP directories; more formats later).

DCP's ``.metadata`` and its non-tensor values are pickles: reading them can run code
chosen by whoever wrote the checkpoint. Import therefore refuses unless the caller says
``trust=True``, after which the data is re-stored in stepvault's pickle-free format —
the imported checkpoint is safe to share from then on.
"""

from __future__ import annotations

import os
from typing import Any

from ..core.info import SaveInfo
from ..core.write import save
from ..errors import StepvaultError


class UntrustedInputError(StepvaultError):
    """The input format needs unpickling and the caller did not pass ``trust=True``."""


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
    if not trust:
        raise UntrustedInputError(
            f"{path}: a torch.distributed.checkpoint directory stores its metadata (and any "
            "non-tensor values) as pickles, which can execute code when loaded. Import only "
            "checkpoints you made or trust, and then pass trust=True (CLI: --trust)"
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
    return save(
        root,
        state,
        run=run,
        step=step,
        codec=codec,
        collective=False,
        metadata={"imported_from": os.path.abspath(path), "format": "dcp"},
    )
