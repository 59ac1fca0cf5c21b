"""WeightCodec: lossless compression made for tensors of weights and optimizer state.

One transform in place of ``[ByteShuffle(), ZStandard()]``: it splits each block of
elements into byte planes, moves the sign of floats out of the exponent byte, and
stores each plane in the cheapest of a few modes (raw, constant, one packed bit, zstd,
exponents packed two or four to a byte before zstd, or seven-bit bytes stored eight in
seven; the two raw low planes of fp32/fp64 travel as one 16-bit piece); see
``extensions/_planes.py`` and ``extensions/_plane_modes.py`` for encoding,
``extensions/_unplanes.py`` for decoding and
``extensions/_layout.py`` for the headers. The descriptor records
the stream format and the element size (``dcp_storage.weights/2;es=2``); everything else
a reader needs is in the stream.

A stream: blocks of at most :data:`~extensions._planes.BLOCK_BYTES` decoded bytes, then
an end record with the total decoded bytes, and nothing after it. Format 3 (format 2
and, for bfloat16, the JOINT blocks of ``extensions/_joint.py``: written for bfloat16
items with ``compact=True``), format 2 (written for every other item) and format 1
(fixed-size headers) are all read.
"""

from __future__ import annotations

import functools
import io
import threading
from dataclasses import dataclass, field
from typing import IO, Any, cast

from extensions._layout import (
    BLOCK_TAG,
    END_TAG,
    V1_END,
    V1_HEAD,
    V1_PLANE,
    V2_PREFIX,
    CorruptBlock,
    PlaneHead,
    pack_v2_block,
    pack_v2_end,
    parse_v2_block,
    parse_v2_end,
    payload_size,
    v1_heads,
)
from extensions._planes import BLOCK_BYTES, SignSplits, encode_block
from extensions._unplanes import decode_block
from extensions.base import (
    ItemInfo,
    StreamTransformExtension,
    descriptor_number,
    descriptor_settings,
)
from extensions.errors import quote
from extensions.streams import BlockWriter, fill, read_all, readinto_exact

MAX_ELEMENT_SIZE = 16
#: The newest stream format; readers know every one up to it. Format 3 (format 2 and the
#: JOINT blocks of ``extensions/_joint.py``) is written for bfloat16 items with
#: ``compact=True`` only; everything else is written in format 2.
FORMAT = 3
_JOINT_DTYPE = "bfloat16"
#: Dtypes whose planes get the float treatment (sign moved, packing by sampled histogram).
FLOAT_DTYPES = frozenset(
    {"float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"}
)


@dataclass(frozen=True, repr=False)
class WeightCodec(StreamTransformExtension):
    """Compression for tensors (descriptor ``dcp_storage.weights/2;es=N``).

    Use it alone, or before encryption: ``transforms=[WeightCodec()]`` or
    ``[WeightCodec(), AES256GCM(...)]``. Floating-point tensors get the byte-plane
    codec; integer tensors get byte planes with zstd level 3 per plane; opaque items
    (pickled values) get zstd level 3. It is built in: readers need no registration.

    ``compact=True`` stores bfloat16 tensors whose values are bell-shaped (weights,
    first moments) 0.5-0.9% smaller, in format 3 (``dcp_storage.weights/3``: the top
    two mantissa bits coded with the exponent), at a cost in speed: decoding one such
    tensor takes ~1.3x as long (about ZipNN's speed), encoding ~1.15x
    (docs/benchmarks.md); other dtypes are stored as without it. Readers decode either
    way with no setting.

    ``element_size`` is what a descriptor records, for decoding; leave it ``None`` when
    saving, and each item uses its own tensor's element size. ``dtype`` (the item's,
    which tells floats from integers) is filled in by ``for_item``; ``stream_format``
    is the format a descriptor names (a saved item of format 1 keeps decoding).
    """

    element_size: int | None = field(default=None, kw_only=True)
    dtype: str | None = field(default=None, kw_only=True)
    stream_format: int = field(default=FORMAT, kw_only=True)
    compact: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        size = self.element_size
        if size is not None and (
            not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_ELEMENT_SIZE
        ):
            raise ValueError(
                f"element_size must be an int between 1 and {MAX_ELEMENT_SIZE}, got {size!r}"
            )

    def __repr__(self) -> str:
        compact = ", compact=True" if self.compact else ""
        return f"WeightCodec(element_size={self.element_size}{compact})"

    @staticmethod
    def registry_name() -> str:
        return "dcp_storage.weights"

    @staticmethod
    def from_descriptor(version: str) -> WeightCodec:
        return _from_descriptor(version)

    @classmethod
    def max_expansion(cls, version: str) -> int | None:
        # A block decodes to at most BLOCK_BYTES; its shortest record (tag and size, a
        # 3-byte varint of its bytes, flags, one CONST plane's mode and byte) is 8 bytes.
        return BLOCK_BYTES // 8

    def get_descriptor(self) -> str:
        version = FORMAT if self._joint() else 2
        return f"{self.registry_name()}/{version};es={self.element_size or 1}"

    def for_item(self, item: ItemInfo) -> WeightCodec:
        es = self.element_size
        if es is None:
            size = item.element_size
            es = size if isinstance(size, int) and 1 <= size <= MAX_ELEMENT_SIZE else 1
        if es == self.element_size and item.dtype == self.dtype:
            return self
        return WeightCodec(
            element_size=es,
            dtype=item.dtype,
            stream_format=self.stream_format,
            compact=self.compact,
        )

    def _joint(self) -> bool:
        """Whether this item's blocks may be JOINT blocks (format 3)."""
        return self.compact and self.dtype == _JOINT_DTYPE and self.element_size == 2

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        floating = self.dtype in FLOAT_DTYPES
        return cast(IO[bytes], _Writer(output, self.element_size or 1, floating, self._joint()))

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return cast(IO[bytes], _Reader(input, self.element_size or 1, self.stream_format))


@functools.lru_cache(maxsize=64)
def _from_descriptor(version: str) -> WeightCodec:
    """``WeightCodec.from_descriptor``, once per descriptor (a load meets a few, item after
    item: parsing one cost a small tensor's decode a sixth of its time; the codec is
    immutable, and a descriptor refused is parsed, and refused, every time)."""
    name = WeightCodec.registry_name()
    known = tuple(str(v) for v in range(1, FORMAT + 1))
    value = descriptor_settings(name, version, {"es"}, known).get("es")
    if value is None:
        raise ValueError(
            f"expected ';es=<element size 1-{MAX_ELEMENT_SIZE}>' in the descriptor, "
            f"got {quote(version)}"
        )
    stream_format = descriptor_number(name, "version", version.split(";")[0], 1, FORMAT)
    # A format-3 decoder describes itself as its writer did (``get_descriptor``).
    return WeightCodec(
        element_size=descriptor_number(name, "es", value, 1, MAX_ELEMENT_SIZE),
        stream_format=stream_format,
        compact=stream_format >= 3,
    )


class _Writer(BlockWriter):
    def __init__(self, out: IO[bytes], es: int, floating: bool, joint: bool) -> None:
        super().__init__(out, BLOCK_BYTES // es * es)
        self._es = es
        self._floating = floating
        self._joint = joint
        self._splits = SignSplits()  # this item's
        self._total = 0

    def emit(self, block: memoryview) -> None:
        flags, heads, payloads = encode_block(
            block, self._es, self._floating, self._splits, self._joint
        )
        self._out.write(pack_v2_block(len(block), flags, heads))
        for piece in payloads:
            self._out.write(piece)
        self._total += len(block)

    def finish(self, rest: memoryview) -> None:
        super().finish(rest)
        self._out.write(pack_v2_end(self._total))


class _Payloads(threading.local):
    """Stored-block buffers a thread reuses from item to item (each grows only with the
    bytes a stream delivers, see ``streams.fill``): a reader taking a fresh one grew it
    from 64 KiB to a block every item. Taken and given back around each block, so a
    reader nested in another's source gets a buffer of its own."""

    def __init__(self) -> None:
        self.free: list[bytearray] = []


_payloads = _Payloads()


class _Reader(io.RawIOBase):
    def __init__(self, source: IO[bytes], es: int, version: int) -> None:
        super().__init__()
        self._src = source
        self._es = es
        self._version = version
        self._limit = BLOCK_BYTES // es * es
        self._head = bytearray(V1_HEAD.size + V1_PLANE.size * es if version == 1 else 255)
        # Grows with the bytes actually decoded (a read shorter than a block).
        self._plain = bytearray()
        self._pos = 0
        self._end = 0
        self._total = 0
        self._done = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if self._pos == self._end:
            if not len(view) or self._done:
                return 0
            size = self._next_block(view)
            if size <= len(view) or not size:
                return size
        n = min(len(view), self._end - self._pos)
        view[:n] = memoryview(self._plain)[self._pos : self._pos + n]
        self._pos += n
        return n

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            return read_all(self)
        buffer = bytearray(min(size, self._limit))
        n = self.readinto(buffer)
        return bytes(memoryview(buffer)[:n])

    def readall(self) -> bytes:
        return read_all(self)

    def _next_block(self, view: memoryview) -> int:
        """Decode the next block: into ``view`` when it fits (returns its size), else
        into the internal buffer (returns its size, larger than ``view``); 0 at the end."""
        header = self._header_v1() if self._version == 1 else self._header_v2()
        if header is None:
            return 0
        nbytes, flags, heads = header
        size = payload_size(heads) + nbytes % self._es
        if size > 2 * nbytes + 1024:
            raise CorruptBlock(f"a block of {nbytes} bytes claims {size} stored bytes")
        stored = _payloads.free.pop() if _payloads.free else bytearray()
        if fill(self._src, stored, size) != size:
            raise CorruptBlock("the stream ends inside a block (truncated)")
        if nbytes <= len(view):
            out = view[:nbytes]
        else:
            if len(self._plain) < nbytes:
                self._plain = bytearray(nbytes)
            out = memoryview(self._plain)[:nbytes]
            self._pos, self._end = 0, nbytes
        decode_block(heads, flags, memoryview(stored)[:size], out, self._es, self._version)
        # Not after an error: its traceback may still hold views of the buffer.
        if len(_payloads.free) < 2:
            _payloads.free.append(stored)
        self._total += nbytes
        return nbytes

    def _header_v1(self) -> tuple[int, int, list[PlaneHead]] | None:
        head = memoryview(self._head)
        # One read for the header; the end record (shorter) ends the stream.
        got = readinto_exact(self._src, head)
        if got and head[0] == END_TAG:
            if got != V1_END.size:
                what = "is truncated in" if got < V1_END.size else "has bytes after"
                raise CorruptBlock(f"the stream {what} its end record")
            self._finish(V1_END.unpack_from(head)[1])
            return None
        if got != len(head) or head[0] != BLOCK_TAG:
            what = "is truncated" if got < len(head) else f"has an unknown record tag {head[0]}"
            raise CorruptBlock(f"the stream {what}")
        _, nbytes, flags = V1_HEAD.unpack_from(head)
        if not 0 < nbytes <= self._limit:
            raise CorruptBlock(f"a block of {nbytes} bytes (at most {self._limit})")
        return nbytes, flags, v1_heads(head[V1_HEAD.size :], self._es)

    def _header_v2(self) -> tuple[int, int, list[PlaneHead]] | None:
        prefix = memoryview(self._head)[: V2_PREFIX.size]
        if readinto_exact(self._src, prefix) != V2_PREFIX.size:
            raise CorruptBlock("the stream is truncated")
        tag, length = V2_PREFIX.unpack_from(prefix)
        if tag not in (BLOCK_TAG, END_TAG):
            raise CorruptBlock(f"the stream has an unknown record tag {tag}")
        body = memoryview(self._head)[:length]
        if readinto_exact(self._src, body) != length:
            raise CorruptBlock("the stream is truncated")
        if tag == END_TAG:
            total = parse_v2_end(body)
            if readinto_exact(self._src, prefix[:1]):
                raise CorruptBlock("the stream has bytes after its end record")
            self._finish(total)
            return None
        return parse_v2_block(body, self._es, self._limit)

    def _finish(self, total: int) -> None:
        if total != self._total:
            raise CorruptBlock(
                f"the end record counts {total} bytes, the blocks hold {self._total}"
            )
        self._done = True
