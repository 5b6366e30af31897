"""The collective writer: every rank writes its shards through DCP, rank 0 commits.

The other half of the save pipeline's writers (:mod:`.saving` holds the local one and the
pipeline that drives both): under a process group each rank stages its shards (and, with
``MemOptions(replicate=True)``, a copy of its own state for node memory,
:mod:`.rank_memory`); the write and the commit run through
:mod:`stepvault.distributed` (DCP with stepvault's storage writer), whose coordinator runs
the same commit epilogue as every other save (``catalog/commit.py``).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import torch

from ..core.info import SaveInfo
from ..core.values import encode_metadata, encode_metrics
from ..errors import LeaseLostError, SaveFailedError, StepvaultError
from ..format import parse_manifest
from ..state.snapshot import weights_only
from .saving import SaveRequest, Staged
from .session import RunSession

if TYPE_CHECKING:
    from .rank_memory import RankMemory


class CollectiveWriter:
    """Every rank writes its shards (DCP); rank 0 commits, logs and applies retention.

    With ``async_save`` the training thread only stages each rank's shards into reused CPU
    buffers; the write and commit run in the background (DCP ``async_save`` on a dedicated
    gloo group). Every rank waits for the previous save before starting the next, so a
    failure surfaces on all ranks at the same call.
    """

    waits_for_previous = True

    def in_flight_limit(self) -> int:
        return 1

    def __init__(self, session: RunSession, async_save: bool, *, mem: RankMemory | None = None):
        self.session = session
        #: every rank's own copy into node memory, replicated (.rank_memory); None: the
        #: mem tier, if any, is read by restores only
        self.mem = mem
        self.async_saver = None
        if async_save:
            from ..distributed.api import AsyncSaver

            self.async_saver = AsyncSaver()  # collective: every rank builds its manager

    def stage(self, request: SaveRequest, *, background: bool) -> Staged | None:
        """The training thread's part of ``request``; the rest is the returned commit."""
        s = self.session
        step, state, decision = request.step, request.state, request.decision
        epoch, metrics, metadata = request.epoch, request.metrics, request.metadata
        attachments = request.attachments
        if attachments:
            raise ValueError(
                "attachments are not supported by multi-rank saves yet: save them from one "
                "process (stepvault attach RUN@STEP FILE after the save)"
            )
        background = background and self.async_saver is not None
        t0 = time.perf_counter()
        from ..distributed.api import collective_kind

        # stepvault.save's rule too: a light save under a group is written full (warned once;
        # the handle, SaveInfo and the save event say "full").
        kind = collective_kind(decision.kind)
        if kind != decision.kind:
            s.event("light_as_full", step=step, reason="multi-rank saves are always full")
        part = weights_only(state) if kind == "weights" else state
        rank_mem, rank_staged, disk = self.mem, None, True
        if rank_mem is not None:  # this rank's own copy into node memory (.rank_memory)
            rank_staged, disk = rank_mem.stage(
                step, state, decision, epoch=epoch, metrics=metrics, metadata=metadata
            )
        args: dict[str, Any] = dict(
            run=s.run,
            step=step,
            epoch=epoch,
            metrics=encode_metrics(metrics),
            codec=s.options.codec,
            workers=s.options.workers,
            lineage=s.lineage_ref() if s.scope.coordinator else None,
            metadata=encode_metadata(metadata),
        )
        if rank_staged is not None:
            # The DCP write reads the memory copy's host buffers and shares its chunk
            # digests: each chunk of this rank hashed once for both destinations.
            args["host"] = rank_staged.copies
        try:
            if not disk:
                pass  # in node memory only this time (the tier policy's CopyEvery)
            elif background:
                assert self.async_saver is not None
                future = self.async_saver.save(s.store, part, **args)
            else:
                from ..distributed.api import save_state

                save_state(s.store, part, **args)
        except BaseException as exc:
            exc = save_failed_in(exc, step, s.store.backend.url)
            s.failed(step, exc)
            s.raise_or_warn(exc)
            return None
        finally:
            if rank_staged is not None:
                rank_staged.copies.forget_sources()  # the live tensors are not held
        stall = time.perf_counter() - t0

        def commit() -> tuple[SaveInfo, dict[str, Any]]:
            fields: dict[str, Any] = {"world_size": torch.distributed.get_world_size()}
            if rank_mem is not None:
                try:
                    mem_info, more = rank_mem.commit(step, rank_staged)
                except BaseException:
                    if background and disk:  # it reads the memory copy's buffers: done
                        with contextlib.suppress(BaseException):  # before they are reused
                            future.result()
                    raise
                fields.update(more)  # a failed mem write says so ("mem", "tier": "hot")
                if mem_info is not None:  # ("hot" when some rank's copy is not in memory)
                    fields.setdefault("tier", "mem+hot" if disk else "mem")
                if not disk:
                    if mem_info is None:
                        cause = str(more.get("mem_error", "see the mem_save_failed event"))
                        cause = cause.rstrip(".")
                        exc = StepvaultError(
                            f"step {step} was due in node memory only and its memory save "
                            f"failed on this rank: {cause}. Earlier checkpoints are intact; "
                            "free the node's memory tier (or lower its budget) and relaunch "
                            "the job to resume from the newest one"
                        )
                        s.failed(step, exc)
                        raise exc
                    return mem_info, fields
            if background and disk:
                try:
                    future.result()
                except BaseException as exc:
                    lost = save_failed_in(exc, step, s.store.backend.url)
                    s.failed(step, lost)
                    if lost is exc:
                        raise
                    raise lost from exc
            if rank_staged is not None:  # both writes done: the bytes this rank hashed
                fields["hashed_bytes"] = rank_staged.copies.digests.hashed_bytes
            m = parse_manifest(s.store.read_manifest(s.run, step), f"{s.run}@{step}")
            info = SaveInfo.of_manifest(m, time.perf_counter() - t0, kind)
            return info, fields

        return Staged(stall, background, commit, started=t0, kind=kind)

    def close(self) -> None:
        if self.async_saver is not None:
            self.async_saver.close()


def lease_lost_in(exc: BaseException) -> BaseException:
    """The :class:`LeaseLostError` that DCP's ``CheckpointException`` carries from the
    committing rank (rank 0's fenced commit refused), so that every rank raises the lost
    lease itself rather than DCP's wrapper; any other failure as it is."""
    # CheckpointException.failures: rank -> (exception, traceback summary)
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            failure = failure[0] if isinstance(failure, tuple) and failure else failure
            if isinstance(failure, LeaseLostError):
                return failure
    return exc


def _phase(frames: object) -> str:
    """Where a rank's part of a DCP save failed, from its traceback summary: ``commit``
    (the coordinator's ``finish``: the manifest may or may not have been written),
    ``upload`` (``write_data``: the rank's objects) or ``plan`` (before any write)."""
    names = [getattr(f, "name", "") for f in frames] if isinstance(frames, list) else []
    if "finish" in names or "commit_checkpoint" in names:
        return "commit"
    return "upload" if "write_data" in names else "plan"


def _kind(exc: BaseException) -> str:
    """A word for the cause a user acts on (the exception's class may not have survived
    the pickle between ranks, so its name and message count)."""
    text = f"{type(exc).__name__} {exc}".lower()
    if isinstance(exc, ConnectionError | TimeoutError) or any(
        w in text for w in ("connection", "endpoint", "timed out", "timeout", "unreachable")
    ):
        return "connection"
    if "no space" in text or "outofspace" in text:
        return "no space left"
    return "error"


def save_failed_in(exc: BaseException, step: int, where: str) -> BaseException:
    """What every rank raises for a failed collective save of ``step`` to the store at
    ``where``: the :class:`LeaseLostError` DCP's ``CheckpointException`` carries (see
    :func:`lease_lost_in`); else, when the failure came before the coordinator's commit
    (a rank's upload or plan), a :class:`SaveFailedError` naming the step, the ranks, the
    cause, that nothing was committed and the way out (DCP's wrapper is a
    ``BaseException`` that ``except Exception`` and ``on_save_error="warn"`` let
    through); any other failure as it is."""
    lost = lease_lost_in(exc)
    failures = getattr(exc, "failures", None)
    if lost is not exc or not isinstance(failures, dict) or not failures:
        return lost
    causes: list[str] = []
    for rank, failure in sorted(failures.items()):
        error, frames = (
            failure if isinstance(failure, tuple) and len(failure) == 2 else (failure, [])
        )
        phase = _phase(frames)
        if phase == "commit":  # the manifest may have been written: not "nothing committed"
            return exc
        if "interpreter shutdown" in str(error):
            # The process was ending (the training loop raised, or the script returned,
            # without closing the manager) while this save was in flight: not the storage.
            what = "its process exited during the save (close the manager before exiting)"
        elif phase == "upload":
            what = f"the upload to {where} failed"
        else:
            what = "its part failed"
        detail = f"{type(error).__name__}: {error}".rstrip(".")
        causes.append(f"rank {rank}: {what} ({_kind(error)}): {detail}")
    ranks = tuple(sorted(int(r) for r in failures))
    named = ", ".join(str(r) for r in ranks)
    return SaveFailedError(
        f"the save of step {step} failed on rank{'s' if len(ranks) > 1 else ''} {named}; "
        + "; ".join(causes)
        + f". Nothing of step {step} was committed and every earlier checkpoint is intact. "
        f"Check that every rank can reach {where} and save again (training can go on; the "
        "next save writes the whole state), or relaunch the job to resume from the newest "
        "checkpoint",
        step=step,
        ranks=ranks,
    )
