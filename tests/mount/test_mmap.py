"""Shared mappings (MAP_SHARED: Python's mmap, numpy.memmap, safetensors) of files on the
mount. hostd answers every open with FOPEN_DIRECT_IO, and of such a file the kernel refuses a
shared mapping with ENODEV unless FUSE_DIRECT_IO_ALLOW_MMAP was negotiated; a handle the
kernel reads by passthrough maps the memfd instead. Both kinds, and a second open of a file
mapped through the page cache (the kernel refuses a passthrough open of that inode then)."""

import contextlib
import mmap
import os
import time

import pytest
from test_passthrough import _restart_daemon
from test_read_ahead import write_closed

from support import MiB, pattern, wait_settled


@contextlib.contextmanager
def _mapped(path, size: int, access=mmap.ACCESS_READ, flags=os.O_RDONLY):
    """A shared mapping (MAP_SHARED) of `size` bytes of `path`, unmapped and closed after."""
    fd = os.open(path, flags)
    try:
        with mmap.mmap(fd, size, access=access) as m:
            yield m
    finally:
        os.close(fd)


def test_a_file_read_through_hostd_maps_shared(mounted):
    s = mounted(hostd_settings={"mount.passthrough": False})
    data = pattern("mapped", 3 * MiB + 5)
    write_closed(s, s.path("mapped.bin"), data)
    with _mapped(s.path("mapped.bin"), len(data)) as m:
        assert m[:] == data
    log = s.hostd.log.read_text()
    assert "shared mmap allowed" in log


def test_a_file_read_by_passthrough_maps_its_memfd(mounted):
    s = mounted()
    data = pattern("dram", 2 * MiB)
    write_closed(s, s.path("dram.bin"), data)
    with _mapped(s.path("dram.bin"), len(data)) as m:
        assert m[:] == data


def test_opens_beside_a_mapping_through_the_page_cache_are_served(mounted):
    """The first open after a restart reads the file from NVMe through hostd (no memfd): its
    mapping puts the inode in the kernel's caching io mode. The opens after it, which would
    be passthrough opens of the file now in DRAM, must not fail (the kernel answers EIO to a
    passthrough open of such an inode)."""
    s = mounted(allow_log=["lost bluecached"])
    data = pattern("cold", 4 * MiB + 4097)
    write_closed(s, s.path("cold.bin"), data)
    _restart_daemon(s)
    with _mapped(s.path("cold.bin"), len(data)) as m:
        assert m[:] == data
        for _ in range(3):   # the file comes into DRAM meanwhile
            assert s.path("cold.bin").read_bytes() == data
        assert m[:MiB] == data[:MiB]
    assert s.path("cold.bin").read_bytes() == data   # and after the mapping went


def test_a_shared_writable_mapping_is_written_back_to_the_cache(mounted):
    s = mounted(allow_log=["lost bluecached"], hostd_settings={"mount.passthrough": False})
    data = pattern("before", 2 * MiB)
    write_closed(s, s.path("rw.bin"), data)
    patch = pattern("patch", 8192)
    with _mapped(s.path("rw.bin"), len(data), access=mmap.ACCESS_WRITE, flags=os.O_RDWR) as m:
        m[MiB:MiB + len(patch)] = patch
        m.flush()   # msync: the dirty pages go to hostd as WRITEs
    expected = data[:MiB] + patch + data[MiB + len(patch):]
    _restart_daemon(s)   # read back what bluecached holds (hostd drops the kernel's pages)
    with open(s.path("rw.bin"), "rb") as f:
        assert f.read() == expected


@pytest.mark.parametrize("how", ["a new file's second writer", "a writer beside a reader"])
def test_bytes_mapped_into_a_hole_read_back_and_persist(mounted, how):
    """A write open of an inode the kernel reads by passthrough shares the inode's backing
    (the memfd): its mapping maps the memfd itself. Beside a new file's first writer (its
    handle is the backing) or beside a reader; what it writes there into a hole (a chunk
    bluecached had not counted, or past the chunks of a file truncated up) reads back
    through hostd and is written behind, not read as zeros (found by a probe)."""
    s = mounted(allow_log=["lost bluecached"])
    path = s.path("holes.bin")
    tail, patch = pattern("tail", MiB + 3), pattern("patch", 8011)
    expected = bytearray(2 * MiB + 3)
    first = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    if how == "a writer beside a reader":
        os.ftruncate(first, len(expected))          # all holes
        os.close(first)
        first = os.open(path, os.O_RDONLY)          # passthrough: the inode's backing
        assert os.pread(first, 10, 0) == bytes(10)
    second = os.open(path, os.O_RDWR)
    if how == "a new file's second writer":
        os.close(first)
        first = None
        os.pwrite(second, tail, MiB)                 # the first chunk stays a hole
        expected[MiB:] = tail
    expected[6431:6431 + len(patch)] = patch
    try:
        with mmap.mmap(second, len(expected)) as m:
            m[6431:6431 + len(patch)] = patch
            m.flush()
        reader = os.open(path, os.O_RDWR)            # a write open: read through hostd
        try:
            assert os.pread(reader, 20000, 0) == bytes(expected[:20000])
        finally:
            os.close(reader)
    finally:
        os.close(second)
        if first is not None:
            os.close(first)
    _restart_daemon(s)
    assert path.read_bytes() == expected


@pytest.mark.parametrize("who", ["beside a reader", "its own writer after an fsync"])
def test_a_persisted_file_written_through_a_mapping_keeps_the_bytes(mounted, who):
    """A write handle of an inode with a passthrough backing maps the memfd itself: nothing
    tells bluecached of the bytes written there, and its persisted copy no longer matches.
    At that handle's release the copy is checked and written behind again (found by a probe:
    the NVMe copy came back after a restart)."""
    s = mounted(allow_log=["lost bluecached"])
    path = s.path("mapped.bin")
    data, patch = pattern("persisted", 3 * MiB), pattern("patch", 100_000)
    expected = data[:MiB] + patch + data[MiB + len(patch):]
    if who == "beside a reader":
        write_closed(s, path, data)
        wait_settled(s.daemon)
        reader = os.open(path, os.O_RDONLY)          # passthrough: the inode's backing
        try:
            assert os.pread(reader, 10, 0) == data[:10]
            with _mapped(path, len(data), access=mmap.ACCESS_WRITE, flags=os.O_RDWR) as m:
                m[MiB:MiB + len(patch)] = patch
                m.flush()
        finally:
            os.close(reader)
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(fd, data, 0)
            with mmap.mmap(fd, len(data)) as m:
                m[:10] = data[:10]                   # the pages mapped writable now
                os.fsync(fd)                         # persisted as it stands
                m[MiB:MiB + len(patch)] = patch      # no fault, no mtime: nothing shows it
                m.flush()
        finally:
            os.close(fd)
    for _ in range(500):
        if "written through a shared mapping" in s.daemon.log_text():
            break
        time.sleep(0.01)
    else:
        pytest.fail("bluecached never took in the bytes written through the mapping")
    wait_settled(s.daemon)
    _restart_daemon(s)
    assert path.read_bytes() == expected
