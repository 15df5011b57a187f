"""The ways a POSIX write reaches the cache, through a real mount: read by the kernel straight
into a staging slot (mount.receive_in_place, the default: hostd copies nothing) or handed over
by pyfuse3 and copied into a slot; answered once staged (write_ack: staged, the default) or once
the daemon has the bytes (stored); requests read from /dev/fuse by the fuse shim's reader
thread (mount.reader_thread, the default) or by the event loop itself. Every combination must
give the same bytes and errors. Passthrough is off here: with it, a new file's writes go from
the writer's kernel into the cache's memfd and reach none of these paths (test_passthrough.py
covers that); these are the paths of DPU mode and of files the kernel cannot write."""

import errno
import mmap
import os
import random
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from connectors import llmd_read, llmd_write
from hostd.zerocopy import query
from support import MiB, pattern

# (receive_in_place, write_ack, reader_thread)
PATHS = [(True, "staged", True), (True, "stored", True), (False, "staged", True),
         (False, "stored", True), (True, "staged", False), (False, "staged", False)]


def stack(mounted, in_place: bool, ack: str, reader: bool = True, slots: int = 128,
          **settings):
    return mounted(hostd_settings={"mount.receive_in_place": in_place, "mount.write_ack": ack,
                                   "mount.reader_thread": reader, "mount.staging_slots": slots,
                                   "mount.passthrough": False},
                   **settings)


def writes_counted_at_stop(s) -> tuple[int, int]:
    """Stops hostd; the writes it logged as received in place and as copied."""
    assert s.hostd.stop(timeout=30) == 0
    counts = re.findall(r"writes received in place: (\d+), copied: (\d+)", s.hostd.log.read_text())
    assert len(counts) == 1, s.hostd.log.read_text()
    return int(counts[0][0]), int(counts[0][1])


def direct_store(path: str, data: bytes) -> None:
    """vLLM's store: O_EXCL | O_DIRECT from page-aligned memory."""
    buf = mmap.mmap(-1, len(data))
    buf[:] = data
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_DIRECT, 0o644)
    try:
        assert os.write(fd, buf) == len(data)
    finally:
        os.close(fd)


def direct_load(path: str, size: int) -> bytes:
    buf = mmap.mmap(-1, size)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.readv(fd, [buf]) == size
    finally:
        os.close(fd)
    return buf[:]


def copied_by_hostd(s) -> int:
    probe = s.mnt / ".probe"
    probe.write_bytes(b"x")
    return query(str(probe))["hostd_bytes_copied"]


@pytest.mark.parametrize("in_place,ack,reader", PATHS)
def test_connector_writes_round_trip_and_hostd_copies_only_without_in_place(mounted, in_place,
                                                                            ack, reader):
    s = stack(mounted, in_place, ack, reader)
    root = str(s.mnt)
    before = copied_by_hostd(s)
    block = pattern("llmd", 8 * MiB + 12345)            # a last request shorter than 1 MiB
    assert llmd_write(root, "m/a/block.bin", block, "t0")
    direct = pattern("vllm", 4 * MiB)
    os.mkdir(os.path.join(root, "vllm"))
    direct_store(os.path.join(root, "vllm/0.bin"), direct)
    written = len(block) + len(direct)
    probe = 0 if in_place else 1   # copied_by_hostd's own write
    assert copied_by_hostd(s) - before == (0 if in_place else written + probe)
    assert llmd_read(root, "m/a/block.bin") == block
    assert direct_load(os.path.join(root, "vllm/0.bin"), len(direct)) == direct


@pytest.mark.parametrize("in_place,ack,reader", PATHS)
def test_overlapping_writes_land_in_the_order_they_were_written(mounted, in_place, ack, reader):
    s = stack(mounted, in_place, ack, reader)
    path = os.path.join(str(s.mnt), "overlaps.bin")
    rng = random.Random(7)
    model = bytearray(4 * MiB)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, bytes(model))
        # Each at most 1 MiB: one request, answered before the next. Mostly small, so that
        # several arrive while one daemon message is out and share the next one.
        for i in range(1000):
            size = rng.randrange(1, MiB + 1) if i % 10 == 0 else rng.randrange(1, 64 << 10)
            off = rng.randrange(4 * MiB - size)
            piece = pattern(f"w{i}", size)
            assert os.pwrite(fd, piece, off) == size
            model[off:off + size] = piece
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        assert f.read() == model


@pytest.mark.parametrize("in_place", [True, False])
def test_a_stored_write_reports_a_full_cache_at_the_write(mounted, in_place):
    # With write_ack stored nothing is answered early: the write itself fails, and what was
    # written before stays (test_capacity covers the staged case, where close reports it).
    s = stack(mounted, in_place, "stored", allow_log=["no room"],
              **{"tiers.dram.size": "8MiB", "tiers.nvme.size": 0})
    root = str(s.mnt)
    held = os.open(os.path.join(root, "held"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(held, pattern("held", 6 * MiB))
        fd = os.open(os.path.join(root, "late"), os.O_WRONLY | os.O_CREAT, 0o644)
        written = 0
        try:
            with pytest.raises(OSError) as e:
                while written < 8 * MiB:   # 1 MiB per write: each is one request
                    written += os.write(fd, pattern(f"late{written}", MiB))
            assert e.value.errno == errno.ENOSPC and 0 < written < 3 * MiB
        finally:
            os.close(fd)
        with open(os.path.join(root, "late"), "rb") as f:
            assert f.read() == b"".join(pattern(f"late{n}", MiB) for n in range(0, written, MiB))
    finally:
        os.close(held)
    with open(os.path.join(root, "held"), "rb") as f:
        assert f.read() == pattern("held", 6 * MiB)


@pytest.mark.parametrize("reader", [True, False])
def test_writes_from_many_threads_are_received_in_place_with_or_without_the_reader(mounted,
                                                                                  reader):
    # 16 writers at once: with the reader thread up to 16 writes wait in its queue, each in a
    # slot of the shim's pool; none may fall back to pyfuse3's copy.
    s = stack(mounted, True, "staged", reader)
    root = str(s.mnt)
    blocks = {f"t{t}/b{i}.bin": pattern(f"{t}.{i}", 3 * MiB + 4096 * t) for t in range(16)
              for i in range(2)}

    def writer(t):
        for i in range(2):
            name = f"t{t}/b{i}.bin"
            assert llmd_write(root, name, blocks[name], f"w{t}")

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(writer, range(16)))
    for name, block in blocks.items():
        assert llmd_read(root, name) == block
    log = s.hostd.log.read_text()
    assert ("requests are read from /dev/fuse in a thread of their own" in log) == reader
    in_place, copied = writes_counted_at_stop(s)
    assert in_place >= sum(len(b) for b in blocks.values()) // MiB and copied == 0


@pytest.mark.parametrize("reader", [True, False])
def test_writes_beyond_the_staging_slots_take_the_copy_path_and_lose_nothing(mounted, reader):
    # bluecached is stopped (SIGSTOP, under hostd's 2 s ping timeout) while 80 writers each
    # send a 1 MiB write answered once stored: each write holds its slot until the daemon has
    # it, so no more than the 64 slots can be read in place. The rest must be read into the
    # shim's spare buffers and take pyfuse3's copy, then wait for a slot; all bytes arrive.
    s = stack(mounted, True, "stored", reader, slots=64, **{"tiers.dram.size": "256MiB"})
    root = str(s.mnt)
    writers = 80
    blocks = [pattern(f"slot{i}", MiB) for i in range(writers)]
    bufs = []
    for block in blocks:   # page-aligned: each write is exactly one 1 MiB request
        buf = mmap.mmap(-1, MiB)
        buf[:] = block
        bufs.append(buf)
    fds = [os.open(os.path.join(root, f"w{i}"), os.O_WRONLY | os.O_CREAT, 0o644)
           for i in range(writers)]
    barrier = threading.Barrier(writers + 1)

    def write(i):
        barrier.wait()
        assert os.pwrite(fds[i], bufs[i], 0) == MiB

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    os.kill(s.daemon.proc.pid, signal.SIGSTOP)
    try:
        barrier.wait()
        time.sleep(1.0)
    finally:
        os.kill(s.daemon.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 120       # a lost request must fail the test, not hang it
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    stuck = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not stuck, f"writes never answered: {stuck}"
    for fd in fds:
        os.close(fd)
    for i, block in enumerate(blocks):
        with open(os.path.join(root, f"w{i}"), "rb") as f:
            assert f.read() == block, i
    in_place, copied = writes_counted_at_stop(s)
    assert in_place + copied == writers and copied >= writers - 64   # 64: the slots
