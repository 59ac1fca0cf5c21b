"""One block of :class:`~extensions.weights.WeightCodec`: byte planes, each coded on its own.

A block holds up to :data:`BLOCK_BYTES` of an item as ``n`` elements of ``es`` bytes
(plus, in an item's last block only, a tail of fewer than ``es`` bytes, stored raw).
Byte ``j`` of every element goes to plane ``j``. For floating-point items whose sign
varies in the block, the sign first moves from the top bit to the top of the second
byte and the bits in between move up by one, so the top plane holds the exponent alone
(bfloat16, float32; float64's top 8 of 11) - the part of a float that compresses - and
the sign joins the noisy mantissa bits (ZipNN's insight). Where the sign does not vary
(a second moment) the encoder tries both splits: the exponent's low bit may code better
beside the mantissa bits it correlates with. Each plane is stored in the cheapest of
five modes, chosen from a histogram of a sample (planes of up to 16 KiB: by trying them):

``RAW``     the plane as is (mantissa bytes: incompressible);
``CONST``   one byte value (a plane that never changes);
``BIT``     one varying bit, packed eight to a byte (the rest of the byte is constant);
``ZSTD``    a zstd frame of the plane;
``PACK``    ``min(byte - base, A - 1)`` per byte (``A - 1`` is the escape), ``k`` such
            codes to a byte (``k = 2, A = 16`` or ``k = 4, A = 4``), a zstd frame of
            the packed codes, then the escaped bytes themselves, in order.

``PACK`` is what exponents need: they span a few consecutive values, so packing two or
four into a byte lets zstd's Huffman stage code pairs or quads of exponents, which
captures how neighbouring weights share a scale, and halves (or quarters) the symbols
zstd has to code. All of it is whole-array numpy work on cache-sized blocks (zstd and
numpy release the GIL). Headers: ``extensions/_layout.py``. Format 2 writes zstd frames
without magic number or content size; a frame that declares a size is refused unread.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from extensions._layout import BIT, CONST, PACK, RAW, ZSTD, CorruptBlock, PlaneHead

#: Decoded bytes per block; part of formats 1 and 2.
BLOCK_BYTES = 1 << 19
SIGN_MOVED = 1
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
_MAGIC = (0xFD2FB528).to_bytes(4, "little")  # what format 2 leaves off its zstd frames


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
        self.v1 = zstandard.ZstdDecompressor()
        # A window no larger than a block: a frame cannot make zstd allocate more.
        self.v2 = zstandard.ZstdDecompressor(
            format=zstandard.FORMAT_ZSTD1_MAGICLESS, max_window_size=2 * BLOCK_BYTES
        )
        self.content_size = zstandard.frame_content_size
        self.error = zstandard.ZstdError


_codecs = _Codecs()
Coded = tuple[PlaneHead, list[Any]]


# --- encoding -------------------------------------------------------------------------


def encode_block(
    data: memoryview, es: int, floating: bool
) -> tuple[int, list[PlaneHead], list[Any]]:
    """The stored form of ``data`` (at most :data:`BLOCK_BYTES`): block flags, plane
    heads, and the payload pieces to write after the header."""
    n = len(data) // es
    whole = n * es
    moved = varies = False
    if es == 1:
        planes = [np.frombuffer(data, np.uint8, count=n)]
    elif es in _UINT:
        words = np.frombuffer(data, _UINT[es], count=n)
        if floating and n:
            sign = words.dtype.type(1 << (8 * es - 1))
            moved = varies = bool(words.max() >= sign) and bool(words.min() < sign)
        planes = _split(words, es, moved)
    else:  # an element size without a numpy word: plain strided planes
        elements = np.frombuffer(data, np.uint8, count=whole).reshape(n, es)
        planes = [np.ascontiguousarray(elements[:, j]) for j in range(es)]
    coded = [_encode_plane(plane, floating) for plane in planes]
    if floating and n and es in _UINT and not varies:  # a constant sign: try both splits
        alternative = [_encode_plane(plane, True) for plane in _split(words, es, True)[-2:]]
        if _stored(alternative) < _stored(coded[-2:]):
            coded[-2:] = alternative
            moved = True
    payloads = [piece for _, pieces in coded for piece in pieces]
    if whole < len(data):
        payloads.append(data[whole:])
    return SIGN_MOVED if moved else 0, [head for head, _ in coded], payloads


def _stored(coded: list[Coded]) -> int:
    return sum(memoryview(piece).nbytes for _, pieces in coded for piece in pieces)


def _split(words: np.ndarray, es: int, moved: bool) -> list[np.ndarray]:
    """Byte ``j`` of each word; with ``moved``, the sign bit moves from the top of the
    word to the top of the second byte from the top, and the bits between move up one."""
    # Whole-word shifts only: x86 has no 8-bit vector shifts, numpy's uint8 ones crawl.
    planes = [(words >> (8 * j) if j else words).astype(np.uint8) for j in range(es - 2)]
    bits = 8 * es
    pair = words >> (bits - 16) if bits > 16 else words  # the top two bytes, low in a word
    if not moved:
        return planes + [pair.astype(np.uint8), (words >> (bits - 8)).astype(np.uint8)]
    second = pair & words.dtype.type(0x807F)
    second |= second >> 8  # the sign lands on bit 7, above the 7 bits that follow it
    top = (words >> (bits - 9)).astype(np.uint8)  # the exponent (its top 8 bits)
    return planes + [second.astype(np.uint8), top]


def _encode_plane(plane: np.ndarray, floating: bool) -> Coded:
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
    if coded[0][0] == PACK:  # a near tie by the estimate: the one that codes smaller
        single = _zstd_plane(plane, _codecs.fast)
        return single if _stored([single]) < _stored([coded]) else coded
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
    frame = _codecs.fast.compress(codes.data)
    if len(frame) + nesc >= n:
        return (RAW, 0, 0, n, 0), [plane]
    return (PACK, base, k, len(frame), nesc), [frame] if escapes is None else [frame, escapes]


# --- decoding -------------------------------------------------------------------------


def decode_block(
    heads: list[PlaneHead], flags: int, payload: memoryview, out: memoryview, es: int, version: int
) -> None:
    """Decode one block of format ``version`` into ``out`` (its ``nbytes``); raises
    :class:`CorruptBlock`."""
    n = len(out) // es
    whole = n * es
    planes: list[Any] = []
    at = 0
    for mode, a, b, length, extra in heads:
        piece = payload[at : at + length]
        at += length
        if mode == PACK:
            planes.append(_unpack(piece, payload[at : at + extra], n, a, b, version))
            at += extra
        else:
            planes.append(_plane(mode, a, b, piece, n, version))
    tail = payload[at:]
    if len(tail) != len(out) - whole:
        raise CorruptBlock(f"block tail of {len(tail)} bytes, expected {len(out) - whole}")
    out[whole:] = tail
    if flags & ~SIGN_MOVED or (flags & SIGN_MOVED and es not in _UINT):
        raise CorruptBlock(f"unknown block flags {flags:#x} for element size {es}")
    if es == 1:
        target = np.frombuffer(out, np.uint8, count=n)
        target[...] = planes[0]
    elif es in _UINT:
        _join(planes, np.frombuffer(out, _UINT[es], count=n), bool(flags & SIGN_MOVED))
    else:
        elements = np.frombuffer(out, np.uint8, count=whole).reshape(n, es)
        for j, plane in enumerate(planes):
            elements[:, j] = plane


def _plane(mode: int, a: int, b: int, piece: memoryview, n: int, version: int) -> Any:
    if mode == RAW:
        if len(piece) != n:
            raise CorruptBlock(f"raw plane of {len(piece)} bytes, expected {n}")
        return np.frombuffer(piece, np.uint8)
    if mode == CONST:
        if len(piece):
            raise CorruptBlock(f"a constant plane with {len(piece)} stored bytes")
        return np.uint8(a)
    if mode == BIT:
        if b > 7 or len(piece) != -(-n // 8):
            raise CorruptBlock(f"bit plane of {len(piece)} bytes at bit {b}, for {n} bytes")
        bits = np.unpackbits(np.frombuffer(piece, np.uint8), count=-(-n // 8) * 8)
        words = bits.view(np.uint64)  # each byte is 0 or 1: shift them 8 at a time
        words <<= np.uint64(b)
        bits |= np.uint8(a)
        return bits[:n]
    if mode == ZSTD:
        return np.frombuffer(_unzstd(piece, n, version), np.uint8)
    raise CorruptBlock(f"unknown plane mode {mode}")


def _unzstd(frame: memoryview, size: int, version: int) -> bytes:
    """The ``size`` bytes that ``frame`` decodes to. zstd sizes its output by the content
    size a frame's header declares and ignores ``max_output_size`` then, so a frame that
    declares any other size (format 2: any size) is refused before a byte is allocated."""
    try:
        if version == 1:
            declared = _codecs.content_size(frame)
            if declared not in (size, -1):  # -1: not declared (then max_output_size holds)
                raise CorruptBlock(
                    f"a zstd plane declares {declared} bytes, expected {size}; refused unread"
                )
            data = _codecs.v1.decompress(frame, max_output_size=size)
        else:
            # A magicless frame starts with its header descriptor: a content size field
            # (bits 6-7) or a single segment (bit 5, then the size is always there).
            if not len(frame) or frame[0] & 0xE0:
                declared = _codecs.content_size(_MAGIC + bytes(frame[:18]))
                raise CorruptBlock(
                    f"a zstd plane declares {declared} bytes (format 2 frames declare none, "
                    f"expected {size}); refused unread"
                )
            data = _codecs.v2.decompress(frame, max_output_size=size)
    except _codecs.error as exc:
        raise CorruptBlock(f"zstd: {exc}") from None
    if len(data) != size:
        raise CorruptBlock(f"zstd plane of {len(data)} bytes, expected {size}")
    return data


def _unpack(
    frame: memoryview, escapes: memoryview, n: int, base: int, k: int, version: int
) -> np.ndarray:
    if k not in _ESCAPE:
        raise CorruptBlock(f"packed plane with {k} codes per byte")
    codes = np.frombuffer(_unzstd(frame, -(-n // k), version), np.uint8)
    if k == 2:
        wide = codes.astype(_U16)
        wide |= wide * np.uint16(16)  # numpy's 16-bit shifts are slower than multiplies
        wide &= np.uint16(0x0F0F)
    else:
        wide = codes.astype(_UINT[4])
        wide |= wide << 12
        wide &= 0x000F000F
        wide |= wide << 6
        wide &= 0x03030303
    plane = wide.view(np.uint8)[:n]
    if len(escapes):  # without escapes the CRC of the stored bytes guards the codes
        where = np.flatnonzero(plane == _ESCAPE[k])
        if len(where) != len(escapes):
            raise CorruptBlock(f"{len(where)} escapes in a packed plane that stores {len(escapes)}")
        plane += np.uint8(base)
        plane[where] = np.frombuffer(escapes, np.uint8)
    else:
        plane += np.uint8(base)
    return plane


def _join(planes: list[Any], words: np.ndarray, moved: bool) -> None:
    """Assemble ``words`` from their byte planes, by halves: bytes into 16-bit halves,
    those into 32-bit ones and so on (fewer whole-array passes than byte by byte)."""
    es = len(planes)
    kind = words.dtype.type
    if es == 2 and moved:
        # The low plane is [sign, 7 bits]: widened as a signed byte, the sign extends
        # over the bits the exponent takes, and one mask keeps the sign and the 7 bits.
        words.view("<i2")[...] = planes[0].view(np.int8)
        words &= kind(0x807F)
        exponent = np.empty_like(words)
        exponent[...] = planes[1]
        exponent *= kind(1 << 7)  # numpy's 16-bit shifts are slower than multiplies
        words |= exponent
        return
    if es == 2:
        words[...] = planes[1]
        words *= kind(1 << 8)
        words |= planes[0]
        return
    half = es // 2
    low = np.empty(len(words), _UINT[half])
    high = np.empty(len(words), _UINT[half])
    _join(planes[:half], low, False)
    _join(planes[half:], high, moved)
    words[...] = high
    words <<= kind(8 * half)
    words |= low
