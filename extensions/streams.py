"""Byte-stream primitives every layer shares: the read loops and the range views.

The read loops live here once: :func:`readinto_exact` (fill a buffer, short only at end
of stream), :func:`read_all`, :func:`skip`, :func:`drain`, :func:`pump` (copy a
stream into a sink) and :func:`fill` (a block buffer that grows with the data). Each
takes any object with ``readinto`` or, failing that, ``read`` (a user's transform may
offer only ``read``).

``SliceView`` answers reads from ``[offset, offset + length)`` of a seekable stream and
never outside it: ``seek`` is relative to the slice for all three ``whence`` values and
positions are clamped to ``[0, length]`` for reading, so ``seek(-n, SEEK_END)`` cannot
escape (torch's ``_create_file_view`` lets it). ``BoundedReader`` hands out exactly the
next ``length`` bytes of a forward-only stream (one item inside a coalesced range).
"""

from __future__ import annotations

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
        self._base.seek(self._offset + self._pos)
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
