"""A file larger than an NVMe segment can never be written behind (an object is one extent
inside a segment). Any user who can write to the mount can try: the write or truncate must
fail with EFBIG, and the daemon must stay up with everything it held."""

import errno
import os
import subprocess
import sys
import time

import pytest

from connectors import block_name, llmd_read, llmd_write
from support import AS_NOBODY, MiB, let_others_reach, pattern, wait_settled

# Runs as user nobody: the op, then prints the errno it got (0: it succeeded).
_AS_NOBODY = r"""
import errno, os, sys
op, path, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    if op == "write":
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            chunk = b"x" * (1 << 20)
            for _ in range(size >> 20):
                os.write(fd, chunk)
        finally:
            os.close(fd)
    else:
        open(path, "wb").close()
        os.truncate(path, size)
    print(0)
except OSError as e:
    print(e.errno)
"""


def as_nobody(op: str, path: str, size: int) -> int:
    out = subprocess.run([*AS_NOBODY, sys.executable, "-c", _AS_NOBODY, op, path, str(size)],
                         capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.strip())


def test_a_file_larger_than_a_segment_is_refused_and_the_daemon_lives(mounted):
    s = mounted(allow_log=["failed after it was answered", "lost bluecached"],
                **{"tiers.dram.size": "256MiB", "tiers.nvme.size": "256MiB",
                   "tiers.nvme.segment_size": "64MiB"})
    root = str(s.mnt)
    assert llmd_write(root, block_name(0), pattern("kept", 8 * MiB), "w")
    wait_settled(s.daemon)
    assert llmd_write(root, block_name(1), pattern("dram", 8 * MiB), "w")  # only in DRAM yet
    let_others_reach(root)
    os.chmod(root, 0o777)
    big = os.path.join(root, "big.bin")

    # a plain 100 MiB write: EFBIG from write(2) (or from close(2), had it been answered early)
    assert as_nobody("write", big, 100 * MiB) == errno.EFBIG
    # growing by truncate past a segment (`truncate -s 17G` with the default 16 GiB segments)
    assert as_nobody("truncate", os.path.join(root, "sparse.bin"), 65 * MiB) == errno.EFBIG

    assert s.daemon.proc.poll() is None, "bluecached died"
    assert not os.path.exists(big) or os.path.getsize(big) <= 64 * MiB
    # exactly one segment is still a legal size
    assert as_nobody("truncate", os.path.join(root, "edge.bin"), 64 * MiB) == 0
    stats = wait_settled(s.daemon)
    assert stats["dirty_bytes"] == 0
    assert llmd_read(root, block_name(0)) == pattern("kept", 8 * MiB)
    assert llmd_read(root, block_name(1)) == pattern("dram", 8 * MiB)

    # and what DRAM held survives a restart: it was written behind, not lost with the daemon
    s.daemon.stop()
    s.daemon.start()
    assert wait_settled(s.daemon)["tiers"]["nvme"]["objects"] >= 3


def test_a_sparse_write_far_past_a_files_limit_stops_its_writer_and_the_daemon_lives(mounted):
    """A writer's kernel writes the object's memfd directly: one pwrite at 1 PiB made it that
    large at once, and bluecached ended on the chunk list (MemoryError; stress-ng's fsize
    stressor). Now the writer is stopped and its close says why."""
    s = mounted(**{"tiers.dram.size": "64MiB", "tiers.nvme.size": "256MiB",
                   "tiers.nvme.segment_size": "64MiB"})
    root = str(s.mnt)
    assert llmd_write(root, block_name(0), pattern("kept", 8 * MiB), "w")
    path = os.path.join(root, "sparse.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"x", 1 << 50)   # the kernel's write: sparse, taken at once
        deadline = time.monotonic() + 30
        while os.path.exists(path):    # stopped within the watch's interval: its name goes
            assert time.monotonic() < deadline, "the writer was not stopped"
            time.sleep(0.01)
        with pytest.raises(OSError) as e:
            os.pwrite(fd, b"x", 1 << 51)
        assert e.value.errno == errno.EPERM   # the memfd is sealed against growth
    finally:
        with pytest.raises(OSError) as e:
            os.close(fd)
    assert e.value.errno == errno.EFBIG
    assert s.daemon.proc.poll() is None, "bluecached died"
    assert llmd_read(root, block_name(0)) == pattern("kept", 8 * MiB)
