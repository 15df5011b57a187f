"""CRC32C per chunk, and the CRC32C of a whole object derived from its chunks' CRCs.

An object's integrity travels as one CRC32C per 1 MiB chunk (what the NVMe tier stores, what
the remote tier puts in object metadata so a fetch can serve each chunk as soon as it is
checked) plus the CRC32C of the whole object. The whole one is derived from the chunk CRCs
(`combine`, as zlib's crc32_combine does for CRC-32) instead of a second pass over the bytes.
"""

from __future__ import annotations

import functools
import struct

import crc32c

POLY = 0x82F63B78   # CRC32C (Castagnoli), bit-reflected


def crc_of(views) -> int:
    """CRC32C of the bytes in `views`, in order."""
    crc = 0
    for v in views:
        crc = crc32c.crc32c(v, crc)
    return crc


def chunk_crcs(views, chunk_size: int) -> bytes:
    """Packed little-endian u32 CRC32C of each `chunk_size` piece of the bytes in `views` (the
    last piece may be shorter). Views may be of any lengths."""
    out, crc, filled = [], 0, 0
    for v in views:
        v = memoryview(v).cast("B")
        while len(v):
            take = min(len(v), chunk_size - filled)
            crc = crc32c.crc32c(v[:take], crc)
            filled += take
            v = v[take:]
            if filled == chunk_size:
                out.append(crc)
                crc, filled = 0, 0
    if filled:
        out.append(crc)
    return struct.pack(f"<{len(out)}I", *out)


def unpack(crcs: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(crcs) // 4}I", crcs)


def _times(matrix: tuple[int, ...], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _square(matrix: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(matrix, row) for row in matrix)


@functools.lru_cache(maxsize=64)
def _zeros_operator(length: int) -> tuple[int, ...]:
    """The GF(2) matrix that advances a CRC register over `length` zero bytes."""
    one_bit = (POLY,) + tuple(1 << i for i in range(31))   # one zero bit
    operator = tuple(1 << i for i in range(32))             # identity
    power = _square(_square(_square(one_bit)))               # one zero byte
    while length:
        if length & 1:
            operator = tuple(_times(power, row) for row in operator)
        length >>= 1
        if length:
            power = _square(power)
    return operator


def combine(crc1: int, crc2: int, length2: int) -> int:
    """CRC32C of A + B from crc1 = CRC32C(A), crc2 = CRC32C(B) and len(B)."""
    if length2 <= 0:
        return crc1
    return _times(_zeros_operator(length2), crc1) ^ crc2


def object_crc(crcs: bytes, size: int, chunk_size: int) -> int:
    """CRC32C of an object of `size` bytes from the CRCs of its `chunk_size` chunks."""
    total = 0
    for i, crc in enumerate(unpack(crcs)):
        total = combine(total, crc, min(chunk_size, size - i * chunk_size))
    return total
