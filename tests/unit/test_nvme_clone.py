"""Reflink clones of NVMe extents (bluecached/tiers/nvme_clone.py) on a real btrfs and on the
test machine's own filesystem, which checks no data."""

import mmap
import os
import subprocess

import pytest

from bluecached.tiers import nvme_clone
from bluecached.tiers.nvme import Extent, SegmentStore

MIB = 1 << 20


def aligned(data: bytes) -> memoryview:
    """`data` in page-aligned memory, as O_DIRECT wants it."""
    buf = mmap.mmap(-1, len(data))
    buf[:] = data
    return memoryview(buf)


def test_only_a_filesystem_that_checks_its_data_allows_clones(tmp_path, btrfs):
    assert "not btrfs" in nvme_clone.unchecked_reason(tmp_path)
    assert nvme_clone.unchecked_reason(btrfs.path) is None
    nocow = btrfs.path / "nocow"
    nocow.mkdir()
    subprocess.run(["chattr", "+C", str(nocow)], check=True)   # new files: no checksums
    assert "nodatacow" in nvme_clone.unchecked_reason(nocow)


def test_a_btrfs_mounted_without_data_checksums_allows_no_clones(tmp_path, btrfs):
    """Seen through a mount point whose name mountinfo escapes (a space: \\040)."""
    spaced = tmp_path / "a b"
    spaced.mkdir()
    subprocess.run(["mount", "--bind", str(btrfs.path), str(spaced)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,nodatasum", str(btrfs.path)], check=True)
        assert "nodatasum" in nvme_clone.unchecked_reason(spaced)
    finally:
        subprocess.run(["umount", str(spaced)], check=True)


def test_a_clone_keeps_the_bytes_it_was_made_with(btrfs):
    store = SegmentStore(btrfs.path / "nvme", 64 * MIB, 16 * MIB)
    try:
        extent = store.allocate(2 * MIB)
        first = os.urandom(2 * MIB)
        store.write(extent, [aligned(first)], len(first))
        fd = store.clone(Extent(extent.offset, extent.length), 2 * MIB)
        try:
            store.write(extent, [aligned(os.urandom(2 * MIB))], 2 * MIB)   # reused in place
            assert os.fstat(fd).st_size == 2 * MIB
            assert os.pread(fd, 3 * MIB, 0) == first
            with pytest.raises(OSError):   # read-only: nothing through it lands anywhere
                os.pwrite(fd, b"x", 0)
        finally:
            os.close(fd)
        with pytest.raises(ValueError, match="whole pages"):
            store.clone(extent, 2 * MIB - 1)   # the pad after the object would show
    finally:
        store.close()


def test_no_clone_where_the_filesystem_has_no_reflinks(tmp_path):
    store = SegmentStore(tmp_path / "nvme", 64 * MIB, 16 * MIB)
    try:
        extent = store.allocate(MIB)
        store.write(extent, [aligned(bytes(MIB))], MIB)
        with pytest.raises(OSError):
            store.clone(extent, MIB)
    finally:
        store.close()
