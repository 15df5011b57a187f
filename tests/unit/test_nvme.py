import errno
import fcntl
import logging
import mmap
import os
import random
import re
import threading
import time
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from bluecached.tiers import nvme
from bluecached.tiers.nvme import ALIGN, Extent, NvmeError, SegmentStore

P = ALIGN  # one page
MiB = 1 << 20


def store(tmp_path, capacity=3 * 16 * P, segment_size=16 * P, **kw) -> SegmentStore:
    kw.setdefault("o_direct", "off")
    return SegmentStore(tmp_path / "nvme", capacity, segment_size, **kw)


def chunks_of(data: bytes) -> list[mmap.mmap]:
    out = []
    for i in range(0, max(len(data), 1), MiB):
        m = mmap.mmap(-1, MiB)
        piece = data[i:i + MiB]
        m[:len(piece)] = piece
        out.append(m)
    return out


def fresh_chunks(n: int) -> list[mmap.mmap]:
    return [mmap.mmap(-1, MiB) for _ in range(n)]


# allocator


def test_first_fit_reuse_and_coalesce(tmp_path):
    s = store(tmp_path)
    a, b, c = (s.allocate(4 * P) for _ in range(3))
    assert (a, b, c) == (Extent(0, 4 * P), Extent(4 * P, 4 * P), Extent(8 * P, 4 * P))
    s.free(b)
    assert s.allocate(2 * P) == Extent(4 * P, 2 * P)  # first hole, not the tail
    assert s.allocate(3 * P) == Extent(12 * P, 3 * P)  # the rest of the hole is too small
    assert s.allocate(2 * P) == Extent(6 * P, 2 * P)
    s.free(Extent(4 * P, 2 * P))
    s.free(Extent(6 * P, 2 * P))
    s.free(a)
    s.free(c)  # joins both neighbours
    assert list(s.free_extents()) == [Extent(0, 12 * P), Extent(15 * P, P),
                                      Extent(16 * P, 16 * P), Extent(32 * P, 16 * P)]
    s.free(Extent(12 * P, 3 * P))
    assert list(s.free_extents())[0] == Extent(0, 16 * P)  # never merged across segments
    assert s.used_bytes == 0 and s.free_bytes == s.capacity


def test_extents_never_cross_segments(tmp_path):
    s = store(tmp_path, capacity=2 * 16 * P)
    assert s.allocate(10 * P) == Extent(0, 10 * P)
    assert s.allocate(10 * P) == Extent(16 * P, 10 * P)  # 6 pages left in segment 0
    assert s.allocate(10 * P) is None
    assert s.largest_free == 6 * P
    assert s.free_bytes == 12 * P
    assert s.allocate(6 * P) == Extent(10 * P, 6 * P)


def test_full_returns_none_and_accounting(tmp_path):
    s = store(tmp_path, capacity=2 * 16 * P + 3 * P + 100)  # rounds down; short last segment
    assert s.capacity == 35 * P
    got = []
    while (e := s.allocate(1)) is not None:  # rounds up to a page
        assert e.length == P
        got.append(e)
        assert s.used_bytes + s.free_bytes == s.capacity
    assert len(got) == 35 and s.free_bytes == 0 and s.largest_free == 0
    assert max(e.offset for e in got) == 34 * P
    s.free(got[20])
    assert s.allocate(2 * P) is None
    assert s.allocate(P) == got[20]


def test_invalid_requests(tmp_path):
    s = store(tmp_path)
    with pytest.raises(ValueError):
        s.allocate(0)
    with pytest.raises(ValueError):
        s.allocate(16 * P + 1)  # can never fit: evicting would not help
    e = s.allocate(P)
    s.free(e)
    with pytest.raises(ValueError, match="double free"):
        s.free(e)
    for bad in (Extent(P + 1, P), Extent(15 * P, 2 * P), Extent(48 * P, P), Extent(-P, P)):
        with pytest.raises(ValueError):
            s.free(bad)
    with pytest.raises(ValueError):
        SegmentStore(tmp_path / "x", 100, 16 * P)
    with pytest.raises(ValueError):
        SegmentStore(tmp_path / "x", 16 * P, 1000)
    with pytest.raises(ValueError):
        SegmentStore(tmp_path / "x", 16 * P, 16 * P, o_direct="yes")


def test_mark_used(tmp_path):
    s = store(tmp_path)
    s.mark_used(Extent(4 * P, 2 * P))
    s.mark_used(Extent(0, P))
    s.mark_used(Extent(20 * P, 12 * P))  # the end of segment 1
    assert s.used_bytes == 15 * P
    for bad in (Extent(5 * P, P), Extent(3 * P, 2 * P), Extent(0, P), Extent(19 * P, 2 * P)):
        with pytest.raises(ValueError, match="overlaps"):
            s.mark_used(bad)
    for bad in (Extent(46 * P, 4 * P), Extent(14 * P, 4 * P), Extent(P, 100)):
        with pytest.raises(ValueError):
            s.mark_used(bad)
    assert s.used_bytes == 15 * P
    assert s.allocate(3 * P) == Extent(P, 3 * P)
    assert s.allocate(5 * P) == Extent(6 * P, 5 * P)
    assert s.allocate(5 * P) == Extent(11 * P, 5 * P)
    assert s.allocate(5 * P) == Extent(32 * P, 5 * P)  # segment 1 has 4 free pages
    assert Extent(20 * P, 12 * P) not in s.free_extents()


def test_rebuild_matches_mark_used_and_is_atomic(tmp_path):
    rng = random.Random(1)
    a, b = store(tmp_path / "a"), store(tmp_path / "b")
    extents = []
    for _ in range(40):
        e = a.allocate(rng.randint(1, 5) * P)
        if e:
            extents.append(e)
    for e in rng.sample(extents, 10):
        a.free(e)
        extents.remove(e)
    for e in extents:
        b.mark_used(e)
    c = store(tmp_path / "c")
    c.rebuild(reversed(extents))
    assert list(a.free_extents()) == list(b.free_extents()) == list(c.free_extents())
    assert a.used_bytes == b.used_bytes == c.used_bytes
    before = list(c.free_extents())
    with pytest.raises(ValueError, match="overlaps"):
        c.rebuild([Extent(0, 4 * P), Extent(2 * P, P)])
    with pytest.raises(ValueError):
        c.rebuild([Extent(15 * P, 2 * P)])
    assert list(c.free_extents()) == before
    c.rebuild([])
    assert c.used_bytes == 0 and c.largest_free == 16 * P


def test_rebuild_100k_is_fast(tmp_path):
    seg = 1 << 30
    s = SegmentStore(tmp_path / "nvme", 110_000 * 32 * MiB, seg, o_direct="off")
    s.capacity = s.span   # the allocator alone: no disk is this large
    extents = [(i * 32 * MiB + (i % 3) * P, 32 * MiB - 4 * P) for i in range(110_000)]
    del extents[::11]
    random.Random(2).shuffle(extents)
    t = time.perf_counter()
    s.rebuild(extents)
    elapsed = time.perf_counter() - t
    assert s.used_bytes == 100_000 * (32 * MiB - 4 * P)
    assert elapsed < 1.0, elapsed
    t = time.perf_counter()
    for e in extents[:20_000]:
        s.free(e)
    for _ in range(20_000):
        assert s.allocate(32 * MiB - 4 * P)
    assert time.perf_counter() - t < 2.0


def test_allocate_skips_full_segments_quickly(tmp_path):
    s = SegmentStore(tmp_path / "nvme", 20_000 * 16 * P, 16 * P, o_direct="off")
    s.capacity = s.span
    t = time.perf_counter()
    for _ in range(20_000):
        assert s.allocate(16 * P)
    assert s.allocate(P) is None
    assert time.perf_counter() - t < 2.0  # not a scan of every segment per call


class AllocatorModel(RuleBasedStateMachine):
    """Compares the allocator with a page bitmap; first fit = lowest address of a free run."""

    SEG = 8
    SEGS = 3
    TAIL = 5  # a short last segment

    def __init__(self):
        super().__init__()
        import tempfile
        self.tmp = tempfile.TemporaryDirectory()
        self.pages = self.SEG * self.SEGS + self.TAIL
        self.s = SegmentStore(Path(self.tmp.name), self.pages * P, self.SEG * P, o_direct="off")
        self.used = [False] * self.pages
        self.live: list[Extent] = []

    def teardown(self):
        self.s.close()
        self.tmp.cleanup()

    def expected_fit(self, n):
        for start in range(self.pages - n + 1):
            if start // self.SEG != (start + n - 1) // self.SEG:
                continue
            if not any(self.used[start:start + n]):
                return start
        return None

    @rule(n=st.integers(1, 8), extra=st.integers(0, P - 1))
    def allocate(self, n, extra):
        length = (n - 1) * P + extra + 1
        want = self.expected_fit(n)
        got = self.s.allocate(length)
        if want is None:
            assert got is None
            return
        assert got == Extent(want * P, n * P)
        self.used[want:want + n] = [True] * n
        self.live.append(got)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        e = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.s.free(e)
        p = e.offset // P
        self.used[p:p + e.length // P] = [False] * (e.length // P)

    @rule(data=st.data())
    def mark_used_anything(self, data):
        p = data.draw(st.integers(0, self.pages - 1))
        n = data.draw(st.integers(1, 4))
        ext = Extent(p * P, n * P)
        fits = p // self.SEG == (p + n - 1) // self.SEG and p + n <= self.pages
        if fits and not any(self.used[p:p + n]):
            self.s.mark_used(ext)
            self.used[p:p + n] = [True] * n
            self.live.append(ext)
        else:
            with pytest.raises(ValueError):
                self.s.mark_used(ext)

    @rule()
    def rebuild(self):
        self.s.rebuild(list(self.live))

    @invariant()
    def consistent(self):
        s = self.s
        assert s.used_bytes == sum(self.used) * P
        assert s.used_bytes + s.free_bytes == s.capacity
        free = list(s.free_extents())
        for e in free + self.live:
            assert e.offset // (self.SEG * P) == (e.offset + e.length - 1) // (self.SEG * P)
        marks = [0] * self.pages
        for e in free + self.live:
            for p in range(e.offset // P, (e.offset + e.length) // P):
                marks[p] += 1
        assert marks == [1] * self.pages  # free and live tile the store exactly
        for a, b in pairwise(free):  # coalesced
            assert a.offset + a.length < b.offset or b.offset % (self.SEG * P) == 0

    @rule()
    def largest_free(self):  # a rule, not an invariant: it tightens the per-segment bounds
        assert self.s.largest_free == max((e.length for e in self.s.free_extents()), default=0)


TestAllocatorModel = AllocatorModel.TestCase
TestAllocatorModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# I/O


@pytest.mark.parametrize("o_direct", ["off", "auto"])
@pytest.mark.parametrize("length", [3 * MiB + 123, 2 * MiB, 100])
def test_round_trip(tmp_path, o_direct, length):
    s = store(tmp_path, capacity=64 * MiB, segment_size=16 * MiB, o_direct=o_direct)
    data = os.urandom(length)
    before = s.allocate(P)
    e = s.allocate(length)
    after = s.allocate(P)
    s.write(before, chunks_of(b"\xaa" * P), P)
    s.write(after, chunks_of(b"\xbb" * P), P)
    s.write(e, [memoryview(c) for c in chunks_of(data)], length)
    s.sync()
    out = fresh_chunks(len(chunks_of(data)))
    s.read(e, [memoryview(c) for c in out], length)
    assert b"".join(out)[:length] == data
    for ext, byte in ((before, b"\xaa"), (after, b"\xbb")):  # the padding stayed inside
        page = fresh_chunks(1)
        s.read(ext, page, P)
        assert page[0][:P] == byte * P
    s.close()
    # and from a fresh store over the same files
    s2 = store(tmp_path, capacity=64 * MiB, segment_size=16 * MiB, o_direct=o_direct)
    out = fresh_chunks(len(out))
    s2.read(e, out, length)
    assert b"".join(out)[:length] == data
    s2.close()


@pytest.mark.parametrize("o_direct", ["off", "auto"])
def test_short_last_chunk_uses_a_bounce_page(tmp_path, o_direct):
    s = store(tmp_path, capacity=64 * MiB, segment_size=16 * MiB, o_direct=o_direct)
    length = MiB + 5000
    data = os.urandom(length)
    src = chunks_of(data)
    views = [memoryview(src[0]), memoryview(src[1])[:5000]]  # no room for the pad
    e = s.allocate(length)
    s.write(e, views, length)
    dst = fresh_chunks(2)
    dst[1][:] = b"\x55" * MiB
    s.read(e, [memoryview(dst[0]), memoryview(dst[1])[:5000]], length)
    assert dst[0][:] + dst[1][:5000] == data
    assert dst[1][5000:] == b"\x55" * (MiB - 5000)  # nothing written past the views
    for v in views:
        v.release()
    s.close()


def test_chunks_shorter_than_length_is_an_error(tmp_path):
    s = store(tmp_path)
    e = s.allocate(3 * P)
    with pytest.raises(ValueError):
        s.write(e, [bytearray(P)], P + 1)
    with pytest.raises(ValueError):
        s.write(e, fresh_chunks(1), 4 * P)  # beyond the extent


def test_segments_are_sparse_and_lazy(tmp_path):
    s = store(tmp_path, capacity=2 * 16 * P + 3 * P)
    s.mark_used(Extent(32 * P, 3 * P))
    s.write(Extent(32 * P, 3 * P), chunks_of(b"x" * 3 * P), 3 * P)
    files = sorted(p.name for p in (tmp_path / "nvme").glob("seg-*"))
    assert files == ["seg-000002.dat"]
    assert (tmp_path / "nvme" / "seg-000002.dat").stat().st_size == 3 * P
    e = s.allocate(P)
    s.write(e, chunks_of(b"y" * P), P)
    assert (tmp_path / "nvme" / "seg-000000.dat").stat().st_size == 16 * P
    assert (tmp_path / "nvme" / "seg-000000.dat").stat().st_blocks * 512 <= 2 * P


def test_short_read_and_missing_segment_are_eio(tmp_path):
    s = store(tmp_path)
    e = s.allocate(2 * P)
    s.write(e, chunks_of(b"z" * 2 * P), 2 * P)
    os.truncate(tmp_path / "nvme" / "seg-000000.dat", P)
    with pytest.raises(NvmeError) as info:
        s.read(e, fresh_chunks(1), 2 * P)
    assert info.value.errno == errno.EIO
    assert isinstance(info.value, OSError)
    with pytest.raises(NvmeError) as info:
        s.read(Extent(16 * P, P), fresh_chunks(1), P)  # segment 1 was never written
    assert info.value.errno == errno.EIO
    assert not (tmp_path / "nvme" / "seg-000001.dat").exists()


def test_partial_transfers_and_iov_max(tmp_path, monkeypatch):
    s = store(tmp_path, capacity=64 * MiB, segment_size=16 * MiB)
    monkeypatch.setattr(nvme, "IOV_MAX", 2)
    rng = random.Random(3)
    calls = []
    real_pwritev, real_preadv = os.pwritev, os.preadv

    def stingy(real):
        def op(fd, bufs, offset):
            assert len(bufs) <= 2
            calls.append(len(bufs))
            cut = rng.randint(1, sum(map(len, bufs)))  # a short transfer, anywhere
            out, left = [], cut
            for b in bufs:
                out.append(memoryview(b)[:left])
                left -= len(out[-1])
            return real(fd, out, offset)
        return op

    monkeypatch.setattr(os, "pwritev", stingy(real_pwritev))
    monkeypatch.setattr(os, "preadv", stingy(real_preadv))
    data = os.urandom(5 * MiB - 7)
    e = s.allocate(len(data))
    s.write(e, chunks_of(data), len(data))
    out = fresh_chunks(5)
    s.read(e, out, len(data))
    assert b"".join(out)[:len(data)] == data
    assert len(calls) > 6


def test_io_errors_are_nvme_errors(tmp_path, monkeypatch):
    s = store(tmp_path)
    e = s.allocate(P)

    def enospc(fd, bufs, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", enospc)
    with pytest.raises(NvmeError) as info:
        s.write(e, fresh_chunks(1), P)
    assert info.value.errno == errno.ENOSPC
    assert "seg-000000.dat" in str(info.value)


def test_sync_only_when_durable(tmp_path, monkeypatch):
    synced, dir_synced = [], []
    real_fdatasync, real_fsync = os.fdatasync, os.fsync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real_fdatasync(fd)))
    monkeypatch.setattr(os, "fsync", lambda fd: (dir_synced.append(fd), real_fsync(fd)))
    for durable in (True, False):
        synced.clear()
        dir_synced.clear()
        s = store(tmp_path / str(durable), durable=durable)
        s.write(Extent(16 * P, P), fresh_chunks(1), P)
        s.sync()
        assert synced == ([s._fds[1]] if durable else [])
        assert len(dir_synced) == durable  # the new segment file's name
        synced.clear()
        s.write(Extent(17 * P, P), fresh_chunks(1), P)
        s.sync()
        assert synced == ([s._fds[1]] if durable else [])
        assert len(dir_synced) == durable  # no new file this time
        synced.clear()
        s.sync()  # nothing new
        assert synced == []
        s.close()


def test_sync_waits_for_a_durable_copy_even_while_another_thread_syncs(tmp_path, monkeypatch):
    # write-behind workers each write then sync; a sync must not return just because another
    # thread's fdatasync of the same segment is under way (it may not be finished)
    s = store(tmp_path)
    s.write(Extent(0, P), fresh_chunks(1), P)
    entered, release = threading.Event(), threading.Event()
    calls = []
    real = os.fdatasync

    def fdatasync(fd):
        calls.append(fd)
        if len(calls) == 1:
            entered.set()
            release.wait(10)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    other = threading.Thread(target=s.sync)
    other.start()
    assert entered.wait(10)
    s.sync()
    assert len(calls) == 2 and not release.is_set()
    release.set()
    other.join()
    s.close()


# O_DIRECT


def o_direct_works(directory: Path) -> bool:
    """Independently of the module: can this filesystem do aligned O_DIRECT I/O?"""
    path = directory / "check"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as e:
        assert e.errno == errno.EINVAL
        return False
    try:
        with mmap.mmap(-1, P) as page:
            try:
                return os.pwrite(fd, page, 0) == P
            except OSError as e:
                assert e.errno == errno.EINVAL
                return False
    finally:
        os.close(fd)
        path.unlink()


def segment_flags(s: SegmentStore) -> int:
    s.write(Extent(0, P), fresh_chunks(1), P)
    return fcntl.fcntl(s._fds[0], fcntl.F_GETFL)


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_probe_agrees_with_the_filesystem(tmp_path, where):
    if where == "shm":
        if not Path("/dev/shm").is_dir():
            pytest.skip("no /dev/shm")
        import tempfile
        holder = tempfile.TemporaryDirectory(dir="/dev/shm")
        base = Path(holder.name)
    else:
        base = tmp_path
    works = o_direct_works(base)
    s = store(base, o_direct="auto")
    assert s.o_direct is works
    assert bool(segment_flags(s) & os.O_DIRECT) is works
    assert not list((base / "nvme").glob(".o_direct*"))  # the probe file is gone
    s.close()
    if works:
        s = store(base / "on", o_direct="on")
        assert s.o_direct and segment_flags(s) & os.O_DIRECT
        s.close()
    else:
        with pytest.raises(NvmeError, match=re.escape(str(base))):
            store(base / "on", o_direct="on")
    s = store(base / "off", o_direct="off")
    assert not s.o_direct and not segment_flags(s) & os.O_DIRECT
    s.close()
    if where == "shm":
        holder.cleanup()


@pytest.mark.parametrize("refuse_at", ["open", "io"])
def test_refused_o_direct_falls_back_or_fails_clearly(tmp_path, monkeypatch, caplog, refuse_at):
    # tmpfs accepts O_DIRECT since Linux 6.6, so simulate a filesystem that refuses it
    real_open, real_pwrite = os.open, os.pwrite
    direct_fds = set()

    def fake_open(path, flags, *a, **kw):
        if flags & os.O_DIRECT and refuse_at == "open":
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        fd = real_open(path, flags, *a, **kw)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def fake_pwrite(fd, data, offset):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "pwrite", fake_pwrite)
    with caplog.at_level(logging.INFO, logger="bluecached.tiers.nvme"):
        s = store(tmp_path, o_direct="auto")
    assert s.o_direct is False
    lines = [r for r in caplog.records if r.name == "bluecached.tiers.nvme"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert "O_DIRECT" in lines[0].getMessage()
    assert not segment_flags(s) & os.O_DIRECT
    assert not (tmp_path / "nvme" / ".o_direct_probe").exists()
    s.close()
    with pytest.raises(NvmeError, match="O_DIRECT.*" + re.escape(str(tmp_path / "on"))) as info:
        store(tmp_path / "on", o_direct="on")
    assert info.value.errno == errno.EINVAL


def test_a_changed_segment_size_is_refused_while_segments_exist(tmp_path):
    # extents are global offsets: segments written with one size read as garbage with another
    store = SegmentStore(tmp_path, 4 * MiB, 1 * MiB)
    ext = store.allocate(8192)
    store.write(ext, [memoryview(c) for c in chunks_of(b"x" * 8192)], 8192)
    store.close()
    with pytest.raises(NvmeError) as e:
        SegmentStore(tmp_path, 4 * MiB, 2 * MiB)
    assert "1048576-byte segments" in str(e.value) and "segment_size" in str(e.value)
    SegmentStore(tmp_path, 8 * MiB, 1 * MiB).close()   # a larger tier, same segments: fine
    for seg in tmp_path.glob("seg-*.dat"):
        seg.unlink()
    SegmentStore(tmp_path, 4 * MiB, 2 * MiB).close()   # emptied: starts afresh
    assert (tmp_path / "segments.layout").read_text() == f"segment_size {2 * MiB}\n"
