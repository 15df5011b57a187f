"""Chunk CRC32Cs and the whole-object CRC32C derived from them (bluecached/crc.py), and the
form they take in S3 object metadata (bluecached/tiers/s3.py)."""

import os

import crc32c
import pytest

from bluecached import crc
from bluecached.tiers.s3 import CHUNKS_META_MAX, decode_chunk_crcs, encode_chunk_crcs

MiB = 1 << 20


@pytest.mark.parametrize("length", [0, 1, 3, 4096, MiB - 1, MiB, 3 * MiB + 5])
def test_combine_equals_the_crc_of_the_concatenation(length):
    a, b = os.urandom(777), os.urandom(length)
    assert crc.combine(crc32c.crc32c(a), crc32c.crc32c(b), length) == crc32c.crc32c(a + b)


@pytest.mark.parametrize("size", [0, 1, MiB, 2 * MiB, 5 * MiB + 12345])
def test_object_crc_from_chunk_crcs_of_unaligned_views(size):
    data = os.urandom(size)
    step = 300_001   # views that straddle chunk boundaries
    views = [memoryview(data)[i:i + step] for i in range(0, size, step)]
    chunks = crc.chunk_crcs(views, MiB)
    assert len(chunks) == 4 * -(-size // MiB)
    assert list(crc.unpack(chunks)) == [crc32c.crc32c(data[i:i + MiB])
                                        for i in range(0, size, MiB)]
    assert crc.object_crc(chunks, size, MiB) == crc32c.crc32c(data)


def test_chunk_crcs_in_metadata_round_trip_and_inconsistent_ones_are_ignored():
    data = os.urandom(3 * MiB + 10)
    chunks = crc.chunk_crcs([data], MiB)
    whole = crc32c.crc32c(data)
    value = encode_chunk_crcs(chunks, MiB)
    assert decode_chunk_crcs(value, len(data), whole) == (chunks, MiB)
    # anything that does not agree with the whole object's CRC is not trusted
    assert decode_chunk_crcs(value, len(data), whole ^ 1) is None
    assert decode_chunk_crcs(value, len(data) + MiB, whole) is None       # count differs
    assert decode_chunk_crcs(value.replace(":", ":!"), len(data), whole) is None
    assert decode_chunk_crcs("0:", 0, 0) is None
    assert decode_chunk_crcs("garbage", len(data), whole) is None
    assert decode_chunk_crcs(value, len(data), None) is None


def test_chunk_crcs_that_would_not_fit_the_metadata_limit_are_left_out():
    assert encode_chunk_crcs(bytes(4 * 200), MiB) is not None     # 200 MiB
    assert encode_chunk_crcs(bytes(4 * 1100), MiB) is None        # too long for 2 KB
    assert len(encode_chunk_crcs(bytes(4 * 255), MiB)) <= CHUNKS_META_MAX
