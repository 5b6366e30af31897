"""Ray Train: the workers of a ``TorchTrainer`` save through one collective
:class:`~stepvault.CheckpointManager`, report each committed checkpoint to Ray as a
*pointer* (a few hundred bytes naming ``stepvault:ROOT#RUN@STEP``, never the tensors),
and after a failure every worker of the restarted group restores from stepvault: the
newest checkpoint that verifies, falling back past damage. ``pip install "stepvault[ray]"``.

::

    from stepvault.integrations.ray import RayCheckpointer

    def train_fn(config):
        model = DistributedDataParallel(Net())        # ray.train.torch.prepare_model(...)
        state = {"model": model, "optimizer": opt, "step": 0}
        ckpt = RayCheckpointer(config["root"], run="exp1", save=Every(steps=100))
        ckpt.restore(state)                           # None on the first attempt
        for step in range(state["step"], total):
            ...                                       # one training step
            state["step"] = step + 1
            ckpt.save(step + 1, state, metrics={"loss": loss.item()})  # every worker
        ckpt.close()

    TorchTrainer(train_fn, scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(failure_config=FailureConfig(max_failures=3))).fit()

Ray copies the pointer directory to its storage (``ray.train.report`` with a
checkpoint), so Ray's checkpoint list, ``result.checkpoint`` and its retention track the
stepvault checkpoints; :func:`checkpoint_uri` reads a pointer back
(``stepvault.restore(checkpoint_uri(result.checkpoint), state)``). Resuming does not go
through Ray's latest checkpoint: a save committed after Ray's last report (a crash
between the two) is newer, and stepvault's verified "latest" is the one to resume from.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

from ..catalog.events import log_event
from ..catalog.refs import located_ref, parse_located_ref
from ..core.info import RestoreInfo, SaveInfo
from ..errors import LeaseHeldError, StepvaultError
from ..manager.checkpoint_manager import CheckpointManager

try:
    import ray.train
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        "stepvault.integrations.ray needs Ray Train, which is not installed: "
        'pip install "stepvault[ray]"'
    ) from exc

__all__ = ["POINTER", "RayCheckpointer", "checkpoint_uri"]

#: the file of a pointer checkpoint
POINTER = "stepvault.json"


class RayCheckpointer:
    """The worker side of a Ray Train run: a collective manager plus the reports.

    Every worker builds one (under the process group Ray's ``TorchTrainer`` set up: the
    manager is collective), calls :meth:`restore` once and :meth:`save` at every step
    (``ray.train.report`` is a barrier: every worker reports the same number of times).
    ``manager_kwargs`` go to :class:`~stepvault.CheckpointManager` (``save``, ``keep``,
    ``options``...).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        run: str,
        *,
        lease_wait: float = 120.0,
        **manager_kwargs: Any,
    ) -> None:
        # After a failure Ray starts a new worker group while the old rank 0 (the run's
        # lease holder) may still be exiting: its lease is taken over once its process is
        # gone. Every rank gets the same LeaseHeldError, so all retry in step.
        deadline = time.monotonic() + lease_wait
        while True:
            try:
                self.manager = CheckpointManager(root, run, **manager_kwargs)
                break
            except LeaseHeldError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(1.0)
        self.run = run
        self.rank = ray.train.get_context().get_world_rank()

    def restore(self, state: MutableMapping[str, Any], **kwargs: Any) -> RestoreInfo | None:
        """Every worker: the newest checkpoint that verifies (damaged ones skipped and
        reported), through the manager's collective restore; None on a fresh start."""
        return self.manager.restore(state, **kwargs)

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metrics: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> SaveInfo | None:
        """Every worker, every step: save when the policy says so, then report to Ray
        (the metrics, and rank 0's pointer to the checkpoint once it is committed).
        Returns the committed save's info, or None when no save was due."""
        handle = self.manager.save(step, state, metrics=metrics, **kwargs)
        # Ray tracks what it is told is persisted: report a checkpoint once committed.
        info = handle.result() if handle is not None else None
        report = {k: v for k, v in (metrics or {}).items() if isinstance(v, int | float)}
        report["step"] = step
        if info is None or self.rank != 0:
            ray.train.report(report)
            return info
        store = self.manager.store
        uri = located_ref(store.backend.url, self.run, info.step)
        name = f"stepvault-{self.run}-{info.step:012d}"
        pointer = tempfile.mkdtemp(prefix="stepvault-ray-")
        try:
            with open(os.path.join(pointer, POINTER), "w") as f:
                json.dump({"uri": uri, "run": self.run, "step": info.step}, f)
            ray.train.report(
                report,
                checkpoint=ray.train.Checkpoint.from_directory(pointer),
                checkpoint_dir_name=name,
            )
        finally:
            shutil.rmtree(pointer, ignore_errors=True)
        try:  # the dashboard shows where a checkpoint is referenced
            log_event(
                store, self.run, "tracker_ref", step=info.step, tracker="ray",
                ref=_persisted_path(name), name=name,
            )  # fmt: skip
        except OSError:
            pass
        return info

    def close(self) -> None:
        """Close the manager (the save in flight, retention, the lease)."""
        self.manager.close()


def _persisted_path(name: str) -> str:
    """Where Ray keeps the pointer checkpoint ``name`` (its run's storage)."""
    try:
        storage = ray.train.get_context().get_storage()
        return f"{storage.experiment_fs_path}/{name}"
    except Exception:  # a private detail of Ray's; the name alone still identifies it
        return f"ray:{ray.train.get_context().get_experiment_name()}/{name}"


def checkpoint_uri(checkpoint: Any) -> str:
    """The ``stepvault:ROOT#RUN@STEP`` a Ray checkpoint reported by
    :class:`RayCheckpointer` points at (``result.checkpoint``, ``result.best_checkpoints``,
    ``ray.train.get_checkpoint()``)."""
    with checkpoint.as_directory() as where:
        path = os.path.join(where, POINTER)
        if not os.path.exists(path):
            raise StepvaultError(
                f"Ray checkpoint {checkpoint.path} has no {POINTER}: it was not reported "
                "by stepvault.integrations.ray.RayCheckpointer"
            )
        with open(path) as f:
            uri = str(json.load(f)["uri"])
    parse_located_ref(uri)
    return uri
