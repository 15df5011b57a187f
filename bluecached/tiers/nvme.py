"""NVMe tier: objects packed into large segment files, one contiguous extent per object.

Free space is the complement of the live extents. Each segment keeps its free extents sorted by
offset (parallel lists of starts and lengths, coalesced on free), and a max-tree over per-segment
upper bounds of the largest free extent finds the first segment worth scanning in O(log n).
Allocation is first fit: the lowest-addressed free extent that is large enough.

The allocator is not thread-safe (the daemon calls it from one thread); read, write and sync are,
so they can run in worker threads.
"""

from __future__ import annotations

import bisect
import errno
import logging
import mmap
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from operator import itemgetter
from pathlib import Path
from typing import NamedTuple

from . import nvme_clone

log = logging.getLogger("bluecached.tiers.nvme")

ALIGN = 4096
INDEX_RESERVE = 16 << 20   # filesystem space the tier leaves for index snapshots beside it

try:
    IOV_MAX = os.sysconf("SC_IOV_MAX")
except (ValueError, OSError):
    IOV_MAX = -1
if IOV_MAX <= 0:
    IOV_MAX = 1024  # Linux's value


class Extent(NamedTuple):
    offset: int  # global byte offset; segment = offset // segment_size
    length: int  # allocated bytes, multiple of ALIGN


class NvmeError(OSError):
    """An I/O failure on the NVMe tier; errno says which."""


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _MaxTree:
    """Per-segment values with "leftmost index whose value is >= x" in O(log n)."""

    def __init__(self, values: list[int]):
        size = 1
        while size < len(values):
            size *= 2
        t = [0] * (2 * size)
        t[size:size + len(values)] = values
        for i in range(size - 1, 0, -1):
            t[i] = max(t[2 * i], t[2 * i + 1])
        self._t, self._size = t, size

    def __getitem__(self, i: int) -> int:
        return self._t[self._size + i]

    def __setitem__(self, i: int, value: int) -> None:
        t = self._t
        i += self._size
        t[i] = value
        i //= 2
        while i:
            m = max(t[2 * i], t[2 * i + 1])
            if t[i] == m:
                break  # ancestors already agree
            t[i] = m
            i //= 2

    def first_at_least(self, x: int) -> int:
        t = self._t
        if t[1] < x:
            return -1
        i = 1
        while i < self._size:
            i = 2 * i if t[2 * i] >= x else 2 * i + 1
        return i - self._size


def _probe_o_direct(path: Path) -> OSError | None:
    """None if the filesystem holding path does aligned O_DIRECT I/O, else the refusal."""
    probe = path / ".o_direct_probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSPC):
            return e
        raise
    try:
        with mmap.mmap(-1, ALIGN) as page:
            # some filesystems accept the open and refuse only the I/O
            try:
                if os.pwrite(fd, page, 0) != ALIGN or os.preadv(fd, [page], 0) != ALIGN:
                    return OSError(errno.EIO, "short O_DIRECT probe I/O")
            except OSError as e:
                if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSPC):
                    return e
                raise
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
    return None


def _slices(chunks: Sequence, start: int, stop: int) -> list[memoryview]:
    """Views covering bytes [start, stop) of the chunks' concatenation (may stop short)."""
    out = []
    pos = 0
    for c in chunks:
        if pos >= stop:
            break
        mv = memoryview(c).cast("B")
        end = pos + len(mv)
        if end > start:
            out.append(mv[max(start - pos, 0):min(stop, end) - pos])
        pos = end
    return out


class SegmentStore:
    def __init__(self, path: Path, capacity: int, segment_size: int, o_direct: str = "auto",
                 durable: bool = True):
        if segment_size <= 0 or segment_size % ALIGN:
            raise ValueError(f"segment_size must be a positive multiple of {ALIGN}")
        capacity -= capacity % ALIGN
        if capacity <= 0:
            raise ValueError(f"capacity must be at least {ALIGN} bytes")
        if o_direct not in ("auto", "on", "off"):
            raise ValueError(f"o_direct must be 'auto', 'on' or 'off', not {o_direct!r}")
        self.path = Path(path)
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.span = capacity       # the layout: segment k covers [k*segment_size, ...)
        self.capacity = capacity   # what may be in use: less where the filesystem is smaller
        self.segment_size = segment_size
        self.durable = durable
        self.used_bytes = 0
        self._nsegs = -(-capacity // segment_size)
        self._fds: dict[int, int] = {}
        # Completed writes per segment, and how many of them an fdatasync has covered. Counters,
        # not a dirty flag: a sync must not return while another thread's fdatasync that took
        # over its segment is still running. Key -1 counts created segment files (the directory).
        self._written: dict[int, int] = {}
        self._synced: dict[int, int] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._check_layout()
        self.o_direct = False
        if o_direct != "off":
            refused = _probe_o_direct(self.path)
            if refused is None:
                self.o_direct = True
            elif o_direct == "on":
                raise NvmeError(refused.errno,
                                f"O_DIRECT refused by the filesystem holding {self.path} "
                                f"(o_direct: on): {refused.strerror}", str(self.path))
            else:
                log.info("O_DIRECT refused on %s (%s): using buffered I/O",
                         self.path, refused.strerror)
        self.rebuild(())
        if self.fit_to_disk() < self.span:
            log.warning("the filesystem holding %s has room for %d MiB of the NVMe tier, not the "
                        "%d MiB configured (tiers.nvme.size): the tier holds at most that much",
                        self.path, self.capacity >> 20, self.span >> 20)

    # geometry

    LAYOUT_FILE = "segments.layout"

    def _check_layout(self) -> None:
        """Extents are global offsets (segment = offset // segment_size): segments written with
        one segment size read as garbage with another. The size is recorded beside them, and a
        change is refused while segment files exist."""
        layout = self.path / self.LAYOUT_FILE
        wanted = f"segment_size {self.segment_size}\n"
        try:
            recorded = layout.read_text()
        except FileNotFoundError:
            recorded = None
        if recorded == wanted:
            return
        if recorded is not None and any(self.path.glob("seg-*.dat")):
            raise NvmeError(errno.EINVAL,
                            f"the segment files here were written with {recorded.split()[-1]}-"
                            f"byte segments, not {self.segment_size} (tiers.nvme.segment_size): "
                            f"set it back, or empty the directory to start the tier afresh",
                            str(self.path))
        tmp = layout.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, wanted.encode())
        finally:
            os.close(fd)
        os.replace(tmp, layout)

    def _seg_len(self, k: int) -> int:
        return min(self.segment_size, self.span - k * self.segment_size)

    def _seg_path(self, k: int) -> Path:
        return self.path / f"seg-{k:06d}.dat"

    def _locate(self, extent: Extent) -> int:
        """The extent's segment; ValueError unless it is aligned and inside one segment."""
        off, n = extent
        if off < 0 or n <= 0 or off % ALIGN or n % ALIGN:
            raise ValueError(f"{extent} is not a positive {ALIGN}-aligned extent")
        k = off // self.segment_size
        if k >= self._nsegs or off + n > k * self.segment_size + self._seg_len(k):
            raise ValueError(f"{extent} is outside the store or crosses a segment boundary")
        return k

    # free space

    @property
    def max_extent(self) -> int:
        """The largest object the store can ever hold: an extent never crosses a segment."""
        return min(self.segment_size, self.span)

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity - self.used_bytes)

    def fit_to_disk(self) -> int:
        """Sets `capacity` to what the filesystem can hold: the blocks the segment files already
        have plus the free space, less a reserve for the index (journal and snapshots live
        beside the segments), at most the configured size. Returns the new capacity."""
        st = os.statvfs(self.path)
        held = 0
        with os.scandir(self.path) as entries:
            for entry in entries:
                if entry.name.startswith("seg-") and entry.name.endswith(".dat"):
                    held += entry.stat().st_blocks * 512
        reserve = min(INDEX_RESERVE, st.f_blocks * st.f_frsize // 16)
        fit = held + st.f_bavail * st.f_frsize - reserve
        self.capacity = max(0, min(self.span, fit - fit % ALIGN))
        return self.capacity

    @property
    def largest_free(self) -> int:
        best = 0
        for k, lens in enumerate(self._lens):
            exact = max(lens, default=0)
            self._hint[k] = exact  # tighten the upper bounds while here
            best = max(best, exact)
        return best

    def free_extents(self) -> Iterator[Extent]:
        """The free extents in address order (coalesced)."""
        for starts, lens in zip(self._starts, self._lens, strict=True):
            yield from map(Extent, starts, lens)

    def allocate(self, length: int) -> Extent | None:
        """First fit; None when no free extent is large enough (the caller evicts and retries)."""
        need = _round_up(length)
        if length <= 0 or need > self.max_extent:
            raise ValueError(f"cannot allocate {length} bytes: an extent is 1..segment_size bytes")
        if self.used_bytes + need > self.capacity:
            return None
        while True:
            k = self._hint.first_at_least(need)
            if k < 0:
                return None
            starts, lens = self._starts[k], self._lens[k]
            n = next(filter(need.__le__, lens), 0)  # C-speed scan; index() then finds its first
            if not n:
                self._hint[k] = max(lens, default=0)  # the bound was stale: make it exact
                continue
            i = lens.index(n)
            off = starts[i]
            if n == need:
                del starts[i], lens[i]
            else:
                starts[i] = off + need
                lens[i] = n - need
            self.used_bytes += need
            return Extent(off, need)

    def free(self, extent: Extent) -> None:
        k = self._locate(extent)
        off, n = extent
        starts, lens = self._starts[k], self._lens[k]
        i = bisect.bisect_left(starts, off)
        if (i < len(starts) and starts[i] < off + n) or (i and starts[i - 1] + lens[i - 1] > off):
            raise ValueError(f"{extent} overlaps free space (double free?)")
        joins_prev = i > 0 and starts[i - 1] + lens[i - 1] == off
        joins_next = i < len(starts) and starts[i] == off + n
        if joins_prev and joins_next:
            lens[i - 1] += n + lens[i]
            del starts[i], lens[i]
            size = lens[i - 1]
        elif joins_prev:
            lens[i - 1] += n
            size = lens[i - 1]
        elif joins_next:
            starts[i] = off
            lens[i] += n
            size = lens[i]
        else:
            starts.insert(i, off)
            lens.insert(i, n)
            size = n
        if size > self._hint[k]:
            self._hint[k] = size
        self.used_bytes -= n

    def mark_used(self, extent: Extent) -> None:
        """Claims a specific extent (index rebuild); ValueError if any of it is not free."""
        k = self._locate(extent)
        off, n = extent
        starts, lens = self._starts[k], self._lens[k]
        i = bisect.bisect_right(starts, off) - 1
        if i < 0 or starts[i] + lens[i] < off + n:
            raise ValueError(f"{extent} overlaps a used extent")
        start, size = starts[i], lens[i]
        head, tail = off - start, start + size - off - n
        if head and tail:
            lens[i] = head
            starts.insert(i + 1, off + n)
            lens.insert(i + 1, tail)
        elif head:
            lens[i] = head
        elif tail:
            starts[i], lens[i] = off + n, tail
        else:
            del starts[i], lens[i]
        self.used_bytes += n

    def rebuild(self, extents: Iterable[Extent]) -> None:
        """Resets free space to the complement of extents, sorting once (fast for 1M extents).

        ValueError (and no change) if an extent is invalid or two overlap.
        """
        ss = self.segment_size
        starts: list[list[int]] = [[] for _ in range(self._nsegs)]
        lens: list[list[int]] = [[] for _ in range(self._nsegs)]
        cursor = [k * ss for k in range(self._nsegs)]  # end of the last used extent seen
        seg_end = [k * ss + self._seg_len(k) for k in range(self._nsegs)]
        used = 0
        last = None
        for ext in sorted(extents, key=itemgetter(0)):
            off, n = ext
            k = off // ss
            if off < 0 or n <= 0 or off % ALIGN or n % ALIGN or k >= self._nsegs \
                    or off + n > seg_end[k]:
                self._locate(ext)  # raises the precise error
            if off < cursor[k]:
                raise ValueError(f"{Extent(*ext)} overlaps {Extent(*last)}")
            if off > cursor[k]:
                starts[k].append(cursor[k])
                lens[k].append(off - cursor[k])
            cursor[k] = off + n
            used += n
            last = ext
        for k, end in enumerate(seg_end):
            if cursor[k] < end:
                starts[k].append(cursor[k])
                lens[k].append(end - cursor[k])
        self._starts, self._lens = starts, lens
        self._hint = _MaxTree([max(ls, default=0) for ls in lens])
        self.used_bytes = used

    # I/O

    def _fd(self, k: int, create: bool) -> int:
        fd = self._fds.get(k)
        if fd is not None:
            return fd
        with self._lock:
            if self._closed:
                raise NvmeError(errno.EBADF, "segment store is closed", str(self.path))
            fd = self._fds.get(k)
            if fd is not None:
                return fd
            path = self._seg_path(k)
            flags = os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if self.o_direct else 0)
            try:
                fd = os.open(path, flags | (os.O_CREAT if create else 0), 0o600)
            except FileNotFoundError:
                # the index points into a segment that is gone: the data is lost
                raise NvmeError(errno.EIO, "segment file missing", str(path)) from None
            except OSError as e:
                raise NvmeError(e.errno, f"open: {e.strerror}", str(path)) from e
            try:
                if create and os.fstat(fd).st_size < self._seg_len(k):
                    os.ftruncate(fd, self._seg_len(k))  # sparse: costs no space until written
                    if self.durable:
                        self._written[-1] = self._written.get(-1, 0) + 1
            except OSError as e:
                os.close(fd)
                raise NvmeError(e.errno, f"ftruncate: {e.strerror}", str(path)) from e
            self._fds[k] = fd
            return fd

    def _io(self, op, k: int, bufs: list[memoryview], offset: int) -> None:
        """op (os.preadv or os.pwritev) over all of bufs, in IOV_MAX batches, resuming short
        transfers."""
        fd = self._fd(k, create=op is os.pwritev)
        offset -= k * self.segment_size
        bufs = [b for b in bufs if len(b)]
        i = 0
        while i < len(bufs):
            try:
                n = op(fd, bufs[i:i + IOV_MAX], offset)
            except OSError as e:
                raise NvmeError(e.errno, f"{op.__name__} at {offset}: {e.strerror}",
                                str(self._seg_path(k))) from e
            if n <= 0:
                raise NvmeError(errno.EIO, f"{op.__name__} at {offset}: segment file too short",
                                str(self._seg_path(k)))
            offset += n
            while i < len(bufs) and n >= len(bufs[i]):
                n -= len(bufs[i])
                i += 1
            if n:
                bufs[i] = bufs[i][n:]

    def _plan(self, extent: Extent, chunks: Sequence, length: int):
        """(segment, direct views, bounce tail start): the views cover [0, padded length) when
        the chunks are long enough, else [0, tail) with the last partial page via a bounce."""
        k = self._locate(extent)
        padded = _round_up(length)
        if length <= 0 or padded > extent.length:
            raise ValueError(f"length {length} does not fit {extent}")
        views = _slices(chunks, 0, padded)
        have = sum(map(len, views))
        if have == padded:
            return k, views, None
        if have < length:
            raise ValueError(f"chunks hold {have} bytes, fewer than length {length}")
        tail = padded - ALIGN
        return k, _slices(chunks, 0, tail), tail

    def write(self, extent: Extent, chunks: Sequence[memoryview], length: int) -> None:
        """Writes the first `length` bytes of the chunks at the extent, padded to ALIGN with
        whatever follows them in the last chunk. Blocking."""
        k, views, tail = self._plan(extent, chunks, length)
        if tail is None:
            self._io(os.pwritev, k, views, extent.offset)
        else:
            with mmap.mmap(-1, ALIGN) as bounce:  # anonymous: page-aligned and zeroed
                pos = 0
                for v in _slices(chunks, tail, length):
                    bounce[pos:pos + len(v)] = v
                    pos += len(v)
                page = memoryview(bounce)
                try:
                    self._io(os.pwritev, k, [*views, page], extent.offset)
                finally:
                    page.release()
        if self.durable:
            with self._lock:
                self._written[k] = self._written.get(k, 0) + 1

    def read(self, extent: Extent, chunks: Sequence[memoryview], length: int) -> None:
        """Reads the extent's first `length` bytes into the chunks (the pad too, where they have
        room). Blocking."""
        k, views, tail = self._plan(extent, chunks, length)
        if tail is None:
            self._io(os.preadv, k, views, extent.offset)
            return
        with mmap.mmap(-1, ALIGN) as bounce:
            page = memoryview(bounce)
            try:
                self._io(os.preadv, k, [*views, page], extent.offset)
                pos = 0
                for v in _slices(chunks, tail, length):
                    v[:] = page[pos:pos + len(v)]
                    pos += len(v)
            finally:
                page.release()

    def clone(self, extent: Extent, length: int) -> int:
        """A read-only fd of a new unnamed file holding the extent's first `length` bytes, a
        multiple of ALIGN, sharing their disk blocks (tiers/nvme_clone.py). Blocking. Raises
        NvmeError (EOPNOTSUPP where the filesystem has no reflinks)."""
        k = self._locate(extent)
        if length <= 0 or length % ALIGN or length > extent.length:
            raise ValueError(f"cannot clone {length} bytes of {extent}: whole pages only")
        start = extent.offset - k * self.segment_size
        try:
            return nvme_clone.clone(self._fd(k, create=False), start, length, self.path)
        except OSError as e:
            raise NvmeError(e.errno, f"clone: {e.strerror}", str(self._seg_path(k))) from e

    def sync(self) -> None:
        """Makes the writes completed before the call durable (a no-op unless durable).
        Thread-safe."""
        if not self.durable:
            return
        with self._lock:
            todo = sorted((k, n) for k, n in self._written.items() if self._synced.get(k, 0) < n)
        try:
            for k, n in todo:
                if k < 0:  # new segment files' names
                    dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                    try:
                        os.fsync(dfd)
                    finally:
                        os.close(dfd)
                else:
                    os.fdatasync(self._fds[k])
                with self._lock:
                    self._synced[k] = max(self._synced.get(k, 0), n)
        except OSError as e:
            raise NvmeError(e.errno, f"sync: {e.strerror}", str(self.path)) from e

    def close(self) -> None:
        with self._lock:
            self._closed = True
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)
