"""``FilledUpload``: the fill-a-buffer loop that the S3 and GCS uploads share.

Both backends upload an object as a sequence of ``part_size`` buffers taken from a
process-wide :class:`~storage.backends._buffers.BufferPool`: writes are copied into the
current buffer, and a full buffer is handed to the backend (S3 starts a part upload,
GCS holds it for one request or sends it as a resumable chunk). What differs lives in
the subclass; the copy loop, the buffer swap and the stream's file-like surface live
here, once.
"""

from __future__ import annotations

import io
from typing import Any

from storage.backends._buffers import BufferPool

#: Writes are copied this many bytes at a time, so a per-block hook (S3's CRC32C) reads
#: bytes that are still in the CPU cache.
BLOCK = 256 << 10


class FilledUpload(io.RawIOBase):
    """A write-only stream that fills ``part_size`` buffers from ``pool``.

    Every ``write`` is copied into the current buffer ``BLOCK`` bytes at a time; each
    copied block is passed to :meth:`_block_copied` (a no-op here) right after the copy,
    and a buffer that becomes full is passed to :meth:`_part_full`, which must hand it
    on with :meth:`_swap`, send it and empty it (``_fill = 0``), or fail. The upload
    ends with the subclass's ``finish()`` (publish) or ``abort()`` (nothing visible);
    ``close()`` ends nothing, because DCP's transforms close the stream they wrap
    before the writer decides."""

    def __init__(self, pool: BufferPool, part_size: int) -> None:
        super().__init__()
        self._pool = pool
        self._part_size = part_size
        self._buf = pool.take(part_size)
        self._fill = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            take = min(len(view), self._part_size - self._fill, BLOCK)
            end = self._fill + take
            self._buf[self._fill : end] = view[:take]
            self._block_copied(memoryview(self._buf)[self._fill : end])
            self._fill = end
            view = view[take:]
            if self._fill == self._part_size:
                self._part_full()
        return total

    def close(self) -> None:
        if not self.closed:
            super().close()

    # --- for subclasses ---------------------------------------------------------------

    def _block_copied(self, block: memoryview) -> None:
        """Called with every block just copied into the current buffer."""

    def _part_full(self) -> None:
        """The current buffer is full: hand it on with :meth:`_swap`."""
        raise NotImplementedError

    def _swap(self, part_size: int | None = None) -> bytearray:
        """The current buffer, taken out of the stream; an empty one (of ``part_size``
        bytes, if given) takes its place. The caller owns the buffer it gets and gives
        it back to the pool when done with it."""
        if part_size is not None:
            self._part_size = part_size
        full, self._buf = self._buf, self._pool.take(self._part_size)
        self._fill = 0
        return full

    def _filled(self) -> memoryview:
        """What the current buffer holds so far."""
        return memoryview(self._buf)[: self._fill]

    def _release_buffer(self) -> None:
        """Give the current buffer back to the pool (the upload has ended)."""
        buffer, self._buf = self._buf, bytearray()
        self._fill = 0
        if buffer:
            self._pool.give(buffer)
