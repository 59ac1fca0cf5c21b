"""One byte plane of a :class:`~extensions.weights.WeightCodec` block in the cheapest mode.

:func:`_encode_plane` turns a plane (one byte of every element of a block, split by
``extensions/_planes.py``) into its head ``(mode, a, b, length, extra)``
(``extensions/_layout.py``) and the payload pieces to write after the block's header.
A floating-point plane is stored in the cheapest of six modes, chosen from a histogram
of a sample (planes of up to 16 KiB: by trying them); any other plane is ``CONST``,
``BIT`` or a zstd frame at level 3 (``RAW`` where the frame is no smaller):

``RAW``     the plane as is (mantissa bytes: incompressible);
``CONST``   one byte value (a plane that never changes);
``BIT``     one varying bit, packed eight to a byte (the rest of the byte is constant);
``ZSTD``    a zstd frame of the plane;
``PACK``    ``min(byte - base, A - 1)`` per byte (``A - 1`` is the escape), ``k`` such
            codes to a byte (``k = 2, A = 16`` or ``k = 4, A = 4``), a zstd frame of
            the packed codes, then the escaped bytes themselves, in order;
``SEVEN``   (format 2) a plane whose top bit is constant (``a``: 0 or 0x80), 8 bytes
            in 7: padded to a multiple of 64 bytes and cut in 8 rows, rows 0-6 stored
            with bit ``j`` of row 7's byte as the top bit of row ``j``'s (the 7-bit
            mantissa plane of a second moment: zstd's Huffman gains no more, and this
            decodes in a few word-wide passes).

``PACK`` is what exponents need: they span a few consecutive values, so packing two or
four into a byte lets zstd's Huffman stage code pairs or quads of exponents, which
captures how neighbouring weights share a scale, and halves (or quarters) the symbols
zstd has to code. The pack is the compiled loop of ``extensions/_native.c`` (a numpy
pass that stores the same bytes where it was not built). The zstd frames here have no
magic number or content size (format 2); the decoder (``extensions/_unplanes.py``)
shares this module's PACK escapes, words and per-thread zstd contexts.
"""

from __future__ import annotations

import math
import threading
from types import ModuleType
from typing import Any

import numpy as np

from extensions._layout import (
    BIT,
    CONST,
    PACK,
    RAW,
    SEVEN,
    ZSTD,
    PlaneHead,
    head_size,
    seven_size,
)

#: Escape value (``A - 1``) of a PACK plane by codes per byte.
_ESCAPE = {2: 15, 4: 3}
#: Words by element size; little-endian, like the format (numpy handles either host).
_UINT = {size: np.dtype(f"<u{size}") for size in (2, 4, 8)}
_U16 = _UINT[2]
_SAMPLE_STEP = 61  # prime: no step with the power-of-two shapes of kernels
#: Planes estimated above this many bits per byte are stored raw.
_RAW_BITS = 7.92
#: PACK only where the window holds all but this fraction of the sample.
_MAX_ESCAPED = 0.05
#: Planes of at most this many bytes try every mode and keep the smallest.
_SMALL = 1 << 14


class _Codecs(threading.local):
    """zstd contexts, one set per thread (a context is not thread-safe, and building
    one per block would cost more than coding a small plane)."""

    def __init__(self) -> None:
        import zstandard

        bare = {"format": zstandard.FORMAT_ZSTD1_MAGICLESS, "write_content_size": 0}
        fast = zstandard.ZstdCompressionParameters.from_level(1, min_match=7, hash_log=8, **bare)
        # Float planes: zstd's gain is its Huffman stage; a long minimum match and a
        # tiny hash table keep the match finder from spending time on noise.
        self.fast = zstandard.ZstdCompressor(compression_params=fast)
        general = zstandard.ZstdCompressionParameters.from_level(3, **bare)
        self.general = zstandard.ZstdCompressor(compression_params=general)
        self.content_size = zstandard.frame_content_size
        self.error = zstandard.ZstdError


_codecs = _Codecs()

_native: ModuleType | None
try:  # the compiled loops (extensions/_native.c), built at install where a compiler is
    from extensions import _native
except ImportError:  # numpy passes only, the same bytes
    _native = None
Coded = tuple[PlaneHead, list[Any]]


def _stored(coded: list[Coded]) -> int:
    """The bytes ``coded`` planes take, their format-2 heads included."""
    return _size([head for head, _ in coded], [piece for _, pieces in coded for piece in pieces])


def _size(heads: list[PlaneHead], pieces: list[Any]) -> int:
    return sum(memoryview(piece).nbytes for piece in pieces) + sum(map(head_size, heads))


def _encode_plane(plane: np.ndarray, floating: bool) -> Coded:
    coded = _choose_plane(plane, floating)
    if coded[0][0] in (ZSTD, RAW) and len(plane) and floating:
        top = int(plane[0]) & 0x80
        if (plane.min() >= 0x80) if top else (plane.max() < 0x80):
            seven = _seven_plane(plane, top)
            if _stored([seven]) < _stored([coded]):
                return seven
    return coded


def _seven_plane(plane: np.ndarray, top: int) -> Coded:
    n = len(plane)
    rows = np.zeros(seven_size(n) // 7 * 8, np.uint8)
    np.bitwise_xor(plane, np.uint8(top), out=rows[:n])
    words = rows.view(_UINT[8]).reshape(8, -1)
    shifts = np.arange(7, 0, -1, dtype=np.uint64)[:, None]
    stored = (words[7] << shifts) & np.uint64(0x8080808080808080)
    stored |= words[:7]
    return (SEVEN, top, 0, stored.nbytes, 0), [stored.view(np.uint8).reshape(-1)]


def _choose_plane(plane: np.ndarray, floating: bool) -> Coded:
    n = len(plane)
    counts = np.bincount(plane[::_SAMPLE_STEP], minlength=256) if floating and n else None
    if counts is None or np.count_nonzero(counts) <= 2:  # else neither CONST nor BIT
        ones = int(np.bitwise_or.reduce(plane)) if n else 0
        zeros = int(np.bitwise_and.reduce(plane)) if n else 0
        varying = ones & ~zeros
        if not varying:
            return (CONST, zeros, 0, 0, 0), []
        if varying & (varying - 1) == 0:
            bit = varying.bit_length() - 1
            packed = np.packbits(plane & np.uint8(varying))
            return (BIT, zeros, bit, len(packed), 0), [packed]
    if counts is None:
        return _zstd_plane(plane, _codecs.general)
    if n <= _SMALL:
        return _smallest(plane)
    coded = _coded(plane, _choose(counts))
    if coded is None:  # the sample misled: choose again from every byte
        coded = _coded(plane, _choose(np.bincount(plane, minlength=256)), retry=False)
    assert coded is not None
    return coded


def _smallest(plane: np.ndarray) -> Coded:
    """A small plane in every mode that may pay (its sample would be too small to
    choose by): the smallest."""
    counts = np.bincount(plane, minlength=256)
    cumulative = np.concatenate(([0], np.cumsum(counts)))
    best = _zstd_plane(plane, _codecs.fast)
    for k, escape in _ESCAPE.items():
        base = int(np.argmax(cumulative[escape:] - cumulative[:-escape]))
        packed = _pack_plane(plane, base, k, limit=len(plane))
        if packed is not None and _stored([packed]) < _stored([best]):
            best = packed
    return best


def _coded(plane: np.ndarray, choice: tuple[int, int] | None, retry: bool = True) -> Coded | None:
    """``plane`` coded as ``choice`` says; ``None`` when a PACK escapes more bytes than
    the sample promised (a structure in step with the sampling) and ``retry`` is set."""
    if choice is None:
        return (RAW, 0, 0, len(plane), 0), [plane]
    if choice == (0, 0):
        return _zstd_plane(plane, _codecs.fast)
    return _pack_plane(plane, *choice, limit=len(plane) * _MAX_ESCAPED if retry else len(plane))


def _zstd_plane(plane: np.ndarray, compressor: Any) -> Coded:
    frame = compressor.compress(plane.data)
    if len(frame) >= len(plane):
        return (RAW, 0, 0, len(plane), 0), [plane]
    return (ZSTD, 0, 0, len(frame), 0), [frame]


def _bits(counts: np.ndarray, total: int, missed: int = 0) -> float:
    """Order-0 entropy, in bits per byte, of a sample of ``total`` bytes whose values
    were seen ``counts`` times, plus ``missed`` bytes merged into one more value."""
    seen = counts[counts > 0]
    clogc = float(seen @ np.log2(seen)) + (missed * math.log2(missed) if missed else 0.0)
    return math.log2(total) - clogc / total


def _choose(counts: np.ndarray) -> tuple[int, int] | None:
    """From a sample's histogram: ``(base, k)`` for PACK, ``(0, 0)`` for ZSTD, ``None``
    for RAW, by the estimated bits per byte: order-0 entropy, plus the Miller-Madow
    correction (a sample of a noisy plane misses values, which would make it look
    compressible). PACK packs the window of values that holds most of the sample, and
    wins near-ties: it codes fewer symbols, and pairs capture what neighbours share."""
    total = int(counts.sum())
    entropy = _bits(counts, total) + (np.count_nonzero(counts) - 1) / (2 * math.log(2) * total)
    if entropy >= _RAW_BITS:
        return None
    best: tuple[float, tuple[int, int] | None] = (entropy, (0, 0))
    cumulative = np.concatenate(([0], np.cumsum(counts)))
    for k, escape in _ESCAPE.items():
        base = int(np.argmax(cumulative[escape:] - cumulative[:-escape]))
        missed = total - int(cumulative[base + escape] - cumulative[base])
        if missed > total * _MAX_ESCAPED:
            continue
        # Escaped bytes cost their escape code and themselves, raw.
        bits = _bits(counts[base : base + escape], total, missed) + 8 * missed / total
        if bits <= best[0] + 0.05:
            best = (bits, (base, k))
    return best[1]


def _pack_plane(plane: np.ndarray, base: int, k: int, limit: float) -> Coded | None:
    """``plane`` packed ``k`` to a byte from ``base``; ``None`` past ``limit`` escapes;
    RAW where packing does not pay."""
    n = len(plane)
    if _native is not None:
        codes = np.empty(-(-n // k), np.uint8)
        room = np.empty(min(n, int(limit)), np.uint8)
        nesc = _native.pack(codes, plane, k, base, room)
        if nesc > limit:
            return None
        return _packed(codes, room[:nesc] if nesc else None, base, k, plane)
    escape = _ESCAPE[k]
    offsets = np.zeros(-(-n // k) * k, np.uint8)
    np.subtract(plane, np.uint8(base), out=offsets[:n])
    where = np.flatnonzero(offsets > escape - 1)
    nesc = len(where)
    if nesc > limit:
        return None
    escapes = plane[where] if nesc else None
    offsets[where] = escape
    if k == 2:
        pairs = offsets.view(_U16)
        codes = np.empty(len(pairs), np.uint8)
        np.bitwise_or(pairs, pairs >> 4, out=codes, casting="unsafe")
    else:
        quads = offsets.view(_UINT[4])
        halves = (quads | (quads >> 6)) & np.uint32(0x000F000F)
        codes = np.empty(len(quads), np.uint8)
        np.bitwise_or(halves, halves >> 12, out=codes, casting="unsafe")
    return _packed(codes, escapes, base, k, plane)


def _packed(
    codes: np.ndarray, escapes: np.ndarray | None, base: int, k: int, plane: np.ndarray
) -> Coded:
    """A PACK plane from its codes and escaped bytes; RAW where packing does not pay."""
    n = len(plane)
    nesc = 0 if escapes is None else len(escapes)
    frame = _codecs.fast.compress(codes.data)
    if len(frame) + nesc >= n:
        return (RAW, 0, 0, n, 0), [plane]
    return (PACK, base, k, len(frame), nesc), [frame] if escapes is None else [frame, escapes]
