"""CRC-32C algebra: a concatenation's checksum from its parts' (``crc32c_combine``,
zlib's ``crc32_combine`` over the Castagnoli polynomial) and, the other way, the
checksum of the middle of ``head + middle + tail`` from the whole's and the ends'
bytes (``crc32c_middle``), so a tensor's checksum is known from a stored item's before
its bytes are read. Both are GF(2) matrix products: a CRC register fed ``n`` zero bytes
is a linear map of the register, and so is its inverse."""

from __future__ import annotations

import functools

import crc32c

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected
_MASK = 0xFFFFFFFF


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32C of ``a + b`` from ``crc(a)``, ``crc(b)`` and ``len(b)``."""
    if len2 <= 0:
        return crc1
    return _apply(_forward(), crc1, len2) ^ crc2


def crc32c_middle(whole: int, head: bytes, tail: bytes, length: int) -> int:
    """The CRC-32C of the ``length`` bytes ``m`` of ``head + m + tail`` whose CRC-32C is
    ``whole``: ``whole = z(crc(head), length + len(tail)) ^ z(crc(m), len(tail)) ^
    crc(tail)``, where ``z(c, n)`` feeds ``n`` zero bytes to the register ``c``."""
    shifted = (
        whole ^ crc32c.crc32c(tail) ^ _apply(_forward(), crc32c.crc32c(head), length + len(tail))
    )
    return _apply(_backward(), shifted, len(tail))


def _apply(powers: list[list[int]], crc: int, nbytes: int) -> int:
    bit = 0
    while nbytes:
        if nbytes & 1:
            crc = _times(powers[bit], crc)
        nbytes >>= 1
        bit += 1
    return crc


@functools.cache
def _forward() -> list[list[int]]:
    """The operators feeding ``2**k`` zero bytes, k = 0..63."""
    return _powers([_POLY] + [1 << n for n in range(31)])  # one zero bit


@functools.cache
def _backward() -> list[list[int]]:
    """Their inverses: one zero bit taken back out of the register."""
    return _powers([_unstep(1 << n) for n in range(32)])


def _unstep(crc: int) -> int:
    # A step shifts right and xors the polynomial (whose top bit is set) when the bit
    # shifted out was 1: the top bit of the result says which.
    if crc & 0x80000000:
        return (((crc ^ _POLY) << 1) | 1) & _MASK
    return (crc << 1) & _MASK


def _powers(bit: list[int]) -> list[list[int]]:
    byte = _square(_square(_square(bit)))
    out = [byte]
    for _ in range(63):
        out.append(_square(out[-1]))
    return out


def _times(matrix: list[int], vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _square(matrix: list[int]) -> list[int]:
    return [_times(matrix, matrix[n]) for n in range(32)]
