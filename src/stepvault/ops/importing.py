"""Where :func:`import_dcp` and :class:`UntrustedInputError` were first defined; both now
live in :mod:`stepvault.ops.migrate` beside the other importers (DCP in its ``dcp``
module). This module keeps the old import path working."""

from __future__ import annotations

from .migrate import UntrustedInputError, import_dcp

__all__ = ["UntrustedInputError", "import_dcp"]
