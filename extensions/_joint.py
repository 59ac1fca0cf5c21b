"""The JOINT block of :class:`~extensions.weights.WeightCodec` (format 3): bfloat16 whose
sign varies, stored as two planes that are not byte planes.

A bfloat16 weight is a sign, an 8-bit exponent and 7 mantissa bits. Byte planes (formats
1 and 2) put the exponent in one plane, which codes well, and the sign with the mantissa
in the other, which zstd stores raw: its values are not uniform (within each power of
two, a bell-shaped distribution makes the smaller mantissas likelier, most of all in the
top bits and the top exponents), but by under 1/64 of the plane, zstd's bar for Huffman
coding. A JOINT block moves the top two mantissa bits next to the exponent, where that
skew is coded together with the exponent it depends on:

``joint``  one byte per element: ``code << 2 | m``; ``code`` is ``exponent - base``
           (mod 256) where that is below 63, else 63 (an escape: the exponent itself is
           stored after the plane, in order, as a PACK plane's escapes are); ``m`` the
           top two mantissa bits. Stored as a zstd frame (plane mode ``JOINT``: ``a`` is
           the base, ``length`` the frame's, ``extra`` the escapes').
``rest``   the sign above the low five mantissa bits: six bits an element, in three
           rows of ``q = ceil(n / 4)`` bytes: byte ``i`` of row ``k`` holds element
           ``k * q + i``'s six bits and, in its top two, bits ``2k, 2k + 1`` of
           element ``3 * q + i``'s (0 past the end): every pass over it is a pass over
           contiguous bytes (plane mode ``SIX``, stored as is).

Written only for ``WeightCodec(compact=True)``. The base is the start of the 63 exponents
that hold most of a sample. The encoder (``extensions/_planes.py``) uses a JOINT block
where the sign varies, a sample says the sign-and-mantissa plane is noise, and at most
1/20 of the elements escape; a small block, or one where escapes pass 1/100, is coded
both ways and the smaller kept. The block flags say which (``JOINT_BLOCK``). Split and
join are compiled loops (``extensions/_native.c``) or numpy passes that store the same
bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from extensions._layout import JOINT, SIX, PlaneHead, six_size

_U16 = np.dtype("<u2")
#: The code of an escaped exponent.
ESCAPE = 63
_SAMPLE_STEP = 61
_ROW_SHIFTS = np.array([[0], [2], [4]], np.uint8)  # where rows 0-2 carry quarter 3's bits
#: A block whose exponents escape more than this share of the time keeps byte planes.
MAX_ESCAPED = 0.05
#: Past this share of escapes the byte planes are coded too, and the smaller kept.
COMPARE_ESCAPED = 0.01

_native: ModuleType | None
try:  # the compiled loops (extensions/_native.c), built at install where a compiler is
    from extensions import _native
except ImportError:  # numpy passes only, the same bytes
    _native = None


def split(words: np.ndarray) -> tuple[int, np.ndarray, np.ndarray, np.ndarray] | None:
    """The JOINT planes of ``words`` (bfloat16 bits): ``(base, joint, rest, escapes)``;
    ``None`` where more than :data:`MAX_ESCAPED` of the exponents escape."""
    n = len(words)
    sample = (words[::_SAMPLE_STEP] >> 7).astype(np.uint8)
    cumulative = np.concatenate(([0], np.cumsum(np.bincount(sample, minlength=256))))
    base = int(np.argmax(cumulative[ESCAPE:] - cumulative[:-ESCAPE]))
    limit = int(n * MAX_ESCAPED)
    joint = np.empty(n, np.uint8)
    rest = np.empty(six_size(n), np.uint8)
    room = np.empty(limit, np.uint8)
    if _native is not None:
        nesc = _native.joint_split(joint, rest, words, base, room)
    else:
        nesc = _split(joint, rest, words, base, room)
    if nesc > limit:
        return None
    return base, joint, rest, room[:nesc]


def encode(
    words: np.ndarray, compress: Callable[[Any], bytes]
) -> tuple[list[PlaneHead], list[Any], int] | None:
    """A JOINT block of ``words``: plane heads, payload pieces and how many exponents
    escaped; ``None`` where too many escape or the joint plane (coded by ``compress``,
    zstd's) does not compress."""
    parts = split(words)
    if parts is None:
        return None
    base, joint, rest, escapes = parts
    frame = compress(joint.data)
    if len(frame) >= len(joint):
        return None
    heads: list[PlaneHead] = [(SIX, 0, 0, len(rest), 0), (JOINT, base, 0, len(frame), len(escapes))]
    return heads, [rest, frame] + ([escapes] if len(escapes) else []), len(escapes)


def _split(
    joint: np.ndarray, rest: np.ndarray, words: np.ndarray, base: int, room: np.ndarray
) -> int:
    """numpy's :func:`split`, the same bytes as ``_native.joint_split``."""
    exponents = (words >> 7) & 0xFF
    codes = (exponents + (256 - base)) & 0xFF
    escaped = np.flatnonzero(codes >= ESCAPE)
    nesc = len(escaped)
    if nesc <= len(room):
        room[:nesc] = exponents[escaped]
    codes[escaped] = ESCAPE
    np.copyto(joint, (codes << 2) | ((words >> 5) & 3), casting="unsafe")
    q = len(rest) // 3
    sixes = np.zeros(4 * q, np.uint8)
    np.copyto(sixes[: len(words)], ((words >> 10) & 0x20) | (words & 0x1F), casting="unsafe")
    quarters = sixes.reshape(4, q)
    rows = rest.reshape(3, q)
    np.left_shift((quarters[3] >> _ROW_SHIFTS) & 3, 6, out=rows)
    rows |= quarters[:3]
    return nesc


def join(
    words: np.ndarray, joint: np.ndarray, rest: memoryview, base: int, escapes: memoryview
) -> int:
    """Words from their JOINT planes (sizes checked by the caller); returns how many
    escapes the codes hold, 0 to ``len(escapes) + 1``: any count but ``len(escapes)``
    means a corrupt block, and ``words`` is then incomplete."""
    if _native is not None:
        return int(_native.joint_join(words, joint, rest, base, escapes))
    return _join(words, joint, rest, base, escapes)


def _join(
    words: np.ndarray, joint: np.ndarray, rest: memoryview, base: int, escapes: memoryview
) -> int:
    """numpy's :func:`join`, the same words as ``_native.joint_join``."""
    n = len(words)
    codes = joint >> 2
    escaped = np.flatnonzero(codes == ESCAPE)
    if len(escaped) != len(escapes):
        return min(len(escaped), len(escapes) + 1)
    exponents = (codes.astype(_U16) + base) & 0xFF
    exponents[escaped] = np.frombuffer(escapes, np.uint8)
    rows = np.frombuffer(rest, np.uint8).reshape(3, -1)
    sixes = np.empty((4, rows.shape[1]), np.uint8)
    np.bitwise_and(rows, 0x3F, out=sixes[:3])
    sixes[3] = ((rows >> 6) << _ROW_SHIFTS).sum(axis=0, dtype=np.uint8)
    six = sixes.reshape(-1)[:n].astype(_U16)
    np.copyto(
        words,
        ((six & 0x20) << 10) | (exponents << 7) | ((joint & 3).astype(_U16) << 5) | (six & 0x1F),
    )
    return len(escaped)
