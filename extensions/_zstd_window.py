"""zstd decoders whose memory is bounded by what the item can need, not by its headers.

A zstd frame's header declares the window its matches may reach back over, and a
decoder allocates that window before the first block, whatever the frame then holds: a
few bytes can claim 128 MiB (zstd's default limit), and every reader thread would hold
it. Every decoder here allows a frame at most ``window`` bytes: :data:`WINDOW_FLOOR`
(what every writer of ``stream.zstd/1`` declares below zstd's ultra levels) or, where
the reader knows it, the item's plain size rounded up to a power of two
(:func:`window_for`).

Items written at an ultra level (20-22) before dcp-storage bounded its frames' windows
declare 32 to 128 MiB for frames of at most 4 MiB. A frame never reaches back further
than its own plain bytes, so such a frame decodes the same within a smaller window, as
long as it holds no more than that: a stream whose first frame declares more than
``window`` is decoded frame by frame (:class:`Clamped`), each frame held whole (at most
:data:`~extensions.base.MAX_FRAME_BYTES` stored bytes) with its header rewritten to
declare ``window``, and refused when it decodes to more than ``window`` bytes (the
output stops there, before any match could reach past the window it was decoded in).
"""

from __future__ import annotations

import io
import threading
from typing import IO, Any, cast

from extensions.base import MAX_FRAME_BYTES
from extensions.errors import printable
from extensions.streams import read_all, readinto_exact, skip

#: The window a reader allows a frame of an item of unknown or small plain size: what
#: every writer of ``stream.zstd/1`` declares (ours: at most 4 MiB, 8 MiB at level 19
#: before ``zstd.WINDOW_LOG``; torch's: 2 MiB; the ``zstd`` tool: at most 8 MiB below
#: its ultra levels).
WINDOW_FLOOR = 8 << 20
#: The most a reader allows, for an item of that plain size or more: zstd's own default
#: limit, the most any earlier reader allowed.
WINDOW_CEILING = 1 << 27
_MAGIC = 0xFD2FB528
_SKIPPABLE = 0x184D2A50  # and the 15 values above it
_FCS_SIZE = (0, 2, 4, 8)
_DICT_SIZE = (0, 1, 2, 4)
_DAMAGED = "the stored bytes are damaged or hostile: restore the file or re-save the checkpoint"


def window_for(plain_bytes: int | None) -> int:
    """The largest window a decoder allows a frame of an item that decodes to at most
    ``plain_bytes`` (``None``: not known): :data:`WINDOW_FLOOR`, or the plain size
    rounded up to a power of two, up to :data:`WINDOW_CEILING`."""
    if plain_bytes is None or plain_bytes <= WINDOW_FLOOR:
        return WINDOW_FLOOR
    return min(WINDOW_CEILING, 1 << (plain_bytes - 1).bit_length())


def declared_window(header: Any) -> int | None:
    """The window the zstd frame header at the start of ``header`` declares; ``None``
    when it declares none (a single-segment frame: its content size is its window, and
    the decoder's limit applies to it) or is no frame header."""
    if len(header) < 6 or int.from_bytes(header[:4], "little") != _MAGIC or header[4] & 0x20:
        return None
    exponent, mantissa = header[5] >> 3, header[5] & 7
    base = 1 << (10 + exponent)
    return base + base // 8 * mantissa


def refused(exc: Exception, window: int, clamped: int = 0) -> str:
    """What to say of ``exc``, a ``zstandard.ZstdError`` of a decoder that allowed
    ``window`` bytes: a frame asked for more, one that declared ``clamped`` bytes holds
    more than ``window`` (:class:`Clamped`), or what zstd said."""
    text = printable(str(exc), 200)
    if clamped:
        return (
            f"zstd: a frame declares a window of {clamped} bytes, more than the {window} "
            f"this item can need, and does not decode within {window} ({text}); {_DAMAGED}"
        )
    if "too much memory" in text:
        return (
            f"zstd: a frame declares a window over the {window} bytes this item can need "
            f"(too much memory for decoding); refused unread: {_DAMAGED}"
        )
    return f"zstd: {text}"


class _Decompressors(threading.local):
    def __init__(self) -> None:
        self.found: dict[tuple[int, bool], Any] = {}


_decompressors = _Decompressors()


def decompressor(window: int, *, magicless: bool = False) -> Any:
    """This thread's ``zstandard.ZstdDecompressor`` that refuses a frame declaring a
    window over ``window`` bytes (``magicless``: of frames without their magic number),
    built once per thread and reused (a context is not thread-safe, and building one
    per frame would cost more than decoding a small one). Every decoder of frames held
    in memory takes its context here; :func:`refused` says what it raised."""
    key = (window, magicless)
    found = _decompressors.found.get(key)
    if found is None:
        import zstandard

        form = zstandard.FORMAT_ZSTD1_MAGICLESS if magicless else zstandard.FORMAT_ZSTD1
        found = zstandard.ZstdDecompressor(max_window_size=window, format=form)
        _decompressors.found[key] = found
    return found


def open_reader(source: Any, window: int, *, across_frames: bool, shared: bool) -> IO[bytes]:
    """A reader of the plain bytes of the zstd stream in ``source`` (a buffer, or a
    reader), allowing each frame ``window`` bytes, stopping at the end of the first
    frame unless ``across_frames``; ``shared``: with this thread's context (a decoder
    that reads one stream at a time), else one of its own."""
    import zstandard

    if isinstance(source, memoryview):
        head = bytes(source[:6])
    else:
        first = bytearray(6)
        head = bytes(first[: readinto_exact(source, memoryview(first))])
        source = _Prefixed(head, source)
    declared = declared_window(head)
    if declared is not None and declared > window:
        base = io.BytesIO(source) if isinstance(source, memoryview) else source
        return cast(IO[bytes], Clamped(base, window, across_frames))
    context = decompressor(window) if shared else zstandard.ZstdDecompressor(max_window_size=window)
    reader = context.stream_reader(source, read_across_frames=across_frames)
    return cast(IO[bytes], _Reader(reader, window))


class _Prefixed(io.RawIOBase):
    """``head`` (bytes already read from ``base``), then the rest of ``base``."""

    def __init__(self, head: bytes, base: Any) -> None:
        super().__init__()
        self._head = head
        self._base = base

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> Any:
        if self._head:
            cut = len(self._head) if size is None or size < 0 else size
            head, self._head = self._head[:cut], self._head[cut:]
            return head
        return self._base.read(size)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if self._head:
            data = self.read(len(view))
            view[: len(data)] = data
            return len(data)
        return readinto_exact(self._base, view)


class _Reader(io.RawIOBase):
    """A zstd ``stream_reader`` whose errors say what was refused (:func:`refused`)."""

    def __init__(self, reader: Any, window: int) -> None:
        super().__init__()
        import zstandard

        self._reader = reader
        self._window = window
        self._error = zstandard.ZstdError

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        try:
            return int(self._reader.readinto(buffer))
        except self._error as exc:
            raise ValueError(refused(exc, self._window)) from None

    def readall(self) -> bytes:
        return read_all(self)


class Clamped(io.RawIOBase):
    """The plain bytes of the zstd stream ``base`` (a reader) whose first frame declares
    a window over ``window`` bytes, decoded one frame at a time: each held whole, its
    window rewritten to ``window`` when it declares more, decoded to at most ``window``
    bytes (see the module's docstring); only the first unless ``across_frames``."""

    def __init__(self, base: Any, window: int, across_frames: bool) -> None:
        super().__init__()
        self._base = base
        self._window = window
        self._across = across_frames
        self._plain = memoryview(b"")
        self._done = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        while not self._plain:
            if self._done:
                return 0
            self._plain = memoryview(self._next_frame())
        n = min(len(view), len(self._plain))
        view[:n] = self._plain[:n]
        self._plain = self._plain[n:]
        return n

    def readall(self) -> bytes:
        return read_all(self)

    def _exact(self, size: int) -> bytearray:
        data = bytearray(size)
        if readinto_exact(self._base, memoryview(data)) != size:
            raise ValueError(f"zstd: the stream ends inside a frame; {_DAMAGED}")
        return data

    def _next_frame(self) -> bytes:
        """The plain bytes of the next frame (none for a skippable one), or ``b""`` and
        done at the end of the stream."""
        import zstandard

        magic = bytearray(4)
        got = readinto_exact(self._base, memoryview(magic))
        if got == 0:
            self._done = True
            return b""
        value = int.from_bytes(magic, "little") if got == 4 else 0
        if value & 0xFFFFFFF0 == _SKIPPABLE:
            size = int.from_bytes(self._exact(4), "little")
            if skip(self._base, size) != size:
                raise ValueError(f"zstd: the stream ends inside a frame; {_DAMAGED}")
            return b""
        if value != _MAGIC:
            raise ValueError(f"zstd: unknown frame magic {bytes(magic[:got]).hex()}; {_DAMAGED}")
        frame = magic + self._exact(1)
        descriptor = frame[4]
        single = descriptor >> 5 & 1
        frame += self._exact(
            1 - single + _DICT_SIZE[descriptor & 3] + (_FCS_SIZE[descriptor >> 6] or single)
        )
        declared = declared_window(frame) or 0
        if declared > self._window:
            frame[5] = (self._window.bit_length() - 11) << 3
        while True:  # the blocks: a 3-byte header, then the block
            head = self._exact(3)
            frame += head
            block = int.from_bytes(head, "little")
            frame += self._exact(1 if block >> 1 & 3 == 1 else block >> 3)
            if len(frame) > MAX_FRAME_BYTES:
                raise ValueError(
                    f"zstd: a frame declares a window of {declared} bytes, more than the "
                    f"{self._window} this item can need, in more than {MAX_FRAME_BYTES} stored "
                    f"bytes; {_DAMAGED}"
                )
            if block & 1:  # the frame's last block
                break
        if descriptor & 4:
            frame += self._exact(4)  # the checksum of the plain bytes
        self._done = not self._across
        size = zstandard.frame_content_size(bytes(frame[:18]))
        if size > self._window:  # decoding would size its output by it
            raise ValueError(
                f"zstd: a frame declares {size} plain bytes, more than the {self._window} "
                f"this item can need; {_DAMAGED}"
            )
        try:
            plain = decompressor(self._window).decompress(frame, max_output_size=self._window)
        except zstandard.ZstdError as exc:
            clamped = declared if declared > self._window else 0
            raise ValueError(refused(exc, self._window, clamped)) from None
        return bytes(plain)
