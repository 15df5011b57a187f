"""NVMe hits on a btrfs NVMe tier (tiers.nvme.hit_path auto): the open gets a reflink clone of
the object's extent, the kernel reads it by FUSE passthrough, and btrfs checks each block it
reads against its own crc32c. A real btrfs on a loop device (support.ScratchBtrfs)."""

import errno
import os

import pytest
from test_passthrough import _dram_stats as tier_stats
from test_passthrough import _restart_daemon
from test_read_ahead import pread_aligned, write_closed

MIB = 1 << 20


def _nvme_on(btrfs) -> dict:
    return {"tiers.nvme.path": str(btrfs.path / "nvme"), "tiers.nvme.size": "256MiB"}


def test_an_nvme_hit_on_btrfs_is_read_by_the_kernel_from_a_clone(btrfs, mounted):
    stack = mounted(allow_log=["lost bluecached"], **_nvme_on(btrfs))
    data = os.urandom(6 * MIB)   # whole pages
    write_closed(stack, stack.path("cold.bin"), data)
    _restart_daemon(stack)
    fd = os.open(stack.path("cold.bin"), os.O_RDONLY | os.O_DIRECT)   # as vLLM reads
    try:
        assert pread_aligned(fd, len(data) + MIB, 0) == data
        assert pread_aligned(fd, 2 * MIB, 5 * MIB) == data[5 * MIB:]
    finally:
        os.close(fd)
    nvme = tier_stats(stack)["nvme"]
    assert (nvme["hits"], nvme["clones"], nvme["bytes_out"]) == (1, 1, 0)   # no READ at all
    # The clone is this open's (hostd keeps no clone for later opens): the next open is
    # bluecached's to answer (it promotes the object into DRAM), the bytes the same.
    assert stack.path("cold.bin").read_bytes() == data
    assert tier_stats(stack)["nvme"]["clones"] == 1
    assert stack.path("cold.bin").read_bytes() == data
    stack.hostd.stop(timeout=30)   # no open was answered from a clone kept by hostd
    assert ", of them answered by hostd alone: 0" in stack.hostd.log.read_text()


def test_the_clone_is_started_at_the_lookup_before_an_o_direct_open(btrfs, mounted):
    """vLLM's reader looks each block up and opens it at once: once bluecached saw it open
    O_DIRECT, the clone is made at the lookup (tiers/clone_ahead.py) and the open takes it."""
    stack = mounted(allow_log=["lost bluecached"], **_nvme_on(btrfs))
    blocks = {f"b{i}.bin": os.urandom(2 * MIB) for i in range(3)}
    for name, data in blocks.items():
        write_closed(stack, stack.path(name), data)
    _restart_daemon(stack)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2")   # the kernel forgets the names: each open below sends a LOOKUP first
    for name, data in blocks.items():
        fd = os.open(stack.path(name), os.O_RDONLY | os.O_DIRECT)
        try:
            assert pread_aligned(fd, 3 * MIB, 0) == data
        finally:
            os.close(fd)
    nvme = tier_stats(stack)["nvme"]
    # the first lookup came before bluecached knew how this reader opens
    assert (nvme["clones"], nvme["clones_ahead"], nvme["bytes_out"]) == (3, 2, 0)


def test_buffered_opens_and_odd_sizes_are_read_through_bluecached(btrfs, mounted, engine):
    """A buffered reader would fill a page cache of the clone's own, dropped at its close; a
    clone of a file not of whole pages would show the extent's pad past the end: both are
    read as hit_path direct (which the doca engine serves as stream: it maps no reply memory
    in bluecached)."""
    stack = mounted(allow_log=["lost bluecached"], **_nvme_on(btrfs))
    files = {"odd.bin": (os.urandom(3 * MIB + 100), os.O_DIRECT),
             "buffered.bin": (os.urandom(2 * MIB), 0)}
    for name, (data, _) in files.items():
        write_closed(stack, stack.path(name), data)
    _restart_daemon(stack)
    for name, (data, flags) in files.items():
        fd = os.open(stack.path(name), os.O_RDONLY | flags)
        try:
            assert pread_aligned(fd, 4 * MIB, 0) == data
        finally:
            os.close(fd)
    nvme = tier_stats(stack)["nvme"]
    served = sum(len(data) for data, _ in files.values()) if engine == "loopback" else 0
    assert (nvme["clones"], nvme["bytes_out"]) == (0, served)


@pytest.mark.parametrize("direct", [True, False], ids=["O_DIRECT", "buffered"])
def test_rot_under_a_clone_is_eio_not_wrong_bytes(btrfs, mounted, direct):
    """A byte flipped on the disk beneath btrfs: the reader of the clone gets EIO (btrfs's
    crc32c), never the changed bytes; so does every later open, until the file is written
    again."""
    stack = mounted(allow_log=["lost bluecached", "checksum", "NVMe", "promot", "EIO",
                               "Input/output error"], **_nvme_on(btrfs))
    data = bytearray(os.urandom(4 * MIB))
    marker = bytes(data[MIB:MIB + 4096])
    write_closed(stack, stack.path("rot.bin"), bytes(data))
    _restart_daemon(stack)
    btrfs.rot(marker, 100)
    for _ in range(2):
        fd = os.open(stack.path("rot.bin"), os.O_RDONLY | (os.O_DIRECT if direct else 0))
        got = b""
        try:
            with pytest.raises(OSError) as raised:
                while piece := pread_aligned(fd, len(data), len(got)):   # a reader's loop
                    got += piece
            assert raised.value.errno == errno.EIO
            assert got == data[:len(got)], "changed bytes were handed out"
            assert len(got) <= MIB + 100   # at most the bytes before the bad block
        finally:
            os.close(fd)
