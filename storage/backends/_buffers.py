"""``BufferPool``: upload buffers kept for reuse across the saves of a process.

Fresh anonymous memory costs a page fault per page the first time it is written (~0.8 s
of CPU per GiB measured on a small VM, more than sending the bytes); a long-lived job
that checkpoints again and again faults its buffers in once. The S3 and GCS backends
each keep one pool for the whole process.
"""

from __future__ import annotations

import threading


class BufferPool:
    """Idle buffers, at most ``retained`` bytes of them; thread-safe."""

    def __init__(self, retained: int) -> None:
        self.retained = retained
        self._idle: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        """A buffer of ``size`` bytes, contents undefined: a kept one when one fits."""
        with self._lock:
            for i, buffer in enumerate(self._idle):
                if len(buffer) == size:
                    return self._idle.pop(i)
        return bytearray(size)

    def give(self, buffer: bytearray) -> None:
        """Hand a buffer back: kept if there is room (buffers of other sizes make room
        first), else freed."""
        with self._lock:
            kept = sorted(self._idle, key=lambda b: len(b) == len(buffer))
            while kept and sum(map(len, kept)) + len(buffer) > self.retained:
                if len(kept[0]) == len(buffer):
                    return  # full of buffers of this size already
                kept.pop(0)
            if len(buffer) <= self.retained:
                kept.append(buffer)
            self._idle = kept

    def clear(self) -> None:
        """Free every kept buffer."""
        with self._lock:
            self._idle = []
