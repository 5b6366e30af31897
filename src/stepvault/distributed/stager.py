"""The staging buffers of asynchronous multi-rank saves, kept across saves.

Imported only where an asynchronous save starts (``DefaultStager`` is not in every torch
release that stepvault supports for synchronous saves).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.staging import DefaultStager


class KeptStager(DefaultStager):
    """A ``DefaultStager`` that only its owner closes (:meth:`release`).

    torch 2.11 (seen on a GPU machine) closes the ``StateDictStager`` inside the stager
    passed to ``async_save`` after each upload: its deep-copy table is emptied, so the
    next save failed with ``KeyError: <class 'type'>`` (a state dict is an
    ``OrderedDict``), and the cached pinned buffers that make later saves a plain copy
    were gone. Closes from anyone but the owner, of this stager or of the
    ``StateDictStager`` inside it, are ignored and counted, so every torch release keeps
    the buffers from save to save.
    """

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        #: closes by anyone but the owner, ignored
        self.ignored_closes = 0
        inner = getattr(self, "_state_dict_stager", None)
        self._inner_close = getattr(inner, "close", None)
        if inner is not None and self._inner_close is not None:
            inner.close = self._ignore  # an instance attribute shadows the method

    def _ignore(self) -> None:
        self.ignored_closes += 1

    def close(self) -> None:
        self._ignore()

    def release(self) -> None:
        """Free the cached staging buffers (the owner's close)."""
        inner = getattr(self, "_state_dict_stager", None)
        if inner is not None and self._inner_close is not None:
            inner.close = self._inner_close
        super().close()
