"""fsync(2) on the mount means the file survives a crash of bluecached (docs/operations.md)."""

import os
import threading
import time

from support import MiB, pattern, wait_serving

GONE = ["lost bluecached", "is not listening", "-> EIO", "not delivered"]


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
    wait_serving(root)
    for i, name in enumerate(names):
        with open(os.path.join(root, name), "rb") as f:
            assert f.read() == pattern(name, 8 * MiB + i), name


def test_requests_right_after_bluecached_dies_wait_for_it(mounted):
    # In the first moments after the daemon's socket goes away hostd gets ECONNREFUSED; the
    # request was never sent, so it waits for the daemon like any other (it was EIO at once).
    s = mounted(allow_log=GONE, hostd_settings={"mount.attr_timeout": "0s",
                                                "mount.entry_timeout": "0s"})
    path = os.path.join(str(s.mnt), "kept.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, pattern("kept", MiB))
        os.fsync(fd)
    finally:
        os.close(fd)
    s.daemon.kill()
    results = []

    def reader():
        try:
            with open(path, "rb") as f:
                results.append(f.read() == pattern("kept", MiB))
        except OSError as e:
            results.append(e)

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.5)
    s.daemon.start()
    t.join(30)
    assert results == [True]
