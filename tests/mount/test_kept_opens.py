"""Read-only opens answered by hostd alone from a memfd it kept (hostd/kept_backings.py): a
file read before opens with bluecached stopped, a change through the mount is read by the
next open, and hostd lets a kept file go when it leaves DRAM, is removed, or bluecached
restarts."""

import errno
import os
import re
import signal
import threading
import time

import pytest
from test_passthrough import _restart_daemon
from test_read_ahead import CHANGES, pread_aligned, write_closed

from support import MiB, pattern, wait_settled

GONE = ["lost bluecached", "-> EIO"]


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def kept_memfds(s) -> int:
    """How many of bluecached's object memfds hostd holds open (kept, or by open handles)."""
    fds = f"/proc/{s.hostd.proc.pid}/fd"
    n = 0
    for fd in os.listdir(fds):
        try:
            n += os.readlink(f"{fds}/{fd}").startswith("/memfd:bluecache-object")
        except FileNotFoundError:
            pass
    return n


def until(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def released(s) -> bool:
    client = s.daemon.client()
    try:
        return client.call("stats")["open_handles"] == 0
    finally:
        client.close()


def log_after_stop(s) -> str:
    s.hostd.stop(timeout=30)
    return s.hostd.log.read_text()


@pytest.mark.parametrize("kept", [256, 0])
def test_a_file_read_before_opens_while_bluecached_is_stopped(mounted, kept):
    s = mounted(allow_log=GONE, hostd_settings={"daemon.request_timeout": "1s",
                                                "mount.kept_opens": kept})
    data = pattern("kept", 3 * MiB)
    write_closed(s, s.mnt / "read.bin", data)
    write_closed(s, s.mnt / "unread.bin", pattern("unread", MiB))
    assert read(s.mnt / "read.bin") == data   # its memfd comes with this open, and stays
    os.stat(s.mnt / "unread.bin")               # both names known to the kernel
    until(lambda: released(s), "the reader's release")
    s.daemon.proc.send_signal(signal.SIGSTOP)
    try:
        if kept:
            assert read(s.mnt / "read.bin") == data
        else:
            with pytest.raises(OSError) as e:
                read(s.mnt / "read.bin")
            assert e.value.errno == errno.EIO
        with pytest.raises(OSError) as e:   # never read: its open needs bluecached
            read(s.mnt / "unread.bin")
        assert e.value.errno == errno.EIO
    finally:
        s.daemon.proc.send_signal(signal.SIGCONT)
    # bluecached never heard of the kept open in time (its deadline passed): nothing is
    # open there, and hostd let the file go; the next open brings it again
    until(lambda: released(s), "every handle's release at bluecached")
    assert read(s.mnt / "read.bin") == data
    assert read(s.mnt / "read.bin") == data
    log = log_after_stop(s)
    assert ("of them answered by hostd alone: 2" in log) if kept else ("alone" not in log)


@pytest.mark.parametrize("change", CHANGES)
def test_the_open_after_a_change_reads_the_change(mounted, change):
    s = mounted()
    path = str(s.mnt / "changing.bin")
    old, new = os.urandom(4 * MiB), os.urandom(4 * MiB)
    write_closed(s, path, old)
    assert read(path) == old and read(path) == old   # the second answered by hostd
    until(lambda: released(s), "the readers' releases")
    expected = CHANGES[change](path, old, new)
    until(lambda: released(s), "the change's release")
    assert read(path) == expected, f"stale bytes after {change}"
    assert read(path) == expected
    assert "of them answered by hostd alone: " in log_after_stop(s)


def test_an_open_of_a_file_only_on_nvme_is_answered_as_its_lookup_prepared(mounted):
    """hit_path direct (this ext4): the lookup's reply says that the open after it lends
    nothing, and hostd answers that open alone, opening at bluecached right after (the first
    read waits for it). Byte-exact, O_DIRECT and buffered; a write between a lookup and the
    next open is read by that open."""
    s = mounted(allow_log=["lost bluecached"])
    blocks = {f"b{i}.bin": pattern(f"b{i}", 2 * MiB) for i in range(3)}
    for name, data in blocks.items():
        write_closed(s, s.mnt / name, data)
    _restart_daemon(s)   # every file only on NVMe
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2")   # the kernel forgets the names: each open below sends a LOOKUP first
    for i, (name, data) in enumerate(blocks.items()):
        fd = os.open(s.mnt / name, os.O_RDONLY | (os.O_DIRECT if i % 2 == 0 else 0))
        try:
            assert pread_aligned(fd, 3 * MiB, 0) == data
        finally:
            os.close(fd)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2")
    path = s.mnt / "b1.bin"
    os.stat(path)   # a LOOKUP: an open prepared ...
    new = pattern("new", 2 * MiB)
    with open(path, "r+b") as f:   # ... and let go by this write's open
        f.write(new)
    assert read(path) == new
    assert "3 (prepared at the lookup)" in log_after_stop(s)


def test_a_file_that_leaves_dram_is_let_go(mounted):
    s = mounted(**{"tiers.dram.size": "16MiB", "tiers.dram.prefault": "0"})
    data = pattern("first", 4 * MiB)
    write_closed(s, s.mnt / "first.bin", data)
    wait_settled(s.daemon)
    assert read(s.mnt / "first.bin") == data
    until(lambda: released(s), "the reader's release")
    assert kept_memfds(s) == 1
    for i in range(4):   # 16 MiB more through a 16 MiB tier: first.bin is evicted to NVMe
        write_closed(s, s.mnt / f"other{i}.bin", pattern(f"other{i}", 4 * MiB))
        wait_settled(s.daemon)
    until(lambda: kept_memfds(s) == 0, "hostd to let the evicted file's memory go")
    assert read(s.mnt / "first.bin") == data    # a hit on NVMe now, byte-exact


def test_a_removed_file_is_let_go(mounted):
    s = mounted()
    write_closed(s, s.mnt / "gone.bin", pattern("gone", MiB))
    wait_settled(s.daemon)   # evict skips a file its write-behind holds (CI saw removed 0)
    assert read(s.mnt / "gone.bin") == pattern("gone", MiB)
    until(lambda: released(s), "the reader's release")
    assert kept_memfds(s) == 1
    client = s.daemon.client()
    try:
        assert client.call("evict", path="/gone.bin")["removed"] == 1
    finally:
        client.close()
    until(lambda: kept_memfds(s) == 0, "hostd to let the removed file's memory go")
    until(lambda: not (s.mnt / "gone.bin").exists(), "the name to go")   # the next event


def test_a_bluecached_restart_lets_kept_files_go(mounted):
    s = mounted(allow_log=GONE)
    data = pattern("restart", 2 * MiB)
    write_closed(s, s.mnt / "r.bin", data)
    wait_settled(s.daemon)                      # written behind: it survives the kill
    assert read(s.mnt / "r.bin") == data
    until(lambda: released(s), "the reader's release")
    assert kept_memfds(s) == 1
    s.daemon.kill()
    s.daemon.start()
    until(lambda: os.path.exists(s.mnt / "r.bin"), "hostd to reconnect")
    until(lambda: kept_memfds(s) == 0, "hostd to drop the old daemon's memory")
    assert read(s.mnt / "r.bin") == data


def test_readers_racing_replacements_never_get_a_replaced_files_bytes(mounted):
    """vLLM's publish (write a temporary, rename it over the block) while readers reopen the
    block again and again: a kept memfd is the old inode's, so an open after the rename reads
    the new bytes, and every read is one whole version."""
    s = mounted()
    path = s.mnt / "block.bin"
    versions = [pattern(f"v{i}", 2 * MiB) for i in range(12)]
    write_closed(s, path, versions[0])
    published = [0]   # the newest version whose rename has returned
    stop = threading.Event()
    problems = []

    def reader():
        while not stop.is_set():
            floor = published[0]
            got = read(path)
            if got not in versions:
                problems.append("a read mixed versions")
            elif versions.index(got) < floor:
                problems.append(f"version {versions.index(got)} read after {floor} was published")

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for i, data in enumerate(versions[1:], start=1):
            tmp = s.mnt / f"block.bin.{i}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, path)
            published[0] = i
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not problems, problems[:3]
    assert read(path) == versions[-1]
    answered = re.search(r"answered by hostd alone: (\d+)", log_after_stop(s))
    assert answered and int(answered.group(1)) > 0   # the race was with kept opens
