"""The position of a data loader in its epoch, for an exact resume.

A shuffled ``DataLoader`` draws each epoch's order when its iterator is built (the base seed
for the workers at ``iter()``, the permutation at the first batch) from the generators it
holds (``generator=``, the sampler's ``generator``) or, without one, from the global torch
RNG. So the epoch's order is a function of those generators' states *at the start of the
epoch*. :class:`ResumableLoader` records them, with the number of batches consumed, and on
resume builds the epoch's iterator from the same states and skips the consumed batches:
by advancing the sampler alone (no sample is loaded) in a single process, by loading and
discarding them with workers (so that the workers' own RNG draws are replayed too).

Wrapped around torchdata's ``StatefulDataLoader`` it keeps that loader's own state and
adds what the loader loses (torchdata 0.11, measured): a restored iterator resets the
shared generator to its state at the start of the epoch and redraws the permutation, but not
the base seed drawn after it, so every later epoch is shuffled differently from an
uninterrupted run. The wrapper puts the generators back to their saved states once the
restored iterator exists.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch

#: Marks a state written by :class:`ResumableLoader` (older checkpoints of a wrapped
#: ``StatefulDataLoader`` hold that loader's own state).
FORMAT = "stepvault.loader/1"


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a loader draws its order from (each once)."""
    found: list[torch.Generator] = []
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidates = [
        getattr(loader, "generator", None),
        getattr(sampler, "generator", None),
        getattr(getattr(batch_sampler, "sampler", None), "generator", None),
    ]
    for gen in candidates:
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
    return found


def draws_from_global_rng(loader: Any) -> bool:
    """Whether building an epoch's iterator draws from the global torch RNG: a loader
    without ``generator=`` draws its workers' base seed there, and torch's
    ``RandomSampler`` without a generator draws its permutation's seed there."""
    if getattr(loader, "generator", None) is None:
        return True
    for sampler in (
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    ):
        if isinstance(sampler, torch.utils.data.RandomSampler) and sampler.generator is None:
            return True
    return False


def is_stateful_loader(loader: Any) -> bool:
    """A loader that records its own position (torchdata's ``StatefulDataLoader``)."""
    if getattr(loader, "use_stateful_dataloader", True) is False:
        return False  # Accelerate's prepared loaders have state_dict() either way
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


def _states(gens: list[torch.Generator]) -> list[torch.Tensor]:
    return [g.get_state() for g in gens]


def _set_states(gens: list[torch.Generator], states: list[Any], what: str) -> None:
    if len(states) != len(gens):
        raise ValueError(
            f"stepvault: the checkpoint holds {len(states)} generator state(s) for {what}, "
            f"the loader has {len(gens)}: build the loader as the run that saved did "
            "(same generator=, same sampler)"
        )
    for gen, state in zip(gens, states):
        gen.set_state(state)


def _skip_without_loading(it: Any, batches: int) -> bool:
    """Advance a single-process iterator over a map-style dataset by ``batches`` through
    its sampler alone (no sample is loaded); False when the iterator is not one."""
    from torch.utils.data.dataloader import _DatasetKind

    if (
        getattr(it, "_num_workers", 1) != 0
        or getattr(it, "_dataset_kind", None) != _DatasetKind.Map
        or not hasattr(it, "_sampler_iter")
        or not hasattr(it, "_num_yielded")
    ):
        return False
    for _ in range(batches):
        next(it._sampler_iter)
    it._num_yielded += batches
    return True


class _Counting(Iterator[Any]):
    """The loader's iterator, counting what it yields for :class:`ResumableLoader`."""

    def __init__(self, owner: ResumableLoader, inner: Iterator[Any]) -> None:
        self.owner = owner
        self.inner = inner

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self.inner)
        except StopIteration:
            self.owner._finished = True
            raise
        self.owner._batches += 1
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class ResumableLoader:
    """A data loader whose position in the epoch is part of the checkpoint.

    ``ResumableLoader(loader)`` iterates like ``loader`` and adds ``state_dict()`` /
    ``load_state_dict()``: put it in the checkpointed state (``state["loader"] = it``) and
    iterate it instead of the loader. After a restore, the next ``iter()`` continues the
    interrupted epoch with the same order and the same remaining batches, and every later
    epoch is shuffled as in an uninterrupted run.

    ``loader`` is an ordinary ``torch.utils.data.DataLoader`` (shuffled or not, with or
    without workers) or torchdata's ``StatefulDataLoader``. Give it its own
    ``generator=torch.Generator().manual_seed(s)``: then building an iterator does not draw
    from the global torch RNG that dropout uses (without one the wrapper replays those draws
    on a borrowed global RNG, which it gives back afterwards).

    ``at_epoch_end`` says what the first ``iter()`` after restoring a checkpoint taken
    after the epoch's last batch (but before the loop saw the end of the epoch) gives:
    ``"finish"`` (default) the rest of that epoch, i.e. nothing, so that a ``for batch in
    loader`` loop runs its end-of-epoch code and then asks for the next epoch, as the
    uninterrupted run did; ``"next"`` the next epoch at once, for trainers that count the
    batches of an epoch and never ask the finished iterator again (Lightning).

    Limits (a warning at the first save says so): an ``IterableDataset`` without
    ``state_dict`` is re-iterated from its start and the consumed batches discarded, which
    is exact only if it yields the same sequence every time it is iterated; with
    ``persistent_workers=True`` the workers' RNGs carry over between epochs, which new
    workers after a resume cannot reproduce (random augmentations drawn in workers differ).
    """

    def __init__(self, loader: Any, *, at_epoch_end: str = "finish") -> None:
        if at_epoch_end not in ("finish", "next"):
            raise ValueError(f"at_epoch_end must be 'finish' or 'next', got {at_epoch_end!r}")
        if isinstance(loader, ResumableLoader):
            loader = loader.loader
        self.loader: Any = loader
        self.at_epoch_end = at_epoch_end
        self._stateful = is_stateful_loader(loader)
        self._pending: dict[str, Any] | None = None
        self._batches = 0
        self._finished = False
        self._epoch_generators: list[torch.Tensor] | None = None
        self._epoch_torch_rng: torch.Tensor | None = None
        self._warned = False

    # ---------------------------------------------------------------- the loader's face
    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        # sampler, batch_size, dataset ...: what trainers look up on a loader.
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __repr__(self) -> str:
        return f"ResumableLoader({self.loader!r})"

    def __iter__(self) -> Iterator[Any]:
        pending, self._pending = self._pending, None
        gens = loader_generators(self.loader)
        if (
            pending is not None
            and not pending.get("finished")
            and (self.at_epoch_end == "finish" or not self._at_end(pending))
        ):
            inner = self._resume(pending, gens)
            self._batches = int(pending["batches"])
        else:
            if pending is not None:
                # Saved after the epoch's last batch: the next epoch starts from the
                # generators as they were then, exactly as the uninterrupted run's did.
                _set_states(gens, pending["generators"], "this loader")
            self._epoch_generators = _states(gens)
            self._epoch_torch_rng = (
                torch.get_rng_state() if draws_from_global_rng(self.loader) else None
            )
            inner = iter(self.loader)
            self._batches = 0
        self._finished = False
        return _Counting(self, inner)

    def _at_end(self, state: dict[str, Any]) -> bool:
        length = state.get("length")
        return bool(state.get("finished")) or (length is not None and state["batches"] >= length)

    def _resume(self, state: dict[str, Any], gens: list[torch.Generator]) -> Iterator[Any]:
        self._epoch_generators = list(state["epoch_generators"])
        self._epoch_torch_rng = state.get("epoch_torch_rng")
        if self._stateful:
            # The loader restores its own position; it leaves its generators one draw short
            # (see the module docstring), so they are put back once its iterator exists.
            self.loader.load_state_dict(state["loader"])
            inner = iter(self.loader)
            _set_states(gens, state["generators"], "this loader")
            return inner
        borrowed = None
        if self._epoch_torch_rng is not None:
            borrowed = torch.get_rng_state()
            torch.set_rng_state(self._epoch_torch_rng)
        try:
            _set_states(gens, self._epoch_generators, "this loader")
            inner = iter(self.loader)
            batches = int(state["batches"])
            if not _skip_without_loading(inner, batches):
                # Workers or an iterable dataset: load and discard, which also replays
                # whatever the workers draw from their own RNGs.
                for _ in range(batches):
                    next(inner)
        finally:
            if borrowed is not None:
                torch.set_rng_state(borrowed)
        return inner

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The position: batches consumed this epoch, the generators' states at the epoch's
        start and now (plus the loader's own state for a ``StatefulDataLoader``)."""
        if self._pending is not None:
            return dict(self._pending)  # restored but not iterated yet: still that position
        self._warn_once()
        gens = loader_generators(self.loader)
        try:
            length: int | None = len(self.loader)
        except TypeError:
            length = None
        state: dict[str, Any] = {
            "format": FORMAT,
            "batches": self._batches,
            "length": length,
            "finished": self._finished,
            "epoch_generators": self._epoch_generators
            if self._epoch_generators is not None
            else _states(gens),
            "epoch_torch_rng": self._epoch_torch_rng,
            "generators": _states(gens),
        }
        if self._stateful:
            state["loader"] = self.loader.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s position on the next ``iter()``."""
        if state.get("format") != FORMAT:
            if self._stateful:  # the wrapped loader's own state, saved without the wrapper
                self.loader.load_state_dict(state)
                self._pending = None
                return
            raise ValueError(
                "stepvault: this is not a ResumableLoader state (no 'format': "
                f"{FORMAT!r}); was the checkpoint written with another loader?"
            )
        self._pending = dict(state)

    def _warn_once(self) -> None:
        if self._warned:
            return
        self._warned = True
        if getattr(self.loader, "num_workers", 0) > 0 and getattr(
            self.loader, "persistent_workers", False
        ):
            warnings.warn(
                "stepvault: the loader keeps its workers between epochs "
                "(persistent_workers=True), so their RNGs carry over from earlier epochs; a "
                "resumed run starts new workers seeded for the current epoch only, and random "
                "draws inside the workers (augmentations) differ after a resume. The data "
                "order is still exact; for exact augmentations use persistent_workers=False "
                "or seed them per sample (e.g. from the index and the epoch)",
                RuntimeWarning,
                stacklevel=3,
            )
        dataset = getattr(self.loader, "dataset", None)
        if isinstance(dataset, torch.utils.data.IterableDataset) and not is_stateful_loader(
            dataset
        ):
            warnings.warn(
                f"stepvault: the loader iterates {type(dataset).__name__}, an IterableDataset "
                "without state_dict()/load_state_dict(): a mid-epoch resume iterates it again "
                "from its start and discards the batches already consumed, which is exact only "
                "if it yields the same sequence every time (seed its shuffling, e.g. from the "
                "epoch, never from the clock or os.urandom); give it state_dict/load_state_dict "
                "to resume exactly and without the replay",
                RuntimeWarning,
                stacklevel=3,
            )


def resumable(loader: Any, *, at_epoch_end: str = "finish") -> ResumableLoader:
    """``loader`` wrapped in a :class:`ResumableLoader` (returned as is when it is one)."""
    if isinstance(loader, ResumableLoader):
        return loader
    return ResumableLoader(loader, at_epoch_end=at_epoch_end)
