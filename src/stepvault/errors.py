"""Exceptions raised by stepvault.

Every error names the problem and, where there is one, the way out. All derive from
:class:`StepvaultError` so a training loop can catch the whole family at once.
"""

from __future__ import annotations

import functools

__all__ = [
    "AttachmentError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CorruptObjectError",
    "ExportError",
    "IntegrityError",
    "InvalidNameError",
    "LeaseHeldError",
    "LeaseLostError",
    "LightBaseError",
    "LockBrokenError",
    "ManifestError",
    "MissingBaseError",
    "MissingObjectError",
    "NoValidCheckpointError",
    "OutOfSpaceError",
    "PlanError",
    "PreconditionFailed",
    "ReadOnlyError",
    "RegistryError",
    "ResumeGapWarning",
    "SaveFailedError",
    "SigningError",
    "SimulationTooLong",
    "StateMismatchError",
    "StepvaultError",
    "StoreNotFoundError",
    "StoreVersionError",
    "TierError",
    "UnknownCodecError",
    "UnsafeBindError",
    "UnsupportedTypeError",
    "UntrustedInputError",
]


class StepvaultError(Exception):
    """Base class of every error stepvault raises on purpose."""


class StoreVersionError(StepvaultError):
    """The store (or a manifest/object in it) was written by a newer, unknown format version."""


class StoreNotFoundError(StepvaultError):
    """No stepvault store at the given root."""


class InvalidNameError(StepvaultError, ValueError):
    """A run, tensor or alias name that could escape its directory or is otherwise unsafe."""


class UnsupportedTypeError(StepvaultError, TypeError):
    """A value in the state cannot be encoded safely (refused at save time)."""


class IntegrityError(StepvaultError):
    """Stored bytes do not match their recorded hash, size or structure."""


class CorruptObjectError(IntegrityError):
    """An object is truncated, has a damaged header, or its content hash does not match.

    ``digest`` names the damaged object when known.
    """

    digest: str | None = None


class MissingObjectError(IntegrityError):
    """A manifest references an object that is not in the store."""


class ManifestError(IntegrityError):
    """A manifest cannot be parsed, fails its checksum, or violates the schema."""


class UnknownCodecError(IntegrityError):
    """An object names a codec this version of stepvault does not know."""


class CheckpointNotFoundError(StepvaultError, LookupError):
    """The requested run or step has no committed checkpoint (or, for ``RUN@latest``,
    no full one)."""


class CheckpointExistsError(StepvaultError):
    """A checkpoint for this run and step is already committed."""


class NoValidCheckpointError(StepvaultError):
    """Every candidate checkpoint failed verification."""

    def __init__(self, message: str, skipped: list | None = None) -> None:
        super().__init__(message)
        self.skipped = list(skipped or [])


class StateMismatchError(StepvaultError, ValueError):
    """The checkpoint does not fit the live training state (keys, shapes, dtypes, types)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        lines = "\n  - ".join(self.problems)
        super().__init__(
            f"checkpoint does not match the live state ({len(self.problems)} problem(s); "
            f"nothing was changed):\n  - {lines}"
        )

    def __reduce__(self) -> tuple[object, ...]:
        # DCP pickles one rank's failure to the others; the default would rebuild it from
        # the message (``problems`` a list of its characters).
        return (type(self), (self.problems,))


class OutOfSpaceError(StepvaultError, OSError):
    """The backend ran out of space during a save; earlier checkpoints are intact."""


# -- one per subsystem ------------------------------------------------------------------
# Defined here so that ``stepvault.errors`` lists every exception; the subsystem that
# raises one imports it from here (and re-exports it where its users look for it).


class PreconditionFailed(StepvaultError, FileExistsError):
    """A conditional write or delete found ``key`` changed since the version the caller
    named (or present, for a create-if-absent): compare-and-set lost the race."""


class LockBrokenError(PreconditionFailed):
    """The store lock this process held was broken while it held it, so it wrote nothing.

    Another process found the lock held while the lease it guards had gone stale (its
    holder stopped: a frozen process or VM) and took the run over. The write is refused as
    a lost compare-and-set; the writer lease then reports who owns the run.
    """


class LeaseHeldError(StepvaultError):
    """Another live writer holds the run's lease."""


class LeaseLostError(LeaseHeldError):
    """This writer's lease was taken over by another writer: nothing more is committed.

    The lease went stale (no heartbeat for ``stale_after`` seconds: a stopped process or VM,
    a long pause, a cut-off network) and another process took the run over. ``owner`` is
    the new holder's ``(host, pid)`` when the lease names one.
    """

    def __init__(self, message: str, *, run: str, owner: tuple[str, int] | None) -> None:
        super().__init__(message)
        self.run = run
        self.owner = owner

    def __reduce__(self) -> tuple[object, ...]:
        # DCP's collectives pickle one rank's exception to the others; the default rebuilds
        # it from ``args`` alone and fails on the keyword-only fields (a TypeError there).
        return (functools.partial(type(self), run=self.run, owner=self.owner), (str(self),))


class SaveFailedError(StepvaultError):
    """A collective save failed before its commit: nothing of ``step`` was committed and
    every earlier checkpoint is intact.

    ``ranks`` are the ranks whose part failed (e.g. an object upload cut by the network);
    the message names them, the cause and the way out. Every rank of the save raises it.
    """

    def __init__(self, message: str, *, step: int, ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.step = step
        self.ranks = ranks

    def __reduce__(self) -> tuple[object, ...]:
        # Pickled between ranks like LeaseLostError: keyword-only fields.
        return (functools.partial(type(self), step=self.step, ranks=self.ranks), (str(self),))


class SigningError(StepvaultError):
    """A key cannot be loaded or used."""


class AttachmentError(StepvaultError):
    """An attachment is refused (bad name, too large, missing file) or not found."""


class MissingBaseError(CorruptObjectError):
    """A delta object cannot be decoded here: its base is missing (or unreadable).

    A CorruptObjectError so that a restore sets this copy of the delta aside (quarantine)
    and reads the object from another tier, or falls back to another checkpoint.
    """


class TierError(StepvaultError):
    """A tier is unknown, misconfigured or unreachable."""


class LightBaseError(IntegrityError):
    """The base of a light checkpoint is gone, damaged or was replaced since."""


class RegistryError(StepvaultError):
    """A registry operation that cannot be done (unknown model/alias, nothing to roll back)."""


class ExportError(StepvaultError):
    """An export cannot be made as asked (missing attachment, occupied folder...)."""


class UntrustedInputError(StepvaultError):
    """The input format needs unpickling and the caller did not pass ``trust=True``."""


class PlanError(StepvaultError, ValueError):
    """A plan's input is missing or out of range; the message names the option to fix."""


class SimulationTooLong(PlanError):
    """A plan's failure simulation would need more events than it is allowed (a save cost
    of many MTBFs: a save almost never completes before the next failure); the plan states
    the closed form alone."""


class ReadOnlyError(StepvaultError, PermissionError):
    """A write to a store this process may not write: a local store without write
    permission or on a read-only mount (the message names the store; reads still work), or
    a write through the dashboard's read-only view of a store."""


class UnsafeBindError(StepvaultError, ValueError):
    """A non-loopback address was asked for without a token."""


class ResumeGapWarning(RuntimeWarning):
    """A resume left some training state fresh because the checkpoint does not hold it
    (an import whose source had no optimizer, scheduler or RNG state: its
    ``metadata["missing"]`` says why). Training goes on, but not exactly as the original
    run would; ``warnings.simplefilter("error", ResumeGapWarning)`` makes it fatal."""
