"""Reads larger than a staging slot (mount.max_pages 1024: 4 MiB requests), served whole from
hostd's large buffers (hostd/link.py, Staging): byte-exact from NVMe (checked chunk by chunk)
and from DRAM through hostd, read ahead by the request's size, and the file's end mid-buffer."""

import os

import pytest
from test_read_ahead import pread_aligned, read_ahead_counts, write_closed

from support import MiB, pattern, wait_settled

LARGE = {"mount.max_pages": 1024}


def restart(s) -> None:
    """Everything written behind, bluecached restarted: every file is on NVMe only."""
    wait_settled(s.daemon)
    assert s.daemon.stop() == 0
    s.daemon.start()


def read_pieces(path, piece: int) -> bytes:
    """llm-d's read loop: read(2) of `piece` bytes into page-aligned memory until EOF."""
    fd = os.open(path, os.O_RDONLY)
    out = b""
    try:
        while chunk := pread_aligned(fd, piece, len(out)):
            out += chunk
    finally:
        os.close(fd)
    return out


@pytest.mark.parametrize("size", [32 * MiB, 9 * MiB + 4097])
def test_an_nvme_hit_read_in_4_mib_requests_is_byte_exact(mounted, size):
    s = mounted(allow_log=["lost bluecached"], hostd_settings=LARGE)
    data = pattern(f"large{size}", size)
    path = s.mnt / "nvme.bin"
    write_closed(s, path, data)
    restart(s)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)   # vLLM's read: one readv of the block
    try:
        assert pread_aligned(fd, size + MiB, 0) == data
        assert pread_aligned(fd, 4 * MiB, 4 * MiB) == data[4 * MiB:8 * MiB]
    finally:
        os.close(fd)
    assert read_pieces(path, 8 * MiB) == data        # llm-d's, 8 MiB at a time
    served, _ = read_ahead_counts(s)
    assert served >= 1     # requests answered from a large buffer read ahead


def test_dram_reads_through_hostd_in_4_mib_requests(mounted):
    s = mounted(hostd_settings={**LARGE, "mount.passthrough": False})
    data = os.urandom(13 * MiB + 123)
    path = s.mnt / "dram.bin"
    write_closed(s, path, data)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        assert pread_aligned(fd, 16 * MiB, 0) == data
        assert pread_aligned(fd, 4 * MiB, 12 * MiB) == data[12 * MiB:]
        assert pread_aligned(fd, 4 * MiB, 16 * MiB) == b""
    finally:
        os.close(fd)
    # many readers at once: more 4 MiB requests than large buffers, none lost or mixed up
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(24) as pool:
        assert all(got == data for got in pool.map(lambda _: read_pieces(path, 8 * MiB),
                                                   range(24)))
