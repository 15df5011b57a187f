"""Read-ahead through a real mount (hostd/readahead.py): a sequential reader's next 1 MiB is
asked of the daemon before the reader asks for it. It must give the same bytes as no
read-ahead, and never bytes older than a change the reader could have seen before it read.

Reads of a complete file reach hostd only without passthrough (mount.passthrough, on by
default): these tests switch it off. test_passthrough.py makes the same changes under it."""

import mmap
import os
import re
import time

import pytest

from connectors import llmd_read, llmd_write
from hostd import ioctl_abi as abi
from hostd.zerocopy import SharedBuffer, _describe, _ioctl, store_from
from support import MiB, pattern

# every read reaches hostd, in 1 MiB requests (one staging slot each): these tests count
# 1 MiB pieces; test_large_reads.py reads ahead 4 MiB requests (mount.max_pages 1024)
HOSTD_READS = {"mount.passthrough": False, "mount.max_pages": 256}


def read_ahead_counts(s) -> tuple[int, int] | None:
    """Stops hostd; (reads answered from read-ahead, read-aheads thrown away) from its log,
    None when it logged none (read-ahead off)."""
    assert s.hostd.stop(timeout=30) == 0
    counts = re.findall(r"reads answered from read-ahead: (\d+), read-aheads thrown away: (\d+)",
                        s.hostd.log.read_text())
    assert len(counts) <= 1
    return (int(counts[0][0]), int(counts[0][1])) if counts else None


@pytest.mark.parametrize("read_ahead", [4, 1, 0])
def test_sequential_reads_give_the_same_bytes_with_and_without_read_ahead(mounted, read_ahead):
    s = mounted(hostd_settings={"mount.read_ahead": read_ahead, **HOSTD_READS})
    blocks = {f"m/{i:02x}/blk{i}.bin": pattern(f"ra{i}", 8 * MiB + i * 4097) for i in range(4)}
    for rel, data in blocks.items():
        assert llmd_write(s.mnt, rel, data, "t")
    for _ in range(2):
        for rel, data in blocks.items():
            assert llmd_read(s.mnt, rel) == data
    counts = read_ahead_counts(s)
    if read_ahead:
        # 8 full 1 MiB reads per file and read, then one at the end: all but the first come
        # from read-ahead
        served, _ = counts
        assert served >= 4 * 2 * 7, counts
    else:
        assert counts is None


def pread_aligned(fd: int, size: int, offset: int) -> bytes:
    """pread into page-aligned memory, as the connectors read (O_DIRECT needs it): the kernel
    then asks for whole 1 MiB pieces. An unaligned buffer makes its first piece shorter."""
    buf = mmap.mmap(-1, size)
    try:
        n = os.preadv(fd, [buf], offset)
        return buf[:n]
    finally:
        buf.close()


def write_closed(s, path, data: bytes, timeout: float = 30) -> None:
    """Writes a file and waits until its handle is released everywhere (the kernel sends
    RELEASE after close(2) returns): no read-ahead is made while a file has a writer."""
    with open(path, "wb") as f:
        f.write(data)
    client = s.daemon.client()
    try:
        deadline = time.monotonic() + timeout
        while client.call("stats")["open_handles"]:
            assert time.monotonic() < deadline, "the writer's handle was never released"
            time.sleep(0.01)
    finally:
        client.close()


def _write_at(path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _store(path, data: bytes) -> None:
    """The zero-copy STORE through a handle of the same file (what store_from does under a
    temporary name, here on the file itself)."""
    with SharedBuffer(len(data)) as buf:
        buf.view()[:] = data
        fd = os.open(path, os.O_WRONLY)
        try:
            _ioctl(fd, abi.IOC_STORE, _describe(buf).pack())
        finally:
            os.close(fd)


CHANGES = {
    "pwrite through another handle":
        lambda p, old, new: (_write_at(p, MiB, new[MiB:2 * MiB]),
                             old[:MiB] + new[MiB:2 * MiB] + old[2 * MiB:])[1],
    "truncate by path": lambda p, old, new: (os.truncate(p, MiB + 4096), old[:MiB + 4096])[1],
    "zero-copy STORE": lambda p, old, new: (_store(p, new), new)[1],
    "O_TRUNC and rewrite": lambda p, old, new: (_rewrite(p, new[:3 * MiB]), new[:3 * MiB])[1],
}


def _rewrite(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("change", CHANGES)
def test_a_read_after_a_change_sees_the_change_not_bytes_read_ahead_before_it(mounted, change):
    s = mounted(hostd_settings=HOSTD_READS)
    path = str(s.mnt / "changing.bin")
    old, new = pattern("old", 4 * MiB), pattern("new", 4 * MiB)
    write_closed(s, path, old)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert pread_aligned(fd, MiB, 0) == old[:MiB]   # a full read: the next MiB is read ahead
        expected = CHANGES[change](path, old, new)
        rest = b""
        while chunk := pread_aligned(fd, MiB, MiB + len(rest)):
            rest += chunk
        assert rest == expected[MiB:], f"stale bytes after {change}"
    finally:
        os.close(fd)
    _, thrown_away = read_ahead_counts(s)
    assert thrown_away >= 1     # the read-ahead was there, and was not served


def test_store_from_publishes_over_a_file_being_read_ahead(mounted):
    """store_from writes a temporary file and renames it over the name: a handle opened
    before keeps the old file's bytes (POSIX rename), one opened after reads the new."""
    s = mounted(hostd_settings=HOSTD_READS)
    path = str(s.mnt / "published.bin")
    old, new = pattern("v1", 3 * MiB), pattern("v2", 3 * MiB)
    write_closed(s, path, old)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert pread_aligned(fd, MiB, 0) == old[:MiB]
        with SharedBuffer(len(new)) as buf:
            buf.view()[:] = new
            store_from(path, buf)
        assert pread_aligned(fd, 2 * MiB, MiB) == old[MiB:]
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert pread_aligned(fd, 4 * MiB, 0) == new
    finally:
        os.close(fd)
    served, _ = read_ahead_counts(s)
    assert served >= 3     # 2 MiB of the old file and 2 of the new came from read-ahead
