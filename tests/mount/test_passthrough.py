"""FUSE passthrough against the real kernel: fusefs.Operations over the in-memory cache, whose
files have memfd backings, mounted through the fuse shim (memory_mount.py). Reads of an open
file go to the memfd inside the kernel: the cache is asked for no READ at all."""

import errno
import json
import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_read_ahead import CHANGES, pread_aligned, write_closed

from support import pattern, pmd_mapped_kib

HERE = Path(__file__).resolve().parent
MIB = 1 << 20


class MemoryMount:
    def __init__(self, tmp_path: Path, *args: str):
        self.path = tmp_path / "mnt"
        self.path.mkdir(parents=True)
        self.stats_file = tmp_path / "stats.json"
        self.log = open(tmp_path / "mount.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "memory_mount.py"), str(self.path),
             str(self.stats_file), *args], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not (self.stats_file.exists() and os.path.ismount(self.path)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                pytest.fail(f"the memory mount did not come up: {self.log.read()}")
            time.sleep(0.05)

    def stats(self) -> dict:
        self.stats_file.unlink()
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not self.stats_file.exists():
            assert time.monotonic() < deadline, "no stats from the memory mount"
            time.sleep(0.02)
        return json.loads(self.stats_file.read_text())

    def stats_once(self, settled) -> dict:
        """The stats once `settled(stats)` holds (or the last ones, after 5 s): the kernel
        sends RELEASE after close(2) has returned."""
        deadline = time.monotonic() + 5
        while not settled(s := self.stats()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return s

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if os.path.ismount(self.path):
            subprocess.run(["umount", "-l", str(self.path)], check=False)
        self.log.close()


@pytest.fixture
def memory_mount(tmp_path):
    mounts = []

    def make(*args: str) -> MemoryMount:
        m = MemoryMount(tmp_path / f"m{len(mounts)}", *args)
        mounts.append(m)
        return m

    yield make
    for m in mounts:
        m.stop()


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _read_all(fd: int, piece: int = MIB) -> bytes:
    out = bytearray()
    while chunk := os.read(fd, piece):
        out += chunk
    return bytes(out)


def test_passthrough_is_negotiated(memory_mount):
    s = memory_mount().stats()
    assert s["passthrough"] == 1
    assert s["kernel_minor"] >= 41   # FUSE_PASSTHROUGH came with 7.40/7.41 (kernel 6.9)


def test_opens_answered_with_an_error_leave_passthrough_working(memory_mount):
    """The shim notes each OPEN until its reply; an error reply (the header alone) must
    take it off the list too. Left there, 1024 failed opens filled the list, and from then
    on no open was given its backing."""
    m = memory_mount()
    data = os.urandom(MIB)
    _write(m.path / "block", data)
    _write(m.path / "refused", b"x")
    os.chmod(m.path / "refused", 0)
    for _ in range(1100):
        with pytest.raises(PermissionError):
            os.open(m.path / "refused", os.O_RDONLY)
    before = m.stats()["replies"]
    fd = os.open(m.path / "block", os.O_RDONLY)
    try:
        assert _read_all(fd) == data
    finally:
        os.close(fd)
    assert m.stats()["replies"] == before + 1   # this open was given its backing


def test_reads_of_an_open_file_never_reach_the_cache(memory_mount):
    m = memory_mount()
    data = os.urandom(8 * MIB + 12345)
    _write(m.path / "block", data)
    flushes = m.stats()["flushes"]
    fd = os.open(m.path / "block", os.O_RDONLY)
    try:
        assert _read_all(fd) == data                         # read(2)
        assert os.pread(fd, 100, 4 * MIB - 50) == data[4 * MIB - 50:4 * MIB + 50]
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mapped:   # mmap: the backing file's
            assert mapped[:] == data
    finally:
        os.close(fd)
    fd = os.open(m.path / "block", os.O_RDONLY | os.O_DIRECT)   # O_DIRECT on a memfd backing
    try:
        buf = mmap.mmap(-1, 9 * MIB)   # page-aligned
        assert os.preadv(fd, [buf], 0) == len(data)
        assert buf[:len(data)] == data
    finally:
        os.close(fd)
    s = m.stats()
    assert s["reads"] == 0
    assert s["replies"] == 2 and s["served"] == 2
    assert s["flushes"] == flushes   # FOPEN_NOFLUSH: close(2) of a read-only handle asks nothing


def test_release_closes_the_backing_id(memory_mount):
    m = memory_mount()
    _write(m.path / "a", b"a" * 5000)
    _write(m.path / "b", b"b" * 5000)
    fds = [os.open(m.path / name, os.O_RDONLY) for name in ("a", "a", "b")]
    s = m.stats()
    assert s["backings_opened"] == 2 and s["inodes_backed"] == 2 and s["backings_closed"] == 0
    for fd in fds:
        os.close(fd)
    s = m.stats_once(lambda s: s["backings_closed"] == 2)
    assert s["backings_closed"] == 2 and s["inodes_backed"] == 0
    with open(m.path / "a", "rb") as f:   # and a new open gets a new one
        assert f.read() == b"a" * 5000
    assert m.stats_once(lambda s: s["backings_closed"] == 3)["backings_opened"] == 3


def test_a_write_open_beside_a_passthrough_read(memory_mount):
    """The kernel fails an open without FOPEN_PASSTHROUGH of an inode open in passthrough mode
    (EIO); the write open names the inode's backing with FOPEN_DIRECT_IO kept, so its writes
    reach the cache, which changes the memfd in place: the reader sees them, as on tmpfs."""
    m = memory_mount()
    _write(m.path / "f", b"old bytes")
    reader = os.open(m.path / "f", os.O_RDONLY)
    try:
        writer = os.open(m.path / "f", os.O_WRONLY)
        try:
            assert os.pwrite(writer, b"new", 0) == 3
        finally:
            os.close(writer)
        assert os.pread(reader, 100, 0) == b"new bytes"
        with open(m.path / "f", "r+b") as f:   # O_RDWR too
            f.write(b"NEW")
        assert os.pread(reader, 100, 0) == b"NEW bytes"
    finally:
        os.close(reader)
    assert (m.path / "f").read_bytes() == b"NEW bytes"
    s = m.stats_once(lambda s: s["inodes_backed"] == 0)
    assert s["reads"] == 0 and s["inodes_backed"] == 0


def test_a_read_while_the_file_is_being_written_reaches_the_cache(memory_mount):
    m = memory_mount()
    with open(m.path / "f", "wb") as writer:
        writer.write(b"partial")
        writer.flush()
        assert (m.path / "f").read_bytes() == b"partial"
    s = m.stats()
    assert s["reads"] >= 1 and s["replies"] == 0


def test_without_passthrough_reads_reach_the_cache(memory_mount):
    m = memory_mount("--no-passthrough")
    data = os.urandom(3 * MIB)
    _write(m.path / "f", data)
    assert (m.path / "f").read_bytes() == data
    s = m.stats()
    assert s["passthrough"] == 0 and s["replies"] == 0 and s["backing_calls"] == 0
    assert s["reads"] >= 3


def test_only_a_writers_close_sends_flush(memory_mount):
    """FOPEN_NOFLUSH on every open for reading only, served by the daemon (no passthrough,
    as an NVMe hit is) or not: its close(2) waits for no round trip. A writer's close, and
    an open for reading that truncates, still flush."""
    m = memory_mount("--no-passthrough")
    data = os.urandom(MIB)
    flushes = m.stats()["flushes"]
    _write(m.path / "f", data)
    assert m.stats()["flushes"] == flushes + 1
    for flags in (os.O_RDONLY, os.O_RDONLY | os.O_DIRECT):
        fd = os.open(m.path / "f", flags)
        try:
            buf = mmap.mmap(-1, MIB)
            assert os.preadv(fd, [buf], 0) == MIB and buf[:] == data
        finally:
            os.close(fd)
    assert m.stats()["flushes"] == flushes + 1
    os.close(os.open(m.path / "f", os.O_RDWR))
    os.close(os.open(m.path / "f", os.O_RDONLY | os.O_TRUNC))
    assert m.stats()["flushes"] == flushes + 3


def test_max_pages_is_what_the_kernel_splits_reads_by(memory_mount):
    """max_pages 128 (under the kernel's max_pages_limit, so no sysctl to raise): a 4 MiB
    direct read reaches the cache as 512 KiB requests."""
    m = memory_mount("--no-passthrough", "--max-pages", "128")
    data = os.urandom(4 * MIB)
    _write(m.path / "f", data)
    before = m.stats()
    assert before["max_pages"] == 128
    fd = os.open(m.path / "f", os.O_RDONLY)
    try:
        buf = mmap.mmap(-1, 4 * MIB)
        assert os.preadv(fd, [buf], 0) == 4 * MIB and buf[:] == data
    finally:
        os.close(fd)
    assert m.stats()["reads"] - before["reads"] == 8


# -- end to end: bluecached hands hostd the object's memfd ----------------------------------

def _hostd_log_after_stop(stack) -> str:
    stack.hostd.stop(timeout=30)
    return stack.hostd.log.read_text()


def test_hostd_serves_a_cached_file_by_passthrough(mounted):
    stack = mounted()
    data = os.urandom(4 * MIB + 100)
    # The kernel sends the writer's RELEASE after close(2) returns: an open before it reaches
    # bluecached finds the file still open for writing, and hostd serves that one itself.
    write_closed(stack, stack.path("block"), data)
    for _ in range(2):
        assert stack.path("block").read_bytes() == data
    log = _hostd_log_after_stop(stack)
    assert "passthrough on" in log
    assert "opens served by passthrough: 2, read-only opens served by hostd: 0" in log


def test_hostd_without_passthrough_serves_reads_itself(mounted):
    stack = mounted(hostd_settings={"mount.passthrough": False})
    data = os.urandom(2 * MIB)
    _write(stack.path("block"), data)
    assert stack.path("block").read_bytes() == data
    log = _hostd_log_after_stop(stack)   # the kernel had the bytes from hostd alone
    assert "passthrough on" not in log and "opens served by passthrough" not in log


@pytest.mark.parametrize("change", CHANGES)
def test_a_passthrough_reader_sees_a_change_made_through_hostd(mounted, change):
    """The changes test_read_ahead.py makes under hostd's read-ahead, here under a reader
    the kernel serves from the memfd: bluecached changes the memfd in place."""
    stack = mounted()
    path = str(stack.path("changing.bin"))
    old, new = os.urandom(4 * MIB), os.urandom(4 * MIB)
    write_closed(stack, path, old)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert pread_aligned(fd, MIB, 0) == old[:MIB]
        expected = CHANGES[change](path, old, new)
        rest = b""
        while chunk := pread_aligned(fd, MIB, MIB + len(rest)):
            rest += chunk
        assert rest == expected[MIB:], f"stale bytes after {change}"
    finally:
        os.close(fd)
    assert "opens served by passthrough: 1," in _hostd_log_after_stop(stack)


@pytest.mark.parametrize("reader", ["a passthrough reader", "the kernel writer"])
def test_a_write_through_hostd_is_seen_by_the_kernels_reads_before_its_close(mounted, reader):
    """A write open of an inode the kernel reads by passthrough is served by hostd. Answered
    once staged (write_ack: staged, the default), its bytes reached the memfd after write(2)
    returned, and a read by passthrough in between read what was there before (found by a
    probe). Such a handle's writes are answered once stored."""
    stack = mounted()
    path = str(stack.path("seen.bin"))
    for i in range(10):
        if reader == "a passthrough reader":
            write_closed(stack, path, b"\0" * (2 * MIB))
            first = os.open(path, os.O_RDONLY)
            assert os.pread(first, 10, 0) == b"\0" * 10
        else:
            first = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            second = os.open(path, os.O_RDWR)
            try:
                new = pattern(str(i), 4096)
                os.pwrite(second, new, 91425)
                assert os.pread(first, 4096, 91425) == new, i
            finally:
                os.close(second)
        finally:
            os.close(first)


def _restart_daemon(stack) -> None:
    """SIGTERM (everything written behind to NVMe), started again: every file is on NVMe
    only; hostd reconnects by itself (its requests wait)."""
    assert stack.daemon.stop() == 0
    stack.daemon.start()


def _dram_stats(stack) -> dict:
    client = stack.daemon.client()
    try:
        return client.call("stats")["tiers"]
    finally:
        client.close()


@pytest.mark.parametrize("hit_path", ["direct", "stream", "promote"])
def test_an_nvme_hit_then_dram_hits_by_passthrough(mounted, engine, hit_path):
    """tiers.nvme.hit_path: direct reads a first hit from the disk into hostd's replies (no
    DRAM taken) and the next open brings it into DRAM; stream brings it in at the first open,
    served through hostd as it comes; promote brings it in whole before the open is answered
    and that open reads it by passthrough. Then every open reads DRAM by passthrough. (The
    doca engine maps no reply memory in bluecached's process: direct works as stream there.)"""
    stack = mounted(allow_log=["lost bluecached"], **{"tiers.nvme.hit_path": hit_path})
    data = os.urandom(6 * MIB + 4097)
    write_closed(stack, stack.path("cold.bin"), data)
    _restart_daemon(stack)
    fd = os.open(stack.path("cold.bin"), os.O_RDONLY)
    try:   # into page-aligned memory, as the connectors read: whole requests
        assert pread_aligned(fd, len(data) + 1, 0) == data
    finally:
        os.close(fd)
    tiers = _dram_stats(stack)
    if engine == "doca" and hit_path == "direct":
        hit_path = "stream"
    via_hostd = {"direct": 2, "stream": 1, "promote": 0}[hit_path]
    assert tiers["nvme"]["hits"] == 1
    assert tiers["dram"]["misses"] == (0 if hit_path == "direct" else 1)
    assert tiers["nvme"]["bytes_out"] == (len(data) if hit_path == "direct" else 0)
    for _ in range(via_hostd):   # the open that promotes reads through hostd too
        assert stack.path("cold.bin").read_bytes() == data
    deadline = time.monotonic() + 30
    while _dram_stats(stack)["dram"]["objects"] != 1:   # a streaming promotion ends
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert stack.path("cold.bin").read_bytes() == data
    assert _dram_stats(stack)["dram"]["misses"] == 1      # brought into DRAM once
    log = _hostd_log_after_stop(stack)
    opens = 2 + via_hostd
    assert (f"opens served by passthrough: {opens - via_hostd}, read-only opens served by "
            f"hostd: {via_hostd}") in log


def _all_released(stack) -> None:
    """Once the kernel's RELEASEs (sent after close(2) returns) have all reached bluecached."""
    client = stack.daemon.client()
    try:
        deadline = time.monotonic() + 30
        while client.call("stats")["open_handles"]:
            assert time.monotonic() < deadline, "a handle was never released"
            time.sleep(0.01)
    finally:
        client.close()


def _daemon_size(stack, name: bytes) -> int:
    client = stack.daemon.client()
    try:
        return client.call("lookup", parent=1, name=name)["size"]
    finally:
        client.close()


def test_a_new_file_is_written_by_the_kernel_into_the_memfd(mounted):
    """The llm-d store (create, write, close, rename) with the writer's kernel writing the
    object's memfd itself: bluecached sees the size wherever it looks (here a lookup while
    the file is open), the bytes read back, and are written behind to NVMe intact."""
    stack = mounted(allow_log=["lost bluecached"])
    data = os.urandom(4 * MIB + 100)
    with open(stack.path("block.tmp"), "wb") as f:
        f.write(data[:MIB + 5])
        f.flush()
        assert _daemon_size(stack, b"block.tmp") == MIB + 5
        f.write(data[MIB + 5:])
    assert _daemon_size(stack, b"block.tmp") == len(data)   # taken in at the FLUSH
    os.rename(stack.path("block.tmp"), stack.path("block"))
    assert stack.path("block").read_bytes() == data
    _all_released(stack)
    _restart_daemon(stack)   # written behind, then read back from NVMe with its CRCs
    assert stack.path("block").read_bytes() == data
    log = _hostd_log_after_stop(stack)
    assert "write opens written by the kernel: 1" in log


def _pmd_mapped_kib_of_object(stack, size: int) -> int:
    """pmd_mapped_kib of bluecached's one object memfd of that size."""
    fds = f"/proc/{stack.daemon.proc.pid}/fd"
    found = {os.stat(f"{fds}/{fd}").st_ino: f"{fds}/{fd}" for fd in os.listdir(fds)
             if os.readlink(f"{fds}/{fd}").startswith("/memfd:bluecache-object")
             and os.stat(f"{fds}/{fd}").st_size == size}
    assert len(found) == 1, found
    fd = os.open(found.popitem()[1], os.O_RDONLY)
    try:
        return pmd_mapped_kib(fd, size)
    finally:
        os.close(fd)


@pytest.mark.parametrize("huge", [True, False])
def test_a_store_by_the_writers_kernel_lands_on_2mib_pages(mounted, shmem_never, huge):
    """tiers.dram.huge_pages: bluecached sets the shmem policy to within_size, so the pages a
    writer's kernel allocates in the object's memfd (passthrough) are 2 MiB ones; without
    it (policy `advise`, hostd's) they are 4 KiB ones. The bytes read back either way."""
    stack = mounted(**{"tiers.dram.huge_pages": huge, "tiers.dram.prefault": "0"})   # no spares
    data = os.urandom(8 * MIB)
    with open(stack.path("block.tmp"), "wb") as f:
        f.write(data)
    os.rename(stack.path("block.tmp"), stack.path("block"))
    assert stack.path("block").read_bytes() == data
    pmd_mapped = _pmd_mapped_kib_of_object(stack, len(data))
    if huge:   # at least some: a fragmented machine may fall back to 4 KiB for a few
        assert pmd_mapped >= 2 * 1024, pmd_mapped
    else:
        assert pmd_mapped == 0
    assert "write opens written by the kernel: 1" in _hostd_log_after_stop(stack)


def test_a_kernel_writer_and_the_cache_agree_on_every_change(mounted):
    """Changes a writer makes beside its kernel's writes (truncation, a second writer the
    daemon serves, mmap, holes) land in one memfd; a daemon-served reader sees them all."""
    stack = mounted()
    path = stack.path("mixed.bin")
    a = os.urandom(3 * MIB)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, a, 0)                   # by the kernel
        os.ftruncate(fd, 2 * MIB + 3)         # SETATTR: the daemon cuts the memfd
        other = os.open(path, os.O_WRONLY)    # a second writer: served by the daemon
        try:
            os.pwrite(other, b"Z" * 10, MIB)
        finally:
            os.close(other)
        os.pwrite(fd, b"hole-after", 5 * MIB)  # by the kernel again, past a hole
        with mmap.mmap(fd, 4096, offset=0) as m:
            m[:4] = b"MMAP"
        expected = bytearray(a[:2 * MIB + 3]) + bytes(5 * MIB - (2 * MIB + 3)) + b"hole-after"
        expected[MIB:MIB + 10] = b"Z" * 10
        expected[:4] = b"MMAP"
        reader = os.open(path, os.O_RDONLY)   # open for writing: the daemon serves it
        try:
            assert _read_all(reader) == bytes(expected)
        finally:
            os.close(reader)
    finally:
        os.close(fd)
    assert stack.path("mixed.bin").read_bytes() == bytes(expected)
    assert _daemon_size(stack, b"mixed.bin") == len(expected)


def test_an_o_trunc_open_beside_a_kernel_writer_cuts_what_it_wrote(mounted):
    """The O_TRUNC open reaches bluecached before it has looked at the kernel writer's
    memfd: it must cut what is there, not the size it last saw (0), which cut nothing and
    left the old bytes under the new writer (found by a probe)."""
    stack = mounted()
    path = stack.path("cut.bin")
    first = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(first, b"old" * MIB, 4095)          # by the kernel, unseen so far
        second = os.open(path, os.O_RDWR | os.O_TRUNC)
        try:
            assert os.fstat(second).st_size == 0
            assert os.pread(first, 100, 4096) == b""
            os.pwrite(second, b"new", 0)
        finally:
            os.close(second)
    finally:
        os.close(first)
    assert path.read_bytes() == b"new"


def test_an_nvme_object_failing_its_checksum_is_never_served(mounted):
    """The open promotes it, the CRC32C does not match: no memfd is handed out, the object is
    removed, and the reader gets EIO, never the rotten bytes."""
    stack = mounted(allow_log=["lost bluecached", "checksum mismatch", "no content in any tier"])
    data = os.urandom(3 * MIB)
    write_closed(stack, stack.path("rot.bin"), data)
    assert stack.daemon.stop() == 0
    probe = data[MIB:MIB + 64]
    for segment in sorted((stack.daemon.root / "nvme").glob("seg-*")):
        content = segment.read_bytes()
        at = content.find(probe)
        if at >= 0:
            with open(segment, "r+b") as f:
                f.seek(at + 7)
                f.write(bytes([content[at + 7] ^ 0x40]))
            break
    else:
        pytest.fail("the file's bytes are in no segment")
    stack.daemon.start()
    with pytest.raises(OSError) as e:
        stack.path("rot.bin").read_bytes()
    assert e.value.errno == errno.EIO
    # The kernel hears of the removal from hostd after the fact (an entry invalidation sent
    # on bluecached's `removed` event): its cached entry may answer a moment longer.
    deadline = time.monotonic() + 30
    while stack.path("rot.bin").exists():
        assert time.monotonic() < deadline, "the kernel kept the removed file's entry"
        time.sleep(0.05)
    stack.hostd.stop(timeout=30)
    assert "checksum mismatch" in stack.daemon.log.read_text()


def test_hostd_reads_a_file_open_for_writing_itself(mounted):
    stack = mounted()
    with open(stack.path("f"), "wb") as writer:
        writer.write(b"partial")
        writer.flush()
        assert stack.path("f").read_bytes() == b"partial"
    log = _hostd_log_after_stop(stack)
    assert "opens served by passthrough: 0, read-only opens served by hostd: 1" in log


@pytest.fixture
def max_pages_limit():
    """fs.fuse.max_pages_limit as it was, put back afterwards (hostd raises it)."""
    limit = Path("/proc/sys/fs/fuse/max_pages_limit")
    if not limit.exists():
        pytest.skip("kernel before 6.13: max_pages is capped at 256")
    before = limit.read_text()
    yield
    limit.write_text(before)


def test_hostd_asks_for_larger_read_requests(mounted, max_pages_limit):
    """mount.max_pages 1024: hostd raises the kernel's limit and a reader hostd serves gets
    4 MiB requests (hostd splits them over its 1 MiB slots), byte-exact."""
    Path("/proc/sys/fs/fuse/max_pages_limit").write_text("256\n")
    stack = mounted(hostd_settings={"mount.passthrough": False, "mount.max_pages": 1024})
    data = os.urandom(9 * MIB)
    write_closed(stack, stack.path("f"), data)
    fd = os.open(stack.path("f"), os.O_RDONLY)
    try:
        assert pread_aligned(fd, 9 * MIB, 0) == data
    finally:
        os.close(fd)
    assert int(Path("/proc/sys/fs/fuse/max_pages_limit").read_text()) >= 1024
    assert "read requests up to 4096 KiB" in _hostd_log_after_stop(stack)
