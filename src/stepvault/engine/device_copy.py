"""Device-to-host copies of a staging area on a side CUDA stream.

The training thread only *enqueues* the copies (its stall), then goes on; the writer
thread waits for them before it reads the host bytes. Two orderings keep it correct:

- the side stream first waits for the current stream, so the copies read the values that
  training computed up to the save call;
- the current stream then waits (on the GPU, not the CPU) for the copies' event, so a
  later kernel of training (the optimizer step writing the parameters in place) cannot
  overwrite a tensor before it has been copied out.

The host side of the next training step (data loading, kernel launches) overlaps the copy;
its kernels queue behind it on the GPU. Nothing here runs without CUDA: with no device
tensor :meth:`DeviceCopies.copy` returns at once and no CUDA call is made.
"""

from __future__ import annotations

from typing import Any


class DeviceCopies:
    """Enqueues ``dst.copy_(src)`` pairs on a side stream; :meth:`wait` for them."""

    def __init__(self) -> None:
        self._stream: Any = None  # created on the first device copy (needs a CUDA context)
        self._done: Any = None  # event recorded after the last batch of copies

    @property
    def pending(self) -> bool:
        """Whether copies were enqueued and not yet waited for."""
        return self._done is not None

    def copy(self, pairs: list[tuple[Any, Any]]) -> None:
        """Enqueue every ``(host dst, device src)`` copy; returns before they run."""
        if not pairs:
            return
        import torch

        main = torch.cuda.current_stream()
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        side = self._stream
        side.wait_stream(main)  # copy what training computed up to this call
        with torch.cuda.stream(side):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                # the caching allocator must not reuse src's memory before the copy ran
                src.record_stream(side)
        done = torch.cuda.Event()
        done.record(side)
        main.wait_event(done)  # later training kernels run after the copy (GPU-side wait)
        self._done = done

    def wait(self) -> None:
        """Block until every enqueued copy has finished (no-op when none is pending)."""
        done, self._done = self._done, None
        if done is not None:
            done.synchronize()
