"""Byte-stream primitives every layer shares: the read loops and the range views.

The read loops live here once: :func:`readinto_exact` (fill a buffer, short only at end
of stream), :func:`read_all`, :func:`skip`, :func:`drain`, :func:`pump` (copy a
stream into a sink) and :func:`fill` (a block buffer that grows with the data). Each
takes any object with ``readinto`` or, failing that, ``read`` (a user's transform may
offer only ``read``). So does the write side of every block codec: :class:`BlockWriter`
cuts what is written into blocks of a fixed size.

``SliceView`` answers reads from ``[offset, offset + length)`` of a seekable stream and
never outside it: ``seek`` is relative to the slice for all three ``whence`` values and
positions are clamped to ``[0, length]`` for reading, so ``seek(-n, SEEK_END)`` cannot
escape (torch's ``_create_file_view`` lets it). ``BoundedReader`` hands out exactly the
next ``length`` bytes of a forward-only stream (one item inside a coalesced range).
"""

from __future__ import annotations

import abc
import errno
import io
import os
from typing import IO, Any


class SliceView(io.RawIOBase):
    def __init__(self, base: IO[bytes], offset: int, length: int) -> None:
        if offset < 0 or length < 0:
            raise ValueError(f"invalid slice offset={offset} length={length}")
        super().__init__()
        self._base = base
        self._offset = offset
        self._length = length
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_SET:
            target = pos
        elif whence == os.SEEK_CUR:
            target = self._pos + pos
        elif whence == os.SEEK_END:
            target = self._length + pos
        else:
            raise ValueError(f"invalid whence {whence}")
        if target < 0:
            raise ValueError(f"negative seek position {target} in a slice of {self._length} bytes")
        self._pos = target
        return target

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = min(len(view), self._length - self._pos)
        if want <= 0:
            return 0
        try:
            self._base.seek(self._offset + self._pos)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            return 0  # past the largest offset the file system allows: nothing is there
        got = readinto_exact(self._base, view[:want])
        self._pos += got
        return got


class BoundedReader(io.RawIOBase):
    """The next ``length`` bytes of ``base``; forward-only, never reads past them."""

    def __init__(self, base: IO[bytes], length: int) -> None:
        super().__init__()
        self._base = base
        self._remaining = length

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = min(len(view), self._remaining)
        if want <= 0:
            return 0
        n = self._base.readinto(view[:want])  # type: ignore[attr-defined]
        n = n or 0
        self._remaining -= n
        return n


CHUNK = 1 << 20


def readinto_exact(stream: Any, view: memoryview) -> int:
    """Fill ``view`` from ``stream``; returns how many bytes arrived, fewer only at end
    of stream."""
    got = 0
    total = len(view)
    readinto = getattr(stream, "readinto", None)
    while got < total:
        if readinto is not None:
            n = readinto(view[got:]) or 0
        else:
            chunk = stream.read(total - got)
            n = len(chunk)
            view[got : got + n] = chunk
        if not n:
            break
        got += n
    return got


def pump(source: Any, sink: Any, *, limit: int | None = None, chunk: int = CHUNK) -> int:
    """Copy ``source`` into ``sink`` (``None`` drops the bytes) until end of stream, or
    until ``limit`` bytes went; returns how many bytes went. Uses one buffer of at most
    ``chunk`` bytes, never one the size of the stream."""
    size = chunk if limit is None else max(1, min(chunk, limit))
    view = memoryview(bytearray(size))
    done = 0
    while limit is None or done < limit:
        want = size if limit is None else min(size, limit - done)
        n = readinto_exact(source, view[:want])
        if not n:
            break
        if sink is not None:
            sink.write(view[:n])
        done += n
        if n < want:
            break
    return done


def skip(stream: Any, count: int) -> int:
    """Read and drop the next ``count`` bytes; returns how many there were."""
    return pump(stream, None, limit=count, chunk=1 << 16) if count > 0 else 0


def drain(stream: Any) -> int:
    """Read and drop the rest of ``stream``; returns how many bytes that was."""
    return pump(stream, None, chunk=1 << 16)


def read_all(stream: Any, *, chunk: int = CHUNK, limit: int | None = None) -> bytes:
    """The rest of ``stream`` as bytes, read ``chunk`` bytes at a time (``RawIOBase``'s
    own ``readall`` goes 8 KiB at a time: a round trip each on object stores). With a
    ``limit``, stops after ``limit + 1`` bytes, so a caller can tell a stream longer
    than ``limit`` without holding more of it."""
    parts: list[bytes] = []
    size = chunk if limit is None else max(1, min(chunk, limit + 1))
    left = None if limit is None else limit + 1
    buffer = bytearray()  # grows with the stream (see fill): small items stay small
    while left is None or left > 0:
        want = size if left is None else min(size, left)
        n = fill(stream, buffer, want)
        if not n:
            break
        parts.append(bytes(memoryview(buffer)[:n]))
        if left is not None:
            left -= n
        if n < want:
            break
    return b"".join(parts)


def fill(stream: Any, buffer: bytearray, size: int, *, first: int = 1 << 16) -> int:
    """Read up to ``size`` bytes of ``stream`` into the start of ``buffer``; returns how
    many arrived (fewer only at end of stream). ``buffer`` grows, from ``first`` bytes
    and doubling, only while the stream keeps delivering: a decoder's block buffer then
    costs what the item holds, not the block size its descriptor claims."""
    got = 0
    while got < size:
        if got == len(buffer):
            buffer.extend(bytes(min(size, max(first, 2 * len(buffer))) - len(buffer)))
        room = min(len(buffer), size)
        n = readinto_exact(stream, memoryview(buffer)[got:room])
        got += n
        if got < room:
            break
    return got


class BlockWriter(io.RawIOBase):
    """The writer of a block codec: what is written reaches :meth:`emit` in blocks of
    exactly ``block_size`` bytes, and what is left at ``close`` (shorter, maybe empty)
    reaches :meth:`finish`; then ``out`` is closed (a transform closes what it wraps).

    A write that covers whole blocks is emitted straight from the caller's buffer, with
    no copy; the rest is staged in a buffer that grows to what the item needs (at most
    a block), so thousands of small items do not each cost a block of zeroed memory.
    ``flush`` never cuts a block short. ``block_size`` 0 emits every write as it comes.
    Subclasses write their output to ``self._out``.
    """

    def __init__(self, out: IO[bytes], block_size: int) -> None:
        super().__init__()
        self._out = out
        self._block = block_size
        self._staged = bytearray()
        self._fill = 0

    @abc.abstractmethod
    def emit(self, block: memoryview) -> None:
        """Encode one block (a full one, or the last, shorter one) into ``self._out``."""

    def finish(self, rest: memoryview) -> None:
        """Encode what is left at ``close``; default: emit it as a last block, if any."""
        if len(rest):
            self.emit(rest)

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        if not self._block:
            self.emit(view)
            return total
        pos = 0
        while pos < total:
            if self._fill == 0 and total - pos >= self._block:
                self.emit(view[pos : pos + self._block])
                pos += self._block
                continue
            n = min(self._block - self._fill, total - pos)
            self._staged[self._fill : self._fill + n] = view[pos : pos + n]
            self._fill += n
            pos += n
            if self._fill == self._block:
                self.emit(memoryview(self._staged)[: self._fill])
                self._fill = 0
        return total

    def flush(self) -> None:
        if not self.closed:
            self._out.flush()

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.finish(memoryview(self._staged)[: self._fill])
        finally:
            self._staged = bytearray()
            super().close()  # flushes the output while it is still open
        self._out.close()
