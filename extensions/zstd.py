"""Zstandard compression with torch's descriptor, so stock DCP reads it and vice versa.

Large items are cut into frames of at most :data:`FRAME` input bytes, with a seek table
(zstd's seekable format: a skippable frame at the end listing each frame's compressed
and decompressed size), so a reader can decode one item's frames on several cores.
Every zstd decoder reads such a stream as the concatenation of its frames and skips the
table: stock torch's reader, the ``zstd`` tool and readers of older dcp-storage alike.
"""

from __future__ import annotations

import array
import io
import itertools
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import IO, Any, cast, overload

from extensions._zstd_window import WINDOW_FLOOR, open_reader, window_for
from extensions.base import (
    Frame,
    FrameDecoder,
    ItemInfo,
    ReadAt,
    StreamTransformExtension,
)
from extensions.errors import MissingDependencyError, quote


def _zstandard():  # type: ignore[no-untyped-def]
    try:
        import zstandard
    except ImportError as exc:  # pragma: no cover - zstandard is a core dependency
        raise MissingDependencyError(
            "zstd compression needs the 'zstandard' package: pip install zstandard"
        ) from exc
    return zstandard


# Floating-point weights are mostly noise in the mantissa: zstd's gain on them comes from
# entropy-coding the literals (sign/exponent bits), not from matches. Measured on bf16
# and fp32 weights here, level 1 gives the same ratio as level 3 at ~1.6x the speed, and
# a long minimum match with a tiny hash table keeps the match finder from spending time
# on byte-shuffled exponent planes (ratio 1.49 vs 1.40, ~2x faster than level 3).
_FLOAT_DTYPES = frozenset(
    {"float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"}
)
_DEFAULT_LEVEL = 3

#: Input bytes per frame: a frame decodes in ~2-3 ms on one core.
FRAME = 4 << 20
#: The levels ``ZStandard`` accepts: zstd's fastest through its highest (ultra) level.
MIN_LEVEL, MAX_LEVEL = -(1 << 17), 22
#: log2 of the largest window a frame we write declares: a frame holds at most FRAME
#: input bytes, so the larger windows of levels 10 and up (up to 128 MiB at level 22)
#: would find no match a FRAME-sized one misses, and would only make readers allow them.
WINDOW_LOG = FRAME.bit_length() - 1
#: The most plain bytes a stored byte decodes to: a block holds at most 128 KiB, and the
#: shortest (an RLE block: a 3-byte header and the byte repeated) is 4 bytes.
MAX_EXPANSION = (128 << 10) // 4
_SKIPPABLE = 0x184D2A5E  # the seek table's skippable frame magic (zstd seekable format)
_SEEKABLE = 0x8F92EAB1  # the seek table footer's magic
FOOTER = 9  # footer bytes: frame count, descriptor, magic
#: Stored bytes per frame, table entry included, that every seek table our writer makes
#: averages at least: its densest one alternates a full frame of zeros (~146 bytes) and
#: a 1-byte frame (10), 86 a frame. A table listing more frames is not read.
_FRAME_SHARE = 64
#: Plain bytes per frame that every seek table our writer makes averages at least: each
#: write of FRAME bytes or more ends the frame before it and its own last piece, so a
#: tensor's item is at worst [header, FRAME, 1 byte, trailer], just over FRAME / 4. A
#: table of smaller frames (or of one over FRAME) is not ours: the item decodes as one
#: stream, which is faster than thousands of tiny frames each set up on its own.
_FRAME_PLAIN = FRAME // 8


@dataclass(frozen=True, repr=False)
class ZStandard(StreamTransformExtension):
    """Zstandard compression (descriptor ``stream.zstd/1``, torch's).

    ``level=None`` (the default) picks per item: floating-point tensors get fast
    literal-oriented settings (level 1, min match 7, 256-entry hash table), which
    compress weights as well as level 3 at a fraction of the time; everything else
    gets level 3. An explicit ``level`` (1-22, negative for fast modes) applies to every
    item. ``threads`` > 0 compresses each item with that many zstd worker threads; the
    default 0 keeps one thread per item because the writer already compresses items in
    parallel. Settings only affect encoding: the output is standard zstd frames, one per
    :data:`FRAME` bytes (a write of at least that much, such as a tensor's storage,
    starts and ends frames of its own) and, when there are several, a seek table in a
    skippable frame; stock torch and the ``zstd`` tool read it. Every frame declares a
    window of at most :data:`WINDOW_LOG` (a frame's input), at any level; a frame of a
    tensor's storage declares its size instead (at most :data:`FRAME`), so a reader
    decodes it in one pass into the target. ``dtype`` (the
    item's, which picks the settings when ``level`` is ``None``) and ``plain_bytes``
    (the reader's bound on the item's plain size, which bounds the window a frame may
    ask a decoder for: :func:`window_for`) are filled in by ``for_item``.
    """

    level: int | None = None
    threads: int = field(default=0, kw_only=True)
    dtype: str | None = field(default=None, kw_only=True)
    plain_bytes: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        level, threads = self.level, self.threads
        if level is not None and (not isinstance(level, int) or isinstance(level, bool)):
            raise TypeError(f"ZStandard level must be an int or None, got {level!r}")
        if level is not None and not MIN_LEVEL <= level <= MAX_LEVEL:
            raise ValueError(
                f"ZStandard level must be {MIN_LEVEL} to {MAX_LEVEL} (zstd's levels), got {level}"
            )
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
            raise TypeError(f"ZStandard threads must be an int >= 0, got {threads!r}")

    def __repr__(self) -> str:
        return f"ZStandard(level={self.level}, threads={self.threads})"

    @staticmethod
    def registry_name() -> str:
        return "stream.zstd"

    @staticmethod
    def from_descriptor(version: str) -> ZStandard:
        if version.partition(".")[0] != "1":
            raise ValueError(
                f"unsupported stream.zstd version {quote(version)} (this reader knows 1)"
            )
        return ZStandard()

    def get_descriptor(self) -> str:
        return "stream.zstd/1"

    def for_item(self, item: ItemInfo) -> ZStandard:
        dtype = self.dtype if self.level is not None else item.dtype
        if (dtype, item.plain_bytes) == (self.dtype, self.plain_bytes):
            return self
        return replace(self, dtype=dtype, plain_bytes=item.plain_bytes)

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        zstd = _zstandard()
        if self.level is None and self.dtype in _FLOAT_DTYPES:
            params = zstd.ZstdCompressionParameters.from_level(
                1, min_match=7, hash_log=8, threads=self.threads
            )
            compressor = zstd.ZstdCompressor(compression_params=params)
        else:
            level = _DEFAULT_LEVEL if self.level is None else self.level
            params = zstd.ZstdCompressionParameters.from_level(level, threads=self.threads)
            if params.window_log > WINDOW_LOG:
                params = zstd.ZstdCompressionParameters.from_level(
                    level, window_log=WINDOW_LOG, threads=self.threads
                )
            compressor = zstd.ZstdCompressor(compression_params=params)
        return cast(IO[bytes], _FramedWriter(compressor, output))

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        _zstandard()  # says which package is missing
        window = window_for(self.plain_bytes)
        return open_reader(input, window, across_frames=True, shared=False)

    @classmethod
    def max_expansion(cls, version: str) -> int | None:
        return MAX_EXPANSION if version.partition(".")[0] == "1" else None

    # Splittable: every zstd frame decodes on its own, and the seek table lists them.

    @classmethod
    def frame_decoder(cls, version: str) -> FrameDecoder | None:
        return _decode_frame if version.partition(".")[0] == "1" else None

    @classmethod
    def frames(cls, version: str, read_at: ReadAt, length: int) -> Sequence[Frame] | None:
        if version.partition(".")[0] != "1" or length < 8 + 8 + FOOTER:
            return None
        size = table_size(read_at(length - FOOTER, FOOTER))
        # A table listing more frames than the item could hold is not read: each frame
        # listed costs a few hundred bytes of objects, 1-byte frames would cost ~25x
        # the item. Such an item decodes as one stream.
        if size is None or size >= length or (size - 8 - FOOTER) // 8 * _FRAME_SHARE > length:
            return None
        listed = _entries(read_at(length - size, size), length)
        if listed is None:
            return None
        compressed, decompressed = listed
        if max(decompressed) > FRAME or (
            len(decompressed) > 1 and sum(decompressed) < len(decompressed) * _FRAME_PLAIN
        ):
            return None
        return SeekFrames(compressed, decompressed)


class _FramedWriter(io.RawIOBase):
    """Compresses into ``output`` one frame per :data:`FRAME` input bytes; closing it
    ends the last frame and, after several, writes the seek table."""

    def __init__(self, compressor: Any, output: IO[bytes]) -> None:
        super().__init__()
        self._out = output
        self._compressor = compressor
        self._zstd = compressor.stream_writer(output, closefd=False)
        self._flush_frame = _zstandard().FLUSH_FRAME
        self._in_frame = 0  # input bytes in the open frame
        self._ended = 0  # compressed bytes the stream writer has written, frames ended
        self.frames: list[tuple[int, int]] = []  # (compressed, decompressed) per frame

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= FRAME:  # a tensor's storage: frames of its own, from its start
            if self._in_frame:
                self._end_frame()
            # Each compressed whole, so its header declares its size: a reader then
            # decodes it in one pass straight into the target's slice, where a frame of
            # unknown size goes through the decoder's window buffer and a copy (~6% of
            # the decode time of a bf16 frame).
            for start in range(0, len(view), FRAME):
                piece = view[start : start + FRAME]
                frame = self._compressor.compress(piece)
                self._out.write(frame)
                self.frames.append((len(frame), len(piece)))
            return len(view)
        while view:
            piece = view[: FRAME - self._in_frame]
            self._zstd.write(piece)
            self._in_frame += len(piece)
            view = view[len(piece) :]
            if self._in_frame == FRAME:
                self._end_frame()
        return len(data) if isinstance(data, bytes) else memoryview(data).nbytes

    def _end_frame(self) -> None:
        self._zstd.flush(self._flush_frame)
        written = self._zstd.tell()
        self.frames.append((written - self._ended, self._in_frame))
        self._ended, self._in_frame = written, 0

    def close(self) -> None:
        if self.closed:
            return
        if self._in_frame or not self.frames:
            self._end_frame()  # (an empty item is one empty frame)
        if len(self.frames) > 1:
            self._out.write(seek_table(self.frames))
        self._out.close()  # the framework's stream: this only flushes the data file
        super().close()


def seek_table(frames: list[tuple[int, int]]) -> bytes:
    """The seek table of ``frames`` ((compressed, decompressed) sizes), as a skippable
    frame: entries, then the footer (frame count, descriptor 0: no checksums, magic)."""
    body = b"".join(struct.pack("<II", c, d) for c, d in frames)
    body += struct.pack("<IBI", len(frames), 0, _SEEKABLE)
    return struct.pack("<II", _SKIPPABLE, len(body)) + body


def table_size(footer: bytes) -> int | None:
    """The size of the seek table that ``footer`` (an item's last :data:`FOOTER`
    bytes) ends, ``None`` when they are no seek table footer."""
    if len(footer) != FOOTER:
        return None
    count, descriptor, magic = struct.unpack("<IBI", footer)
    if magic != _SEEKABLE or descriptor != 0 or count < 1:
        return None
    return 8 + 8 * count + FOOTER


def parse_seek_table(table: bytes, stored: int) -> list[tuple[int, int]] | None:
    """The frames that ``table`` (the last bytes of an item of ``stored`` bytes) lists,
    ``None`` unless it is a well-formed seek table whose frames tile the rest of the
    item exactly. The sizes are claims: a decoder checks each frame against them."""
    listed = _entries(table, stored)
    return None if listed is None else list(zip(*listed))


def _entries(table: bytes, stored: int) -> tuple[array.array[int], array.array[int]] | None:
    """:func:`parse_seek_table`'s frames as two arrays (compressed, decompressed sizes):
    4 bytes a number, where a tuple of two ints costs ~120 (a table may list a frame
    for every 64 stored bytes)."""
    if len(table) < 8 + FOOTER or struct.unpack_from("<II", table) != (_SKIPPABLE, len(table) - 8):
        return None
    if (len(table) - 8 - FOOTER) % 8:  # not whole entries (a short read): no table
        return None
    words = array.array("I")
    assert words.itemsize == 4, "seek table entries are 32-bit"
    words.frombytes(table[8 : len(table) - FOOTER])
    if sys.byteorder == "big":
        words.byteswap()
    compressed, decompressed = words[0::2], words[1::2]
    if not compressed or min(compressed) == 0 or sum(compressed) + len(table) != stored:
        return None
    return compressed, decompressed


class SeekFrames(Sequence[Frame]):
    """The frames of a seek table, each made as it is asked for: the sizes are kept in
    arrays, so a table listing a million frames costs ~24 MB, not the ~200 MB of as many
    :class:`Frame` objects (which a reader refusing the table would pay first)."""

    def __init__(self, compressed: array.array[int], decompressed: array.array[int]) -> None:
        self._sizes = (compressed, decompressed)
        self._starts = (
            array.array("Q", itertools.accumulate(compressed, initial=0)),
            array.array("Q", itertools.accumulate(decompressed, initial=0)),
        )

    def __len__(self) -> int:
        return len(self._sizes[0])

    @overload
    def __getitem__(self, index: int) -> Frame: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Frame]: ...

    def __getitem__(self, index: int | slice) -> Frame | Sequence[Frame]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("seek table frame index out of range")
        (compressed, decompressed), (stored, plain) = self._sizes, self._starts
        return Frame(stored[index], compressed[index], plain[index], decompressed[index])


def frame_reader(source: Any, *, across_frames: bool) -> IO[bytes]:
    """A reader of the zstd stream in ``source`` (a buffer, decoded in place), stopping
    at the end of the first frame unless ``across_frames``; one decompression context
    per thread, reused, allowing a frame :data:`WINDOW_FLOOR` (every frame a seek table
    of ours lists holds at most :data:`FRAME` plain bytes, and so does every frame of an
    item without one but ours or torch's, which declares 2 MiB)."""
    return open_reader(source, WINDOW_FLOOR, across_frames=across_frames, shared=True)


def _decode_frame(source: memoryview, whole: bool) -> IO[bytes]:
    return frame_reader(source, across_frames=whole)
