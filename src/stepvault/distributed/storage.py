"""A DCP ``StorageWriter``/``StorageReader`` over a stepvault store.

Every rank writes the items of its save plan as content-addressed, checksummed objects
(replicated tensors are written once: DCP deduplicates the plans, and identical bytes are
one object anyway). Only the coordinator commits, after every rank reported success: the
manifest holds DCP's metadata as plain JSON (no pickle) in its ``sharded`` section, and
the commit is the one every save runs (``catalog/commit.py``: delta bases listed, the
atomic commit, the summary row).

Each tensor a rank writes starts its own chunk (large ones are still cut at the store's
``chunk_size``), where a one-process save bundles tensors under ``small_tensor`` (1 MiB).
A rank's shards are small (a model's tensors divided by the world size), so bundled they
mixed frozen tensors with trained ones in the same objects and a fine-tune with frozen
layers wrote its frozen shards again at every save. Only tensors under
:attr:`StepvaultWriter.bundle_below` bytes (scalars: the optimizer's step counters, which
change at every save anyway) are still bundled: an object of their own would cost more in
its header and fsync than they hold.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .._env import environment
from .._rank import world_size
from ..catalog.commit import commit_checkpoint
from ..engine import CheckpointReader, to_host, write_objects
from ..engine.parent import find_parent, remember_commit
from ..errors import ManifestError, StepvaultError
from ..format import Manifest, ObjectEntry, parse_manifest
from ..format.chunking import BUNDLE_ALIGN
from ..format.encoding import torch_dtype, torch_dtype_name
from ..format.manifest import TensorEntry
from ..store import Store, validate_run_name, validate_step
from .host_copies import HostCopies


def narrow_tensor_by_index(tensor: torch.Tensor, offsets: Any, sizes: Any) -> torch.Tensor:
    """The box ``offsets``/``sizes`` of ``tensor`` (a view)."""
    for dim, (off, length) in enumerate(zip(offsets, sizes)):
        if off != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, off, length)
    return tensor


def _key(fqn: str, offsets: Any) -> str:
    return f"{fqn}@{','.join(str(int(o)) for o in offsets)}" if offsets is not None else fqn


class StepvaultWriter(StorageWriter):
    """Writes one checkpoint ``run@step`` from every rank; the coordinator commits it."""

    #: tensors of at least this many bytes start their own chunk (one bundle slot,
    #: ``BUNDLE_ALIGN``); smaller ones are bundled. Never above the store's
    #: ``small_tensor``. The module docstring says why.
    bundle_below: int = BUNDLE_ALIGN

    def __init__(
        self,
        store: Store,
        run: str,
        step: int,
        *,
        epoch: int | None = None,
        metrics: dict[str, float] | None = None,
        metadata: Any = None,
        codec: str | None = None,
        overwrite: bool = True,
        workers: int | None = None,
        lineage: str | None = None,
        host: HostCopies | None = None,
    ) -> None:
        super().__init__()
        self.lineage = lineage
        #: this rank's host copies of the state (its memory copy): the tensors to write
        #: when they are among them, with the chunk digests the memory write shares
        self.host = host
        self.store = store
        self.run = validate_run_name(run)
        self.step = validate_step(step)
        self.epoch = epoch
        self.metrics = dict(metrics or {})
        self.metadata = metadata
        self.codec = codec or store.settings.get("codec", "raw")
        self.overwrite = overwrite
        self.workers = workers
        self.is_coordinator = True
        self._t0 = time.perf_counter()

    def reset(self, checkpoint_id: Any = None) -> None:
        self._t0 = time.perf_counter()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"{self.run}@{self.step}")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        arrays, values, indexes = {}, {}, {}
        for item in plan.items:
            key = _key(item.index.fqn, item.index.offset)
            indexes[key] = item.index
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                values[key] = json.loads(cast(io.BytesIO, data).getvalue())
            else:
                t = cast(torch.Tensor, data).detach()
                arrays[key] = to_host(t) if self.host is None else self.host.host_array(t)
        tensors, objects, stats = write_objects(
            self.store,
            arrays,
            codec=self.codec,
            workers=self.workers,
            digests=None if self.host is None else self.host.digests,
            small_tensor=self.bundle_below,
        )
        results = []
        for key, index in indexes.items():
            if key in values:
                info = {"value": values[key]}
                size = len(json.dumps(values[key]))
            else:
                entry = tensors[key]
                used = {d for d, _, _ in entry.chunks}
                info = {
                    "dtype": entry.dtype,
                    "sizes": entry.shape,
                    "chunks": [list(c) for c in entry.chunks],
                    "objects": {d: objects[d].to_json() for d in used},
                    # the objects this rank stored new: the coordinator counts each
                    # digest once over all ranks (equal shards of two ranks, one object)
                    "new": sorted(used & stats.new_digests),
                }
                size = entry.nbytes
            results.append(WriteResult(index=index, size_in_bytes=size, storage_data=info))
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator only: build the manifest from DCP's metadata and commit it."""
        stored = {}
        for rank_results in results:
            for r in rank_results:
                stored[_key(r.index.fqn, r.index.offset)] = r.storage_data
        entries: dict[str, Any] = {}
        objects: dict[str, ObjectEntry] = {}
        new: set[str] = set()
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                entries[fqn] = {"type": "value", "value": stored[_key(fqn, None)]["value"]}
                continue
            shards = []
            for chunk in md.chunks:
                info = stored[_key(fqn, chunk.offsets)]
                for d, o in info["objects"].items():
                    objects[d] = ObjectEntry(o["codec"], o["size"], o["raw_size"])
                new.update(info.get("new", ()))
                shards.append(
                    {
                        "offsets": list(chunk.offsets),
                        "sizes": list(chunk.sizes),
                        "chunks": info["chunks"],
                    }
                )
            entries[fqn] = {
                "type": "tensor",
                "dtype": torch_dtype_name(md.properties.dtype),
                "size": list(md.size),
                "shards": shards,
            }
        paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        manifest = Manifest(
            run=self.run,
            step=self.step,
            created=time.time(),
            epoch=self.epoch,
            kind="full",
            metrics=self.metrics,
            metadata=self.metadata,
            environment={**environment(), "world_size": world_size()},
            objects=objects,
            lineage=self.lineage,
            sharded={
                "entries": entries,
                "paths": {
                    k: [p if isinstance(p, int | str) else str(p) for p in v]
                    for k, v in paths.items()
                },
            },
        )
        # The parent as write_manifest finds it: this process's last commit of the run
        # (the coordinator commits every collective save), else one listing.
        manifest.parent_step, _ = find_parent(self.store, self.run, self.step)
        manifest.stats = {
            "logical_bytes": manifest.logical_bytes,
            "stored_bytes": manifest.stored_bytes,
            "new_bytes": sum(objects[d].size for d in new if d in objects),
            "new_objects": len(new),
            "objects": len(objects),
            "seconds": time.perf_counter() - self._t0,
        }
        self.store.ensure_run(
            self.run, {"run": self.run, "created": manifest.created, "environment": environment()}
        )
        # The same epilogue as every other save: delta bases listed, commit, summary row.
        commit_checkpoint(self.store, manifest, overwrite=self.overwrite)
        remember_commit(self.store, manifest)  # the next collective save's parent


def sharded_metadata(manifest: Manifest) -> Metadata:
    """DCP ``Metadata`` rebuilt from a manifest's JSON (what DCP itself would pickle)."""
    if not manifest.sharded:
        raise ManifestError(
            f"{manifest.run}@{manifest.step} was not written by a distributed save; "
            "restore it with stepvault.restore"
        )
    state_md: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    for fqn, e in manifest.sharded["entries"].items():
        if e["type"] == "value":
            state_md[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = e
            continue
        chunks = []
        for sh in e["shards"]:
            chunks.append(ChunkStorageMetadata(torch.Size(sh["offsets"]), torch.Size(sh["sizes"])))
            storage[MetadataIndex(fqn, sh["offsets"])] = {**sh, "dtype": e["dtype"]}
        state_md[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=torch_dtype(e["dtype"])), torch.Size(e["size"]), chunks
        )
    paths = {k: tuple(v) for k, v in manifest.sharded.get("paths", {}).items()}
    return Metadata(state_dict_metadata=state_md, planner_data=paths, storage_data=storage)


def shard_tensor(reader: CheckpointReader, dtype: str, shard: dict[str, Any]) -> torch.Tensor:
    """One stored shard as a tensor (verified)."""
    entry = TensorEntry(dtype, list(shard["sizes"]), [tuple(c) for c in shard["chunks"]])
    return reader._build(entry)


class StepvaultReader(StorageReader):
    """Reads a checkpoint for ``torch.distributed.checkpoint.load`` on any number of ranks."""

    def __init__(
        self,
        store: Store,
        run: str,
        step: int,
        *,
        workers: int | None = None,
        manifest: Manifest | None = None,
        verified: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        super().__init__()
        self.store = store
        self.run = validate_run_name(run)
        self.step = validate_step(step)
        self.workers = workers
        #: the manifest already parsed by the restore planner (None: parsed here)
        self.manifest: Manifest | None = manifest
        #: called on every rank once its objects are verified (with the damage found, or
        #: None) and before any byte is placed: the ranks agree there (invariant 4)
        self.verified = verified
        self.storage_data: dict[MetadataIndex, Any] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.manifest is None:
            self.manifest = parse_manifest(
                self.store.read_manifest(self.run, self.step), f"{self.run}@{self.step}"
            )
        return sharded_metadata(self.manifest)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *a, **k) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.manifest is not None
        reader = CheckpointReader(self.store, self.manifest, workers=self.workers)
        # Verify every object this rank needs before a single byte reaches the state.
        damage: BaseException | None = None
        try:
            reader.prefetch(
                c[0]
                for item in plan.items
                if item.type != LoadItemType.BYTE_IO
                for c in self.storage_data[item.storage_index]["chunks"]
            )
        except StepvaultError as exc:
            damage = exc
        if self.verified is not None:
            self.verified(damage)  # raises on every rank when any rank found damage
        elif damage is not None:
            raise damage
        shards: dict[MetadataIndex, torch.Tensor] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(json.dumps(info["value"]).encode()))
                continue
            target = planner.resolve_tensor(item).detach()
            whole = all(o == 0 for o in item.storage_offsets) and list(item.lengths) == list(
                info["sizes"]
            )
            if whole and item.storage_index not in shards:
                # The request is the whole stored shard: copy its chunks straight into the
                # target instead of assembling the shard in a buffer first.
                entry = TensorEntry(
                    info["dtype"], list(info["sizes"]), [tuple(c) for c in info["chunks"]]
                )
                if reader.read_into(entry, target):
                    planner.commit_tensor(item, target)
                    continue
            src = shards.get(item.storage_index)
            if src is None:
                src = shards[item.storage_index] = shard_tensor(reader, info["dtype"], info)
            src_view = narrow_tensor_by_index(src, item.storage_offsets, item.lengths)
            if target.size() != src_view.size():
                raise ManifestError(
                    f"{item.storage_index.fqn}: stored piece {tuple(src_view.size())} does not "
                    f"fit the requested {tuple(target.size())}"
                )
            target.copy_(src_view)
            planner.commit_tensor(item, target)
        reader.release()
        fut: Future = Future()
        fut.set_result(None)
        return fut


__all__ = ["StepvaultReader", "StepvaultWriter", "sharded_metadata"]
