"""Shared mappings (MAP_SHARED: Python's mmap, numpy.memmap, safetensors) of files on the
mount. hostd answers every open with FOPEN_DIRECT_IO, and of such a file the kernel refuses a
shared mapping with ENODEV unless FUSE_DIRECT_IO_ALLOW_MMAP was negotiated; a handle the
kernel reads by passthrough maps the memfd instead. Both kinds, and a second open of a file
mapped through the page cache (the kernel refuses a passthrough open of that inode then)."""

import contextlib
import mmap
import os

from test_passthrough import _restart_daemon
from test_read_ahead import write_closed

from support import MiB, pattern


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
