"""Read-only views of a byte range: file slices and bounded sub-streams.

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
        got = 0
        while got < want:
            n = self._base.readinto(view[got:want])  # type: ignore[attr-defined]
            if not n:
                break
            got += n
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

    @property
    def remaining(self) -> int:
        return self._remaining

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = min(len(view), self._remaining)
        if want <= 0:
            return 0
        n = self._base.readinto(view[:want])  # type: ignore[attr-defined]
        n = n or 0
        self._remaining -= n
        return n

    def skip_rest(self) -> int:
        """Consume what is left of the range; returns how many bytes were missing."""
        scratch = bytearray(min(self._remaining, 1 << 20) or 1)
        while self._remaining > 0:
            if not self.readinto(scratch):
                break
        return self._remaining
