"""More written than the cache holds: writes keep succeeding, evicted files vanish from the
mount (the kernel's caches are invalidated), present files read back exactly."""

import errno
import os
import time

from connectors import block_name, llmd_read, llmd_write
from support import MiB, pattern, wait_settled


def test_eviction_through_the_mount(mounted):
    s = mounted(allow_log=[], **{"tiers.dram.size": "32MiB", "tiers.nvme.size": "96MiB",
                                 "tiers.nvme.segment_size": "32MiB",
                                 "tiers.nvme.high_watermark": 0.9,
                                 "tiers.nvme.low_watermark": 0.6})
    root = str(s.mnt)
    written = []
    for i in range(40):                              # 320 MiB through 32 + 96 MiB
        rel = block_name(i)
        assert llmd_write(root, rel, pattern(str(i), 8 * MiB), "w")
        written.append(rel)
        assert os.path.exists(os.path.join(root, rel))  # the kernel saw it
    wait_settled(s.daemon)                           # write-behind and eviction finish
    present = [r for r in written if os.path.exists(os.path.join(root, r))]
    gone = [r for r in written if r not in present]
    assert gone and present
    assert written[-1] in present
    for rel in present:
        assert llmd_read(root, rel) == pattern(str(written.index(rel)), 8 * MiB)
    for rel in gone:                                  # a miss, never stale bytes
        try:
            llmd_read(root, rel)
            raise AssertionError(f"{rel} was evicted but still readable")
        except FileNotFoundError:
            pass
    st = os.statvfs(root)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    assert st.f_blocks * st.f_frsize == 96 * MiB
    assert 8 * MiB * len(present) - MiB <= used <= 96 * MiB


def test_a_name_evicted_just_now_is_written_anew_by_an_o_creat_open(mounted):
    # The eviction's invalidation reaches the kernel a moment after `evict` answers; an open
    # in that moment opens the removed inode, and bluecached answers ESTALE so the kernel
    # looks the name up again and creates the file. Before: ENOENT for a non-empty file, and
    # for an empty one the write "succeeded" into a file with no name (found by a probe).
    s = mounted()
    path = os.path.join(str(s.mnt), "again.bin")
    client = s.daemon.client()
    try:
        _evict_and_create_again(s, path, client)
    finally:
        client.close()


def _evict_and_create_again(s, path, client):
    rounds = [(size, flags) for size in (0, 5000)
              for flags in (os.O_WRONLY | os.O_CREAT, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)]
    for i, (size, flags) in enumerate(rounds * 5):
        with open(path, "wb") as f:
            f.write(b"old" * size)
        os.stat(path)                                     # the kernel holds the name
        for _ in range(200):   # skipped while its close or write-behind still holds it
            if client.call("evict", path="/again.bin")["removed"]:
                break
            time.sleep(0.01)
        else:
            raise AssertionError("again.bin stayed busy")
        new = pattern(str(i), 4096)
        fd = os.open(path, flags, 0o644)
        try:
            os.write(fd, new)
        finally:
            os.close(fd)
        assert os.listdir(str(s.mnt)) == ["again.bin"], (i, size, flags)
        with open(path, "rb") as f:
            assert f.read() == new, (i, size, flags)


def test_statfs_tracks_usage_and_atime_moves_on_read(mounted):
    s = mounted(hostd_settings={"mount.attr_timeout": "0s"})
    root = str(s.mnt)
    before = os.statvfs(root)
    assert before.f_files > before.f_ffree                  # df -i: used is never negative
    path = os.path.join(root, "a.bin")
    with open(path, "wb") as f:
        f.write(pattern("a", 4 * MiB))
    after = os.statvfs(root)
    assert (before.f_bfree - after.f_bfree) * after.f_frsize == 4 * MiB
    assert before.f_ffree - after.f_ffree == 1 and after.f_files == before.f_files
    atime = os.stat(path).st_atime_ns
    time.sleep(0.05)
    with open(path, "rb") as f:
        f.read(100)
    assert os.stat(path).st_atime_ns > atime           # the file system keeps atime itself
    os.unlink(path)
    # Space comes back once the kernel lets go of the inode (RELEASE, FORGET): soon, not
    # necessarily before unlink(2) returns.
    deadline = time.monotonic() + 10
    while os.statvfs(root).f_bfree != before.f_bfree and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.statvfs(root).f_bfree == before.f_bfree


def test_a_write_that_fails_after_it_was_answered_is_reported_at_close_and_drops_the_file(
        mounted):
    # Writes are answered once staged (mount.write_ack: staged). With DRAM held by an open
    # file and no NVMe to evict to, the daemon refuses the second file's bytes (ENOSPC) after
    # hostd answered them: the writer must hear of it by close, and the name must not show.
    s = mounted(allow_log=["failed after it was answered", "no room"],
                **{"tiers.dram.size": "8MiB", "tiers.nvme.size": 0})
    root = str(s.mnt)
    held = os.open(os.path.join(root, "held"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(held, pattern("held", 6 * MiB))
        fd = os.open(os.path.join(root, "late.tmp"), os.O_WRONLY | os.O_CREAT, 0o644)
        errors = []
        try:
            os.write(fd, pattern("late", 6 * MiB))
        except OSError as e:
            errors.append(e.errno)
        try:
            os.rename(os.path.join(root, "late.tmp"), os.path.join(root, "late"))
        except OSError as e:
            errors.append(e.errno)
        try:
            os.close(fd)
        except OSError as e:
            errors.append(e.errno)
        # the write (if it came back before the writer's next call) or the close says why; the
        # rename finds the file already dropped
        assert errno.ENOSPC in errors and set(errors) <= {errno.ENOSPC, errno.ENOENT}, errors
        # never partial bytes under a name. Where the writer's kernel wrote the memfd itself
        # (passthrough), bluecached removed the file and the kernel hears of it from hostd
        # after the fact (an entry invalidation): its cached entry may answer a moment longer.
        deadline = time.monotonic() + 30
        while (os.path.exists(os.path.join(root, "late"))
               or os.path.exists(os.path.join(root, "late.tmp"))):
            assert time.monotonic() < deadline, "the refused file kept a name"
            time.sleep(0.05)
    finally:
        os.close(held)
    with open(os.path.join(root, "held"), "rb") as f:
        assert f.read() == pattern("held", 6 * MiB)
