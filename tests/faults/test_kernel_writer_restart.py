"""A writer whose kernel writes bluecached's memfd directly (passthrough) while bluecached is
killed and restarted: its bytes went to memory the new daemon never had, so its close must
fail (EIO) and no name may ever show those bytes as a complete file."""

import errno
import os

import pytest

from support import MiB, pattern, wait_settled

GONE = ["lost bluecached", "-> EIO", "not delivered", "restarted while inode"]


def test_a_kernel_writer_across_a_bluecached_restart_fails_its_close(mounted):
    s = mounted(allow_log=GONE, **{"tiers.dram.size": "256MiB", "tiers.nvme.size": "1GiB"})
    root = str(s.mnt)
    kept = pattern("kept", 4 * MiB)
    with open(os.path.join(root, "kept.bin"), "wb") as f:
        f.write(kept)
    wait_settled(s.daemon)                 # written behind: it survives the kill
    tmp, final = os.path.join(root, "block.tmp"), os.path.join(root, "block.bin")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, pattern("lost", 2 * MiB))
        s.daemon.kill()
        s.daemon.start()                   # hostd reconnects by itself
        os.write(fd, pattern("lost", 2 * MiB))   # the kernel still writes the old memfd
    finally:
        with pytest.raises(OSError) as e:
            os.close(fd)
    assert e.value.errno == errno.EIO
    with pytest.raises(FileNotFoundError):   # llm-d renames after close: the tmp is gone
        os.rename(tmp, final)
    assert not os.path.exists(final)
    with open(os.path.join(root, "kept.bin"), "rb") as f:
        assert f.read() == kept
