"""Exceptions raised by stepvault.

Every error names the problem and, where there is one, the way out. All derive from
:class:`StepvaultError` so a training loop can catch the whole family at once.
"""

from __future__ import annotations

__all__ = [
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CorruptObjectError",
    "IntegrityError",
    "InvalidNameError",
    "ManifestError",
    "MissingObjectError",
    "NoValidCheckpointError",
    "OutOfSpaceError",
    "StateMismatchError",
    "StepvaultError",
    "StoreNotFoundError",
    "StoreVersionError",
    "UnknownCodecError",
    "UnsupportedTypeError",
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
    """The requested run or step has no committed checkpoint."""


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


class OutOfSpaceError(StepvaultError, OSError):
    """The backend ran out of space during a save; earlier checkpoints are intact."""
