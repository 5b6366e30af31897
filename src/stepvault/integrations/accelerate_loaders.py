"""Accelerate's stateful data loaders at an epoch's last batch, for a checkpoint taken there.

Split from :mod:`.accelerate`: how a prepared loader's recorded position is read (and, while
a checkpoint is taken, corrected) is one concern of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accelerate import Accelerator


def _stateful_loaders(accelerator: Accelerator) -> list[Any]:
    """The prepared loaders that record their position (``use_stateful_dataloader=True``)."""
    return [dl for dl in accelerator._dataloaders if getattr(dl, "use_stateful_dataloader", 0)]


#: The key of torchdata's ``StatefulDataLoader`` state that Accelerate's prepared loaders
#: set to their ``end_of_dataloader`` (``DataLoaderAdapter._update_state_dict``).
_FINISHED = "_iterator_finished"


def _inside_last_batch(loader: Any) -> bool:
    """Whether the loop is at ``loader``'s last batch and has not yet asked it for the next
    one: the loader has flagged the end of its data, but its iteration has not ended (it
    is still among the data loaders the ``GradientState`` is iterating)."""
    if not getattr(loader, "end_of_dataloader", False):
        return False
    refs = getattr(getattr(loader, "gradient_state", None), "dataloader_references", None)
    return any(ref is loader for ref in refs or ())


@contextmanager
def _epoch_end_positions(accelerator: Accelerator) -> Iterator[None]:
    """While a checkpoint is taken: the state of a stateful loader that is at its epoch's
    last batch says "every batch consumed, the epoch not over yet" instead of "finished".

    Accelerate flags the end of the data *before* it yields the last batch, and torchdata
    starts a new epoch at the next ``iter()`` of a loader restored from a finished state.
    A checkpoint taken after the last batch (the usual ``save`` at that optimizer step)
    therefore resumed with a whole epoch at once, while the loop's epoch counter, restored
    with it, had not been advanced yet: ``loader.set_epoch(epoch)`` replayed the finished
    epoch. Recorded as not finished, the restored loader's first ``iter()`` yields no batch
    (none was left of that epoch), the loop runs its end-of-epoch code (the counter goes
    up) and the next ``iter()`` starts the next epoch, as the uninterrupted run did (what
    :class:`~stepvault.ResumableLoader` does with ``at_epoch_end="finish"``). A checkpoint
    taken once the loop has left the epoch keeps the finished state, so its resume starts
    the next epoch at once. The loader's own state is put back afterwards.
    """
    swapped: list[tuple[Any, dict[str, Any]]] = []
    try:
        for loader in _stateful_loaders(accelerator):
            held = getattr(loader, "dl_state_dict", None)
            if isinstance(held, dict) and held.get(_FINISHED) and _inside_last_batch(loader):
                loader.dl_state_dict = {**held, _FINISHED: False}
                swapped.append((loader, held))
        yield
    finally:
        for loader, held in swapped:
            loader.dl_state_dict = held
