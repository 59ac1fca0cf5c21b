"""What one save holds of the persist worker's staging buffers (:class:`Lease`)."""

from __future__ import annotations

import threading

from storage.checkpoint.persist._cuda import InFlight


class Lease:
    """The staging buffers, held by one save until the worker has read them (or the
    save is given up: an unreleased lease is released when it is collected).
    ``copies``: the stage's copies from CUDA still in flight, if any; nothing reads the
    buffers before :meth:`wait_copied`, and releasing waits for them too (the buffers
    and their CUDA registration must outlive every copy into them)."""

    def __init__(self, free: threading.Event, copies: InFlight | None = None) -> None:
        self._free: threading.Event | None = free
        self.copies = copies

    def wait_copied(self) -> None:
        """Return once the staged copy is complete (at once when it was from CPU)."""
        if self.copies is not None:
            self.copies.wait()

    def release(self) -> None:
        free, self._free = self._free, None  # once: the next save may hold the event
        if free is not None:
            try:
                self.wait_copied()
            finally:
                free.set()

    __del__ = release
