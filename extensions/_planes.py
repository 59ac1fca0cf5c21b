"""One block of :class:`~extensions.weights.WeightCodec`: byte planes, each coded on its own.

A block holds up to :data:`BLOCK_BYTES` of an item as ``n`` elements of ``es`` bytes
(plus, in an item's last block only, a tail of fewer than ``es`` bytes, stored raw).
Byte ``j`` of every element goes to plane ``j``. For floating-point items whose sign
varies in the block, the sign first moves from the top bit to the top of the second
byte and the bits in between move up by one, so the top plane holds the exponent alone
(bfloat16, float32; float64's top 8 of 11) - the part of a float that compresses - and
the sign joins the noisy mantissa bits (ZipNN's insight). Where the sign does not vary
(a second moment) either split may code smaller: the exponent's low bit may code better
beside the mantissa bits it correlates with. The encoder codes both and keeps the smaller
at an item's first such block and every eighth after (:class:`SignSplits`); the blocks
between take the last answer. Each plane is then stored in the cheapest of six modes
(``RAW``, ``CONST``, ``BIT``, ``ZSTD``, ``PACK``, ``SEVEN``): ``extensions/_plane_modes.py``.

Format 3 (bfloat16 only) adds JOINT blocks, not byte planes: ``extensions/_joint.py``. In
format 2, a block of 4- or 8-byte elements whose two low planes are both raw is
flagged ``LOW_PAIR`` and stores them as one piece, the two low bytes of each element in
element order (their heads stay RAW): the decoder widens it into the words in one pass
instead of joining two byte planes.

All of it is work on cache-sized blocks that releases the GIL: zstd, numpy, and the
compiled split and pack of ``extensions/_native.c`` (numpy passes that store the same
bytes where it was not built). Headers: ``extensions/_layout.py``; decoding:
``extensions/_unplanes.py``. Format 2 writes zstd frames without magic number or
content size; a frame that declares a size is refused unread.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from extensions import _joint
from extensions._layout import RAW, PlaneHead
from extensions._plane_modes import (
    _SMALL,
    _U16,
    _UINT,
    _choose,
    _codecs,
    _encode_plane,
    _size,
    _stored,
)

#: Decoded bytes per block; part of formats 1 and 2.
BLOCK_BYTES = 1 << 19
SIGN_MOVED = 1
LOW_PAIR = 2
JOINT_BLOCK = 4  # format 3: a bfloat16 block stored as extensions/_joint.py says
_MAGIC = (0xFD2FB528).to_bytes(4, "little")  # what format 2 leaves off its zstd frames

#: The window a zstd plane may declare, in both formats: a plane is at most a block, so
#: no frame either wrote needs more, and a frame without a content size cannot make
#: zstd allocate more, and keep it, in the thread's context.
WINDOW = 2 * BLOCK_BYTES


_native: ModuleType | None
try:  # the compiled loops (extensions/_native.c), built at install where a compiler is
    from extensions import _native
except ImportError:  # numpy passes only, the same bytes
    _native = None


class SignSplits:
    """Which split a constant sign took in one item's recent blocks. An item's blocks are
    alike (one tensor: AdamW's second moment throughout), so coding both splits of every
    block mostly repeats the last block's answer: both are coded at the item's first such
    block, then every :data:`RECHECK`-th, and again at once after the answer changed;
    the blocks between take the last answer."""

    RECHECK = 8

    def __init__(self) -> None:
        self._moved: bool | None = None  # the last answer
        self._since = 0  # blocks coded one way since both were tried

    def guess(self) -> bool | None:
        """The split to code alone, or ``None``: code both."""
        if self._moved is None or self._since >= self.RECHECK - 1:
            return None
        self._since += 1
        return self._moved

    def learn(self, moved: bool) -> None:
        """Both splits were coded and ``moved`` was smaller."""
        changed = self._moved is not None and moved != self._moved
        self._moved = moved
        self._since = self.RECHECK if changed else 0  # changed: try both again next block


def encode_block(
    data: memoryview,
    es: int,
    floating: bool,
    splits: SignSplits | None = None,
    joint: bool = False,
) -> tuple[int, list[PlaneHead], list[Any]]:
    """The stored form of ``data`` (at most :data:`BLOCK_BYTES`): block flags, plane
    heads, and the payload pieces to write after the header. ``splits``: the item's
    memory of which split a constant sign took (without: both are coded); ``joint``:
    the elements are bfloat16 and the stream is of format 3, so a block whose sign
    varies may be a JOINT block (``extensions/_joint.py``)."""
    n = len(data) // es
    whole = n * es
    moved = varies = False
    flags = 0
    planes: list[np.ndarray] | None = None  # words: split once the split is known
    if es == 1:
        planes = [np.frombuffer(data, np.uint8, count=n)]
    elif es in _UINT:
        words = np.frombuffer(data, _UINT[es], count=n)
        if floating and n:
            sign = words.dtype.type(1 << (8 * es - 1))
            moved = varies = bool(words.max() >= sign) and bool(words.min() < sign)
    else:  # an element size without a numpy word: plain strided planes
        elements = np.frombuffer(data, np.uint8, count=whole).reshape(n, es)
        planes = [np.ascontiguousarray(elements[:, j]) for j in range(es)]
    # A JOINT block where the sign and mantissa look like noise (else their byte plane
    # codes smaller than six raw bits); a small block, or one with many escapes, is
    # coded both ways and the smaller kept.
    small = n <= _SMALL
    joint_coded = None
    if joint and varies and es == 2 and (small or _noisy_mantissas(words)):
        joint_coded = _joint.encode(words, _codecs.fast.compress)
        if joint_coded is not None and not small and joint_coded[2] <= n * _joint.COMPARE_ESCAPED:
            return _with_tail(SIGN_MOVED | JOINT_BLOCK, *joint_coded[:2], data, whole)
    constant_sign = bool(floating and n and es in _UINT and not varies)
    guess = splits.guess() if constant_sign and splits is not None else None
    if guess:
        moved = True
    if planes is None:
        planes = _split(words, es, moved)
    coded = [_encode_plane(plane, floating) for plane in planes]
    if constant_sign and guess is None:  # try both splits
        alternative = [_encode_plane(plane, True) for plane in _split(words, es, True)[-2:]]
        if _stored(alternative) < _stored(coded[-2:]):
            coded[-2:] = alternative
            moved = True
        if splits is not None:
            splits.learn(moved)
    if es in (4, 8) and coded[0][0][0] == RAW == coded[1][0][0]:
        coded[0] = coded[0][0], [words.astype(_U16)]
        coded[1] = coded[1][0], []
        flags = LOW_PAIR
    if joint_coded is not None:  # many escapes: the JOINT block only where it is smaller
        heads, pieces, _ = joint_coded
        if _size(heads, pieces) < _stored(coded):
            return _with_tail(SIGN_MOVED | JOINT_BLOCK, heads, pieces, data, whole)
    payloads = [piece for _, pieces in coded for piece in pieces]
    flags |= SIGN_MOVED if moved else 0
    return _with_tail(flags, [head for head, _ in coded], payloads, data, whole)


def _with_tail(
    flags: int, heads: list[PlaneHead], payloads: list[Any], data: memoryview, whole: int
) -> tuple[int, list[PlaneHead], list[Any]]:
    if whole < len(data):  # an item's last bytes, fewer than an element: raw
        payloads.append(data[whole:])
    return flags, heads, payloads


def _noisy_mantissas(words: np.ndarray) -> bool:
    """Whether the sign-and-mantissa plane of 16-bit ``words`` would be stored raw, as a
    sample of 8192 or more says (only a large one tells a 0.4% gain from 1.5%)."""
    sample = words[:: max(1, len(words) >> 13)]
    low = ((sample >> 8) & 0x80) | (sample & 0x7F)
    return _choose(np.bincount(low, minlength=256)) is None


def _split(words: np.ndarray, es: int, moved: bool) -> list[np.ndarray]:
    """Byte ``j`` of each word; with ``moved``, the sign bit moves from the top of the
    word to the top of the second byte from the top, and the bits between move up one."""
    n = len(words)
    if _native is not None and es in (2, 4) and n:
        out = np.empty(es * n, np.uint8)
        _native.split(out, words, es, moved)
        return [out[j * n : (j + 1) * n] for j in range(es)]
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
