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
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from ...core.info import SaveInfo
from ...errors import StepvaultError, UntrustedInputError
from .base import WEIGHTS_ONLY, ImportedState, Importer, is_optimizer_state, kind_for


def optimizer_by_index(value: Any, where: str) -> tuple[Any, list[list[str]] | None]:
    """An optimizer state dict keyed by parameter names → the layout ``load_state_dict`` takes.

    ``torch.distributed.checkpoint.state_dict.get_state_dict`` (and DCP checkpoints written
    from it) key ``state`` and list ``param_groups[i]["params"]`` by fully qualified
    parameter names. ``Optimizer.state_dict()`` numbers the parameters 0, 1, ... across the
    groups in order instead, and ``Optimizer.load_state_dict`` keeps any ``state`` key it
    cannot match to a group's ``params`` as an unused entry: a resume that silently starts
    from an empty optimizer. The names are numbered in their group order (what
    ``state_dict()`` would have written for the same optimizer); returns the converted
    state and the names per group (None when ``value`` needed no conversion). A state whose
    keys are not all listed in the groups is refused, naming them.
    """
    if not is_optimizer_state(value):
        return value, None
    groups, state = value["param_groups"], value["state"]
    if not isinstance(groups, list | tuple) or not isinstance(state, Mapping):
        raise StepvaultError(f"{where}: optimizer state with malformed param_groups/state")
    params = [p for g in groups for p in (g.get("params", []) if isinstance(g, Mapping) else [])]
    keys = list(params) + list(state)
    if all(isinstance(k, int) and not isinstance(k, bool) for k in keys):
        return value, None  # torch's own layout
    if not all(isinstance(k, str) for k in keys):
        raise StepvaultError(
            f"{where}: optimizer state mixes parameter names and numbers "
            f"({', '.join(repr(k) for k in keys[:4])}...); save it with one layout "
            "(Optimizer.state_dict() or get_state_dict) and import again"
        )
    if len(set(params)) != len(params):
        dup = next(p for p in params if params.count(p) > 1)
        raise StepvaultError(f"{where}: parameter {dup!r} is listed in two param groups")
    index = {name: i for i, name in enumerate(params)}
    unknown = [k for k in state if k not in index]
    if unknown:
        raise StepvaultError(
            f"{where}: optimizer state for {', '.join(map(repr, unknown[:5]))} whose "
            "parameters no param group lists; load_state_dict would ignore it (and resume "
            "with an empty optimizer). Save param_groups with the state, e.g. with "
            "torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)"
        )
    names = [[p for p in g["params"]] for g in groups]
    converted = {
        **value,
        "state": {index[k]: v for k, v in state.items()},
        "param_groups": [{**g, "params": [index[p] for p in g["params"]]} for g in groups],
    }
    return converted, names


def is_flat_optimizer_state(value: Any) -> bool:
    """The layout of ``get_state_dict(..., options=StateDictOptions(
    flatten_optimizer_state_dict=True))``: ``state.<fqn>.<key>`` and
    ``param_groups.<fqn>.<key>`` in one flat mapping."""
    if not isinstance(value, Mapping) or not value:
        return False
    keys = list(value)
    return all(
        isinstance(k, str) and (k.startswith("state.") or k.startswith("param_groups."))
        for k in keys
    ) and any(k.startswith("param_groups.") for k in keys)


def unflatten_optimizer_state(value: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A flattened optimizer state (:func:`is_flat_optimizer_state`) → the name-keyed
    ``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}`` that
    :func:`optimizer_by_index` renumbers.

    Param-group keys (``lr``, ``betas``...) hold no dots, so ``param_groups.<fqn>.<key>``
    splits at its last dot and names every parameter; a state key is matched to the longest
    such name (optimizers like Shampoo nest their state below it, which comes back nested).
    torch writes the groups one after the other, so consecutive parameters with the same
    settings form one group; two adjacent groups with identical settings therefore come back
    as one (``load_state_dict`` then names the group count that differs).
    """
    settings: dict[str, dict[str, Any]] = {}
    for key, v in value.items():
        if key.startswith("param_groups."):
            fqn, _, name = key[len("param_groups.") :].rpartition(".")
            if not fqn:
                raise StepvaultError(f"{where}: flattened optimizer key {key!r} names no parameter")
            settings.setdefault(fqn, {})[name] = v
    fqns = sorted(settings, key=len, reverse=True)  # longest first: "a.b" before "a"
    state: dict[str, dict[str, Any]] = {}
    for key, v in value.items():
        if not key.startswith("state."):
            continue
        rest = key[len("state.") :]
        owner = next((f for f in fqns if rest.startswith(f + ".")), None)
        if owner is None:
            raise StepvaultError(
                f"{where}: optimizer state {key!r} names no parameter of its param_groups; "
                "load_state_dict would ignore it. Save with the param groups (get_state_dict)"
            )
        node = state.setdefault(owner, {})
        *path, leaf = rest[len(owner) + 1 :].split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = v
    groups: list[dict[str, Any]] = []
    for fqn, group in settings.items():  # insertion order: the groups in torch's order
        if groups and {k: v for k, v in groups[-1].items() if k != "params"} == group:
            groups[-1]["params"].append(fqn)
        else:
            groups.append({**group, "params": [fqn]})
    return {"state": state, "param_groups": groups}


def optimizers_by_index(imported: ImportedState) -> None:
    """Convert every top-level optimizer entry of ``imported`` keyed by parameter names
    (:func:`optimizer_by_index`), recording the names in ``metadata["optimizer_param_names"]``
    (entry → names per param group)."""
    recorded: dict[str, list[list[str]]] = {}
    for key, value in list(imported.tree.items()):
        if is_flat_optimizer_state(value):
            value = unflatten_optimizer_state(value, f"{imported.source}: entry {key!r}")
            imported.tree[key] = value
        converted, names = optimizer_by_index(value, f"{imported.source}: entry {key!r}")
        if names is not None:
            imported.tree[key] = converted
            recorded[key] = names
    if recorded:
        imported.metadata["optimizer_param_names"] = recorded


#: Accelerate's FSDP files written one per rank without DCP: ``save_fsdp_model`` /
#: ``save_fsdp_optimizer(use_dcp=False)`` of a ``SHARDED_STATE_DICT`` job
#: (``pytorch_model_fsdp_<i>_rank<r>.bin``, ``optimizer_<i>_rank<r>.bin``), and the model of a
#: ``LOCAL_STATE_DICT`` one (``pytorch_model_fsdp_rank<r>.bin``, FSDP1's flat local shards).
_PER_RANK_FSDP = re.compile(r"(pytorch_model_fsdp(_\d+)?|optimizer_\d+)_rank\d+\.bin")


def per_rank_fsdp_files(path: str) -> list[str]:
    """The per-rank FSDP files (:data:`_PER_RANK_FSDP`) directly in the folder ``path``."""
    try:
        return sorted(n for n in os.listdir(path) if _PER_RANK_FSDP.fullmatch(n))
    except OSError:
        return []


def per_rank_fsdp_refusal(path: str, files: list[str]) -> str:
    """Why a folder of per-rank FSDP files is not imported, and what to do instead.

    Each file is one rank's ``torch.save`` of its shards: FSDP1 ``ShardedTensor`` objects
    (FSDP2: ``DTensor``) whose unpickling needs the job's process group, and whose merge
    needs every rank's placement metadata; importing them would be a second reader of
    FSDP's own internals. Re-saving through DCP costs the user one ``save_state``."""
    shown = ", ".join(files[:3]) + (", ..." if len(files) > 3 else "")
    return (
        f"{path}: an Accelerate FSDP folder saved one file per rank without "
        f"torch.distributed.checkpoint ({shown}: `save_fsdp_model`/`save_fsdp_optimizer` with "
        "use_dcp=False, or fsdp_state_dict_type LOCAL_STATE_DICT, also through the HF "
        "Trainer). Each file holds one rank's shards as pickled ShardedTensor/DTensor "
        "objects, which stepvault does not import. Way out: load it in the same job (same "
        "world size, Accelerate's load with use_dcp=False) and save it again with DCP: "
        "`accelerator.save_state(DIR)` with fsdp_state_dict_type SHARDED_STATE_DICT (its "
        "default use_dcp=True, FSDP2 or FSDP1) or FULL_STATE_DICT (the Trainer: that "
        "state_dict_type in fsdp_config), then `stepvault import DIR --run R --step N "
        "--trust`; or checkpoint the job with stepvault (AcceleratorCheckpointer, "
        "StepvaultTrainer)"
    )


class DcpImporter(Importer):
    name = "dcp"
    layout: ClassVar[dict[str, str]] = {"<key>": "each top-level key of the saved state dict"}
    directory = True
    elsewhere = "a torch.distributed.checkpoint directory; use `stepvault import-dcp`"

    def detect(self, path: str) -> bool:
        """A DCP directory, an Accelerate FSDP ``save_state`` folder, or one of Accelerate's
        per-rank FSDP folders (detected so that it is refused by name: :meth:`read`)."""
        from .fsdp import is_fsdp_folder
        from .hf import is_hf_checkpoint

        if not os.path.isdir(path):
            return False
        if is_hf_checkpoint(path):  # a Trainer's FSDP checkpoint-N is the HF importer's
            return ".metadata" in os.listdir(path)
        return (
            ".metadata" in os.listdir(path)
            or is_fsdp_folder(path)
            or bool(per_rank_fsdp_files(path))
        )

    def what(self, path: str) -> str:
        """What the detected directory ``path`` is, in the words of the error messages."""
        if os.path.isfile(os.path.join(path, ".metadata")):
            return "a torch.distributed.checkpoint directory"
        if per_rank_fsdp_files(path):
            return "an Accelerate FSDP folder saved one file per rank"
        return (
            "an Accelerate FSDP save_state folder (pytorch_model_fsdp_0/ and optimizer_0/ "
            "are torch.distributed.checkpoint directories)"
        )

    @staticmethod
    def _per_rank_only(path: str) -> list[str]:
        """The per-rank FSDP files of ``path`` when it is not also a DCP directory."""
        if os.path.isfile(os.path.join(path, ".metadata")):
            return []
        return per_rank_fsdp_files(path)

    def refuse_unreadable(self, path: str) -> None:
        """Raise for a detected directory that is not imported at all (the per-rank FSDP
        layout), before any question of step or trust."""
        files = self._per_rank_only(path)
        if files:
            raise StepvaultError(per_rank_fsdp_refusal(path, files))

    def elsewhere_for(self, path: str) -> str | None:
        """Where :func:`import_checkpoint` sends the detected directory ``path``: the DCP
        import (it needs the step and ``trust`` up front), or the per-rank refusal."""
        files = self._per_rank_only(path)
        if files:
            return per_rank_fsdp_refusal(path, files).removeprefix(f"{path}: ")
        return (
            f"{self.what(path)}; it records no step and holds pickles: import it with "
            "`stepvault import PATH --run R --step N --trust` (or `stepvault import-dcp`; "
            "Python: stepvault.ops.import_dcp(root, path, run=R, step=N, trust=True))"
        )

    def read(self, path: str, *, trust: bool = False) -> ImportedState:
        """Load the whole DCP checkpoint into memory in this process (no process group).

        An Accelerate ``save_state`` folder of an FSDP job (``pytorch_model_fsdp_0/``,
        ``optimizer_0/``... beside its pickles) is read as one checkpoint
        (:func:`.fsdp.read_accelerate_folder`): it records no step either. Accelerate's
        per-rank FSDP files (``use_dcp=False``) are refused with the way out."""
        from .fsdp import read_accelerate_folder

        self.refuse_unreadable(path)
        if self.detect(path) and not os.path.isfile(os.path.join(path, ".metadata")):
            return read_accelerate_folder(path, trust=trust)
        state = load_dcp(path, trust=trust)
        imported = ImportedState("dcp", os.path.abspath(path), state, {}, files=[".metadata"])
        optimizers_by_index(imported)
        imported.kinds = {k: kind_for(v) for k, v in imported.tree.items()}
        note_missing_optimizer(imported)
        return imported


def load_dcp(path: str, *, trust: bool) -> dict[str, Any]:
    """Every entry of the DCP directory ``path``, whole (resharded to one process, no process
    group). Refused without ``trust``: DCP's metadata is a pickle."""
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
    if not state:
        raise StepvaultError(f"{path}: the DCP checkpoint holds no entries; nothing to import")
    return state


def note_missing_optimizer(imported: ImportedState) -> None:
    """Record in ``imported.missing`` (``metadata["missing"]`` once committed) that a source
    holds weights but no optimizer state (``stepvault import`` says so; a resume from it
    starts with a fresh optimizer and warns)."""
    kinds = set(imported.kinds.values())
    if "module" in kinds and "optimizer" not in kinds:
        imported.missing.setdefault("optimizer", WEIGHTS_ONLY)


def import_dcp(
    root: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    run: str,
    step: int,
    trust: bool = False,
    codec: str | None = None,
) -> SaveInfo:
    """Import the DCP checkpoint directory ``path`` as ``run@step`` (single process).

    Entries get the kinds a live object of their sort would have (a ``get_state_dict``
    model → ``module``, its optimizer → ``optimizer``, converted from parameter names to
    the numbering ``Optimizer.load_state_dict`` expects), so that ``stepvault.restore(root,
    {"model": model, "optimizer": optimizer}, run=run)`` continues training where
    ``dcp.load`` + ``set_state_dict`` would, and ``stepvault export`` finds the module.
    """
    from ...store import validate_run_name, validate_step
    from .commit import commit_imported  # commit imports the registry, which imports this

    validate_run_name(run)
    validate_step(step)
    imported = DcpImporter().read(os.fspath(path), trust=trust)
    return commit_imported(root, imported, run=run, step=step, codec=codec).save
