"""The filesystem under the NVMe tier is smaller than `tiers.nvme.size`, then filled by someone
else: the daemon fits the tier to it, keeps accepting writes (evicting older objects), logs a
few lines rather than a flood, stops cleanly and starts again."""

import contextlib
import os
import subprocess
import time

import pytest

from connectors import block_name, llmd_read, llmd_write
from support import MiB, pattern, wait_serving, wait_settled

SMALL_FS = 160 * MiB
FULL = ["has room for", "stays in DRAM", "filesystem under the NVMe tier is full",
        "could not write the index snapshot", "O_DIRECT refused", "is not listening",
        "lost with this stop",   # a stop with the disk full: what only DRAM held is named
        "lost bluecached"]


@pytest.fixture
def small_fs(tmp_path):
    path = tmp_path / "small-nvme"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_FS}", "tmpfs", str(path)],
                   check=True)
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def wait_quiet(daemon, timeout: float = 60) -> dict:
    """Stats once nothing moves between tiers any more (dirty bytes may stay: those only DRAM
    can hold while the disk is full)."""
    client = daemon.client()
    try:
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            stats = client.call("stats")
            seen.append((stats["dirty_bytes"], stats["tiers"]["nvme"]["bytes"],
                         stats["tiers"]["dram"]["bytes"]))
            if len(seen) >= 4 and len(set(seen[-4:])) == 1:
                return stats
            time.sleep(0.5)
        raise TimeoutError(f"the cache did not settle: {seen[-4:]}")
    finally:
        client.close()


def present_blocks(root: str, count: int) -> list[int]:
    return [i for i in range(count) if os.path.exists(os.path.join(root, block_name(i)))]


def test_nvme_filesystem_smaller_than_configured_then_filled(mounted, small_fs):
    s = mounted(allow_log=FULL, **{"tiers.dram.size": "64MiB", "tiers.nvme.size": "1GiB",
                                   "tiers.nvme.path": str(small_fs),
                                   "tiers.nvme.segment_size": "256MiB"})
    root = str(s.mnt)
    log = s.daemon.log
    assert "has room for" in log.read_text()              # checked at start, said once
    stats = wait_settled(s.daemon)
    capacity = stats["tiers"]["nvme"]["capacity_bytes"]
    assert 64 * MiB < capacity < SMALL_FS

    for i in range(4):
        assert llmd_write(root, block_name(i), pattern(str(i), 8 * MiB), "w")
    wait_settled(s.daemon)

    # someone else fills the filesystem: write-behind meets ENOSPC
    free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
    ballast = small_fs / "ballast"
    with open(ballast, "wb") as f:
        f.write(b"\0" * max(0, free - 2 * MiB))
    for i in range(4, 60):                # 448 MiB: every write still succeeds
        assert llmd_write(root, block_name(i), pattern(str(i), 8 * MiB), "w")
    stats = wait_quiet(s.daemon)
    assert stats["tiers"]["nvme"]["capacity_bytes"] < capacity   # shrunk to what it holds

    text = log.read_text()
    assert "filesystem under the NVMe tier is full" in text
    noisy = [line for line in text.splitlines() if " WARNING " in line or " ERROR " in line]
    assert len(noisy) < 15, noisy                           # a few lines, not a flood
    present = present_blocks(root, 60)
    assert 59 in present
    for i in present:                                       # a miss or exact bytes
        assert llmd_read(root, block_name(i)) == pattern(str(i), 8 * MiB)

    # SIGTERM persists what it can and exits cleanly; a restart (disk still full) serves
    assert s.daemon.stop() == 0
    assert "Traceback" not in log.read_text()
    s.daemon.start()
    wait_serving(root)
    again = present_blocks(root, 60)
    assert again and set(again) <= set(present)
    for i in again:
        with contextlib.suppress(FileNotFoundError):        # evicted meanwhile: a miss
            assert llmd_read(root, block_name(i)) == pattern(str(i), 8 * MiB)
