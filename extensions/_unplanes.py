"""Decoding one block of :class:`~extensions.weights.WeightCodec` (the planes:
``extensions/_planes.py``; their modes: ``extensions/_plane_modes.py``; the headers:
``extensions/_layout.py``).

Every size is checked against the block before anything is allocated or decoded: a
stored block cannot make the decoder allocate more than its decoded size allows.

Packed planes are unpacked, and planes of 2- and 4-byte elements joined, by the compiled
loops of ``extensions/_native.c`` (one pass each) where the package was built with them.
Without them, and for 8-byte elements, whole-array numpy passes do it, in place, into
arrays each thread keeps from block to block (a fresh 256 KiB array per pass costs its
page faults every block), and the last join writes the caller's buffer: byte planes are
joined in 16-bit halves, those into 32-bit words and so on; numpy's multiplies beat its
shifts, and an operation on two arrays of one dtype beats one that casts, so bytes widen
once, then combine. A ``LOW_PAIR`` block's low half comes stored as 16-bit words, joined
by none. Both paths decode the same bytes.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

import numpy as np

from extensions import _joint, _planes
from extensions._layout import (
    BIT,
    CONST,
    JOINT,
    PACK,
    RAW,
    SEVEN,
    SIX,
    ZSTD,
    CorruptBlock,
    PlaneHead,
    seven_size,
    six_size,
)
from extensions._plane_modes import _ESCAPE, _UINT, _codecs
from extensions._planes import _MAGIC, JOINT_BLOCK, LOW_PAIR, SIGN_MOVED, WINDOW
from extensions._zstd_window import decompressor, refused

_native: ModuleType | None = _planes._native  # None: numpy passes (tests set it)

#: Below this many escapes a packed plane finds them with ``bytearray.find`` (memchr).
_FEW_ESCAPES = 48


class _Scratch(threading.local):
    """Arrays a thread reuses from block to block, by role; each grows to the largest
    block the thread has decoded (at most a block's decoded size per role)."""

    def __init__(self) -> None:
        self.buffers: dict[str, bytearray] = {}

    def array(self, role: str, dtype: Any, count: int) -> np.ndarray:
        size = count * np.dtype(dtype).itemsize
        buffer = self.buffers.get(role)
        if buffer is None or len(buffer) < size:
            buffer = self.buffers[role] = bytearray(size)
        return np.frombuffer(buffer, dtype, count=count)


_scratch = _Scratch()


def decode_block(
    heads: list[PlaneHead], flags: int, payload: memoryview, out: memoryview, es: int, version: int
) -> None:
    """Decode one block of format ``version`` into ``out`` (its ``nbytes``); raises
    :class:`CorruptBlock`."""
    if flags & JOINT_BLOCK and version >= 3:
        _decode_joint(heads, flags, payload, out, es)
        return
    paired = flags & LOW_PAIR
    if (
        flags & ~(SIGN_MOVED | LOW_PAIR)
        or (flags and es not in _UINT)
        or (paired and (es == 2 or version == 1 or heads[0][0] != RAW or heads[1][0] != RAW))
    ):
        raise CorruptBlock(f"unknown block flags {flags:#x} for element size {es}")
    n = len(out) // es
    whole = n * es
    planes: list[Any] = []
    at = 0
    for j, (mode, a, b, length, extra) in enumerate(heads):
        piece = payload[at : at + length]
        at += length
        if paired and j < 2:  # both raw: their 2n bytes are the low 16 bits of each word
            planes.append(None if j else _plane(RAW, 0, 0, payload[: 2 * n], 2 * n, version, ""))
        elif mode == PACK:
            escapes = payload[at : at + extra]
            planes.append(_unpack(piece, escapes, n, a, b, version, f"plane{j}"))
            at += extra
        else:
            planes.append(_plane(mode, a, b, piece, n, version, f"plane{j}"))
    tail = payload[at:]
    if len(tail) != len(out) - whole:
        raise CorruptBlock(f"block tail of {len(tail)} bytes, expected {len(out) - whole}")
    out[whole:] = tail
    if es == 1:
        np.frombuffer(out, np.uint8, count=n)[...] = planes[0]
    elif es in _UINT:
        _join(planes, np.frombuffer(out, _UINT[es], count=n), bool(flags & SIGN_MOVED))
    else:
        elements = np.frombuffer(out, np.uint8, count=whole).reshape(n, es)
        for j, plane in enumerate(planes):
            elements[:, j] = plane


def _decode_joint(
    heads: list[PlaneHead], flags: int, payload: memoryview, out: memoryview, es: int
) -> None:
    """A JOINT block (``extensions/_joint.py``): a SIX plane, then a JOINT plane (a zstd
    frame and the escaped exponents), then the tail, if any."""
    n = len(out) // es
    if flags != SIGN_MOVED | JOINT_BLOCK or es != 2:
        raise CorruptBlock(f"unknown block flags {flags:#x} for element size {es}")
    if [h[0] for h in heads] != [SIX, JOINT]:
        raise CorruptBlock(f"a JOINT block with plane modes {[h[0] for h in heads]}")
    _, base, _, length, nesc = heads[1]
    sixes = six_size(n)
    tail = payload[sixes + length + nesc :]
    if len(tail) != len(out) - 2 * n:
        raise CorruptBlock(f"a JOINT block of {len(payload)} bytes does not hold {n} elements")
    joint = np.frombuffer(_unzstd(payload[sixes : sixes + length], n, 3), np.uint8)
    words = np.frombuffer(out, _UINT[2], count=n)
    found = _joint.join(words, joint, payload[:sixes], base, payload[sixes + length :][:nesc])
    _check_escapes(found, nesc)
    out[2 * n :] = tail


def _plane(mode: int, a: int, b: int, piece: memoryview, n: int, version: int, role: str) -> Any:
    """A plane stored in ``mode``: an array of ``n`` bytes, or one byte (CONST); SEVEN
    decodes into the thread's ``role`` array."""
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
    if mode == SEVEN and version > 1:
        if a & 0x7F or len(piece) != seven_size(n):
            raise CorruptBlock(f"7-bit plane of {len(piece)} bytes, top bit {a:#x}, for {n} bytes")
        return _unseven(piece, n, a, role)
    raise CorruptBlock(f"unknown plane mode {mode}")


_SHIFTS = np.arange(7, 0, -1, dtype=np.uint64)[:, None]
_TOPS = np.array([[0x0101010101010101 << j] for j in range(7)], np.uint64)


def _unseven(piece: memoryview, n: int, top: int, role: str) -> np.ndarray:
    """A SEVEN plane (see ``extensions/_planes.py``), in word-wide passes."""
    stored = np.frombuffer(piece, _UINT[8]).reshape(7, -1)
    rows = _scratch.array(role, _UINT[8], len(piece) // 7).reshape(8, -1)
    np.bitwise_and(stored, np.uint64(0x7F7F7F7F7F7F7F7F), out=rows[:7])
    bits = _scratch.array("seven", _UINT[8], stored.size).reshape(7, -1)
    np.right_shift(stored, _SHIFTS, out=bits)
    np.bitwise_and(bits, _TOPS, out=bits)
    np.bitwise_or.reduce(bits, axis=0, out=rows[7])
    if top:
        np.bitwise_or(rows, np.uint64(0x8080808080808080), out=rows)
    return rows.view(np.uint8).reshape(-1)[:n]


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
            data = decompressor(WINDOW).decompress(frame, max_output_size=size)
        else:
            # A magicless frame starts with its header descriptor: a content size field
            # (bits 6-7) or a single segment (bit 5, then the size is always there).
            if not len(frame) or frame[0] & 0xE0:
                declared = _codecs.content_size(_MAGIC + bytes(frame[:18]))
                raise CorruptBlock(
                    f"a zstd plane declares {declared} bytes (format 2 frames declare none, "
                    f"expected {size}); refused unread"
                )
            data = decompressor(WINDOW, magicless=True).decompress(frame, max_output_size=size)
    except _codecs.error as exc:
        raise CorruptBlock(refused(exc, WINDOW)) from None
    if len(data) != size:
        raise CorruptBlock(f"zstd plane of {len(data)} bytes, expected {size}")
    return data


def _unpack(
    frame: memoryview, escapes: memoryview, n: int, base: int, k: int, version: int, role: str
) -> np.ndarray:
    """A PACK plane, into the thread's ``role`` array: the codes spread to a byte each in
    wide words (two nibbles, or four 2-bit codes, per code byte), escapes put back."""
    if k not in _ESCAPE:
        raise CorruptBlock(f"packed plane with {k} codes per byte")
    count = -(-n // k)
    codes = np.frombuffer(_unzstd(frame, count, version), np.uint8)
    if _native is not None:
        plane = _scratch.array(role, np.uint8, n)
        found = _native.spread(plane, codes, k, base, escapes)
        _check_escapes(found, len(escapes))
        return plane
    kind = _UINT[k].type
    wide = _scratch.array(role, _UINT[k], count)
    spread = _scratch.array("spread", _UINT[k], count)
    np.copyto(wide, codes)
    if k == 2:
        np.multiply(wide, kind(16), out=spread)  # numpy's 16-bit shifts crawl
        np.bitwise_or(wide, spread, out=wide)
        np.bitwise_and(wide, kind(0x0F0F), out=wide)
    else:
        np.multiply(wide, kind(1 << 12), out=spread)
        np.bitwise_or(wide, spread, out=wide)
        np.bitwise_and(wide, kind(0x000F000F), out=wide)
        np.multiply(wide, kind(1 << 6), out=spread)
        np.bitwise_or(wide, spread, out=wide)
        np.bitwise_and(wide, kind(0x03030303), out=wide)
    plane = wide.view(np.uint8)[:n]
    # Counted even when none are stored (one memchr): an escape code without its byte
    # is refused, as the compiled loop refuses it, never decoded to base + escape.
    where = _escaped(plane, _ESCAPE[k], len(escapes), _scratch.buffers[role])
    np.add(plane, np.uint8(base), out=plane)
    if len(escapes):
        plane[where] = np.frombuffer(escapes, np.uint8)
    return plane


def _escaped(plane: np.ndarray, escape: int, stored: int, memory: bytearray) -> Any:
    """Where ``plane`` (the start of ``memory``) holds ``escape``: exactly ``stored``
    places, or :class:`CorruptBlock`. A few are found by memchr, many by numpy."""
    if stored <= _FEW_ESCAPES:
        where: list[int] = []
        at = memory.find(escape, 0, len(plane))
        while at >= 0 and len(where) <= stored:
            where.append(at)
            at = memory.find(escape, at + 1, len(plane))
        found = len(where) + (at >= 0)
    else:
        where = np.flatnonzero(plane == escape)  # type: ignore[assignment]
        found = len(where)
    _check_escapes(found, stored)
    return where


def _check_escapes(found: int, stored: int) -> None:
    """The escape codes found in a packed plane (at most one past ``stored`` counted)
    must be exactly the escaped bytes it stores."""
    if found != stored:
        raise CorruptBlock(
            f"{found if found <= stored else 'more'} escapes in a packed plane that stores {stored}"
        )


def _join(planes: list[Any], words: np.ndarray, moved: bool) -> None:
    """Assemble ``words`` from their byte planes, by halves: bytes into 16-bit halves,
    those into 32-bit ones and so on; ``moved``: the sign is bit 7 of the second plane
    from the top (see ``extensions/_planes.py``)."""
    es = len(planes)
    if _native is not None and es in (2, 4):
        n = len(words)
        arrays = [
            _scratch.array(f"const{j}", np.uint8, n) if isinstance(p, np.generic) else p
            for j, p in enumerate(planes)
        ]
        for array, plane in zip(arrays, planes):
            if array is not plane:
                array.fill(plane)
        if arrays[1] is None:  # a LOW_PAIR block's stored low half
            del arrays[1]
        _native.join(words, tuple(arrays), moved)
        return
    if es == 2:
        _pair(planes[0], planes[1], words, moved)
        return
    half = es // 2
    wide = _UINT[half]
    kind = words.dtype.type
    if half == 2 and planes[1] is None:  # a LOW_PAIR block's stored low half
        low = planes[0].view(wide)
    else:
        low = _scratch.array(f"low{half}", wide, len(words))
        _join(planes[:half], low, False)
    high = _scratch.array(f"high{half}", wide, len(words))
    _join(planes[half:], high, moved)
    np.copyto(words, high)
    np.multiply(words, kind(1 << (8 * half)), out=words)
    widened = _scratch.array(f"wide{es}", words.dtype, len(words))
    np.copyto(widened, low)
    np.bitwise_or(words, widened, out=words)


def _pair(low: Any, high: Any, words: np.ndarray, moved: bool) -> None:
    """16-bit ``words`` from a low and a high plane (arrays, or one byte each)."""
    kind = words.dtype.type
    byte = _scratch.array("byte", words.dtype, len(words))
    if moved:
        # The low plane is [sign, 7 bits]: widened as a signed byte, the sign extends
        # over the bits the exponent takes, and one mask keeps the sign and the 7 bits.
        np.copyto(words.view("<i2"), np.asarray(low).view(np.int8))
        np.bitwise_and(words, kind(0x807F), out=words)
        np.copyto(byte, high)
        np.multiply(byte, kind(1 << 7), out=byte)
    else:
        np.copyto(words, high)
        np.multiply(words, kind(1 << 8), out=words)
        np.copyto(byte, low)
    np.bitwise_or(words, byte, out=words)
