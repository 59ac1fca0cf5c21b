"""The record headers of :class:`~extensions.weights.WeightCodec` streams, formats 1 to 3.

A stream is a run of block records and one end record. A block's header gives its
decoded size, its flags and one head per byte plane: ``(mode, a, b, length, extra)``
(see ``extensions/_plane_modes.py`` for the modes). Both formats carry the same heads:

Format 1, fixed sizes: block ``u8 tag=1, u32 nbytes, u8 flags``, then per plane ``u8
mode, u8 a, u8 b, u8 0, u32 length, u32 extra``; end ``u8 tag=0, u64 total``.

Format 2, compact (a small tensor's headers cost what its data does; format 3 is format
2 with two more plane modes, for its JOINT blocks): every record is
``u8 tag, u8 size`` and ``size`` bytes of body. A block's body is ``varint nbytes, u8
flags``, then per plane ``u8 mode`` and only what the mode needs: RAW nothing (its
length is the plane's), CONST ``a``, BIT ``a, b`` (length: a bit per element), ZSTD
``varint length``, PACK ``a, b, varint length, varint extra``, SEVEN ``a`` (length:
:func:`seven_size`); format 3 adds SIX nothing (length: :func:`six_size`) and JOINT
``a, varint length, varint extra``. The end record's body is
``varint total``. Varints are LEB128, at most 5 bytes (a value below 2**35).

Parsing checks every field against the block it describes and raises
:class:`CorruptBlock`; the sizes it returns are what the reader then bounds.
"""

from __future__ import annotations

import struct

BLOCK_TAG = 1
END_TAG = 0
RAW, CONST, BIT, ZSTD, PACK, SEVEN, SIX, JOINT = range(8)
V1_HEAD = struct.Struct("<BIB")
V1_PLANE = struct.Struct("<BBBBII")
V1_END = struct.Struct("<BQ")
#: Format 2's record prefix: tag and body size.
V2_PREFIX = struct.Struct("<BB")
_MAX_VARINT = 5

PlaneHead = tuple[int, int, int, int, int]


def six_size(n: int) -> int:
    """Stored bytes of a SIX plane of ``n`` elements: 3 per 4 (``extensions/_joint.py``)."""
    return -(-n // 4) * 3


def seven_size(n: int) -> int:
    """Stored bytes of a SEVEN plane of ``n`` bytes: 7 per 8, in rows of 64 values."""
    return -(-n // 64) * 56


class CorruptBlock(ValueError):
    """The stored block cannot be decoded (the message says what is wrong)."""


def _put_varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)


def pack_v2_block(nbytes: int, flags: int, heads: list[PlaneHead]) -> bytes:
    body = bytearray()
    _put_varint(body, nbytes)
    body.append(flags)
    for head in heads:
        _pack_head(body, head)
    return V2_PREFIX.pack(BLOCK_TAG, len(body)) + body


def head_size(head: PlaneHead) -> int:
    """The bytes ``head`` takes in a format-2 block header."""
    body = bytearray()
    _pack_head(body, head)
    return len(body)


def _pack_head(body: bytearray, head: PlaneHead) -> None:
    mode, a, b, length, extra = head
    body.append(mode)
    if mode in (CONST, SEVEN):
        body.append(a)
    elif mode == BIT:
        body += bytes((a, b))
    elif mode == ZSTD:
        _put_varint(body, length)
    elif mode == PACK:
        body += bytes((a, b))
        _put_varint(body, length)
        _put_varint(body, extra)
    elif mode == JOINT:
        body.append(a)
        _put_varint(body, length)
        _put_varint(body, extra)


def pack_v2_end(total: int) -> bytes:
    body = bytearray()
    _put_varint(body, total)
    return V2_PREFIX.pack(END_TAG, len(body)) + body


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at ``data[at]`` and where it ends (``IndexError`` past the end)."""
    value = 0
    for shift in range(0, 7 * _MAX_VARINT, 7):
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
    raise CorruptBlock(f"a block header holds a varint of more than {_MAX_VARINT} bytes")


_CUT_SHORT = "a block header is cut short"


def parse_v2_end(body: memoryview) -> int:
    try:
        total, at = _varint(bytes(body), 0)
    except IndexError:
        raise CorruptBlock(_CUT_SHORT) from None
    if at != len(body):
        raise CorruptBlock("the end record has bytes after its total")
    return total


def parse_v2_block(body: memoryview, es: int, limit: int) -> tuple[int, int, list[PlaneHead]]:
    """``(nbytes, flags, heads)`` of a format-2 block body; ``nbytes`` is checked against
    ``limit`` before the plane lengths it implies are computed."""
    data = bytes(body)  # at most 255 bytes; indexing past its end: cut short
    try:
        nbytes, at = _varint(data, 0)
        if not 0 < nbytes <= limit:
            raise CorruptBlock(f"a block of {nbytes} bytes (at most {limit})")
        flags = data[at]
        at += 1
        n = nbytes // es
        heads: list[PlaneHead] = []
        for _ in range(es):
            mode = data[at]
            at += 1
            if mode == RAW:
                heads.append((RAW, 0, 0, n, 0))
            elif mode == CONST:
                heads.append((CONST, data[at], 0, 0, 0))
                at += 1
            elif mode == BIT:
                heads.append((BIT, data[at], data[at + 1], -(-n // 8), 0))
                at += 2
            elif mode == ZSTD:
                length, at = _varint(data, at)
                heads.append((ZSTD, 0, 0, length, 0))
            elif mode == PACK:
                a, b = data[at], data[at + 1]
                length, at = _varint(data, at + 2)
                extra, at = _varint(data, at)
                heads.append((PACK, a, b, length, extra))
            elif mode == SEVEN:
                heads.append((SEVEN, data[at], 0, seven_size(n), 0))
                at += 1
            elif mode == SIX:
                heads.append((SIX, 0, 0, six_size(n), 0))
            elif mode == JOINT:
                a = data[at]
                length, at = _varint(data, at + 1)
                extra, at = _varint(data, at)
                heads.append((JOINT, a, 0, length, extra))
            else:
                raise CorruptBlock(f"unknown plane mode {mode}")
    except IndexError:
        raise CorruptBlock(_CUT_SHORT) from None
    if at != len(data):
        raise CorruptBlock(f"a block header has {len(data) - at} bytes after its planes")
    return nbytes, flags, heads


def v1_heads(head: memoryview, es: int) -> list[PlaneHead]:
    """The plane heads of a format-1 block header (after its ``V1_HEAD``)."""
    heads = []
    for i in range(es):
        mode, a, b, _, length, extra = V1_PLANE.unpack_from(head, i * V1_PLANE.size)
        heads.append((mode, a, b, length, extra))
    return heads


def payload_size(heads: list[PlaneHead]) -> int:
    return sum(h[3] + (h[4] if h[0] in (PACK, JOINT) else 0) for h in heads)
