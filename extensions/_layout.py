"""The record headers of :class:`~extensions.weights.WeightCodec` streams, formats 1 to 3.

A stream is a run of block records and one end record. A block's header gives its
decoded size, its flags and one head per byte plane: ``(mode, a, b, length, extra)``
(see ``extensions/_planes.py`` for the modes). Both formats carry the same heads:

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


def _varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)


def pack_v2_block(nbytes: int, flags: int, heads: list[PlaneHead]) -> bytes:
    body = bytearray()
    _varint(body, nbytes)
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
        _varint(body, length)
    elif mode == PACK:
        body += bytes((a, b))
        _varint(body, length)
        _varint(body, extra)
    elif mode == JOINT:
        body.append(a)
        _varint(body, length)
        _varint(body, extra)


def pack_v2_end(total: int) -> bytes:
    body = bytearray()
    _varint(body, total)
    return V2_PREFIX.pack(END_TAG, len(body)) + body


class _Cursor:
    def __init__(self, body: memoryview) -> None:
        self.body = body
        self.at = 0

    def byte(self) -> int:
        if self.at >= len(self.body):
            raise CorruptBlock("a block header is cut short")
        self.at += 1
        return self.body[self.at - 1]

    def varint(self) -> int:
        value = 0
        for shift in range(0, 7 * _MAX_VARINT, 7):
            byte = self.byte()
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
        raise CorruptBlock(f"a block header holds a varint of more than {_MAX_VARINT} bytes")


def parse_v2_end(body: memoryview) -> int:
    cursor = _Cursor(body)
    total = cursor.varint()
    if cursor.at != len(body):
        raise CorruptBlock("the end record has bytes after its total")
    return total


def parse_v2_block(body: memoryview, es: int, limit: int) -> tuple[int, int, list[PlaneHead]]:
    """``(nbytes, flags, heads)`` of a format-2 block body; ``nbytes`` is checked against
    ``limit`` before the plane lengths it implies are computed."""
    cursor = _Cursor(body)
    nbytes = cursor.varint()
    if not 0 < nbytes <= limit:
        raise CorruptBlock(f"a block of {nbytes} bytes (at most {limit})")
    flags = cursor.byte()
    n = nbytes // es
    heads: list[PlaneHead] = []
    for _ in range(es):
        mode = cursor.byte()
        if mode == RAW:
            heads.append((RAW, 0, 0, n, 0))
        elif mode == CONST:
            heads.append((CONST, cursor.byte(), 0, 0, 0))
        elif mode == BIT:
            heads.append((BIT, cursor.byte(), cursor.byte(), -(-n // 8), 0))
        elif mode == ZSTD:
            heads.append((ZSTD, 0, 0, cursor.varint(), 0))
        elif mode == PACK:
            a, b = cursor.byte(), cursor.byte()
            heads.append((PACK, a, b, cursor.varint(), cursor.varint()))
        elif mode == SEVEN:
            heads.append((SEVEN, cursor.byte(), 0, seven_size(n), 0))
        elif mode == SIX:
            heads.append((SIX, 0, 0, six_size(n), 0))
        elif mode == JOINT:
            heads.append((JOINT, cursor.byte(), 0, cursor.varint(), cursor.varint()))
        else:
            raise CorruptBlock(f"unknown plane mode {mode}")
    if cursor.at != len(body):
        raise CorruptBlock(f"a block header has {len(body) - cursor.at} bytes after its planes")
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
