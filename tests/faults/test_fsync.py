"""fsync(2) on the mount means the file survives a crash of bluecached (docs/operations.md)."""

import os
import time

from support import MiB, pattern

GONE = ["lost bluecached", "is not listening", "-> EIO"]


def test_fsynced_then_renamed_files_survive_sigkill(mounted):
    s = mounted(allow_log=GONE, **{"tiers.dram.size": "256MiB"})
    root = str(s.mnt)
    names = [f"block{i}.bin" for i in range(8)]
    for i, name in enumerate(names):
        tmp = os.path.join(root, name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, pattern(name, 8 * MiB + i))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(root, name))
    s.daemon.kill()             # at once: write-behind has had no pause to run by itself
    s.daemon.start()
    deadline = time.monotonic() + 30
    while True:                 # hostd reconnects by itself
        try:
            os.listdir(root)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    for i, name in enumerate(names):
        with open(os.path.join(root, name), "rb") as f:
            assert f.read() == pattern(name, 8 * MiB + i), name
