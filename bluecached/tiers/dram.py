"""DRAM tier: each object's bytes in a memfd of its own, worked on as 1 MiB chunks.

A memfd per object lets hostd hand the kernel the object itself as a FUSE passthrough backing
file (the `backing` op): a cache hit is then read by the kernel from this memory, with no
request reaching either daemon. The file offset is the object offset, and the memfd's size is
the object's size whenever a reader could see it (passthrough reads stop at its EOF).

The rest of the daemon still works on chunks: chunk i is an mmap of the 1 MiB window at
i*CHUNK_SIZE of the object's memfd. A FUSE write (at most 1 MiB) touches one or two chunks,
files grow without reallocating, and a list of page-aligned chunks is what pwritev/preadv
with O_DIRECT and the DMA engines want. The pool's capacity is counted in chunks.

Touching a mapped page wholly past the memfd's EOF raises SIGBUS: the memfd grows before a
chunk is written and shrinks only where nothing touches the cut pages (Tiers.fit_memfd).
"""

import contextlib
import ctypes
import fcntl
import logging
import math
import mmap
import os
import resource
import time

import trio

CHUNK_SIZE = 1 << 20
PAGE_SIZE = mmap.PAGESIZE

log = logging.getLogger("bluecached.tiers.dram")


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


FDS_BESIDES_OBJECTS = 4096   # sockets, regions, journal and NVMe files, spares


def object_limit(capacity: int) -> int:
    """How many objects a DRAM tier of `capacity` holds at most: one per chunk (an object of
    bytes takes at least one; empty ones are bounded by this count: Tiers._dram_above)."""
    return max(1, capacity // CHUNK_SIZE)


def allow_fds_for(capacity: int) -> None:
    """Every object in DRAM holds a memfd: up to one per chunk of the capacity. The soft
    open-file limit goes up to the hard one; a hard limit below what the tier may need is
    said at start (later the store answers ENOSPC when it cannot make one)."""
    need = object_limit(capacity) + FDS_BESIDES_OBJECTS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning("the open-file limit (%d) is below what the DRAM tier may need: one memfd "
                    "per object, up to %d; raise LimitNOFILE (or ulimit -n) to at least %d",
                    soft, object_limit(capacity), need)


class Memfd:
    """One object's memfd: `size` is the file's size now, `length` the object's size as last
    told (they differ only while Tiers.fit_memfd must wait: see there). Windows mapped ahead
    of need (a spare's) wait in `ahead` until the object takes them. `lent`: another
    process got it (open_readonly) and may keep it past any handle, so it is never reused
    for another object's bytes. `before_unmap`: the pool's hook, called on a window mapped
    ahead before it is unmapped here (the engine may have page-locked it: a registration
    left on an unmapped range makes the next mapping there unregistrable)."""

    __slots__ = ("fd", "size", "length", "ahead", "lent", "before_unmap")

    def __init__(self, size: int = 0):
        # CLOEXEC: hostd gets it only through the `backing` op, never by inheritance. No
        # seals: the file grows and shrinks with the object.
        self.fd = os.memfd_create("bluecache-object", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self.size = self.length = 0
        self.ahead: dict[int, mmap.mmap] = {}
        self.lent = False
        self.before_unmap = None
        if size:
            self.resize(size)

    def resize(self, size: int) -> None:
        os.ftruncate(self.fd, size)
        self.size = size
        for index in [i for i in self.ahead if i * CHUNK_SIZE >= size]:
            self._unmap_ahead(self.ahead.pop(index))   # no longer inside the file: untouched

    def grow_to(self, size: int) -> None:
        """At least `size` bytes long, never shorter: unlike ftruncate, this cannot cut what a
        writer's kernel wrote past the size last seen (fallocate only ever extends)."""
        if size > 0:
            os.posix_fallocate(self.fd, size - 1, 1)
        self.size = max(self.size, size)

    def allocate(self, offset: int, length: int) -> None:
        """Pages for [offset, offset+length) now, the size unchanged (blocking: a worker
        thread's job): one call instead of a fault per 4 KiB at first touch, 2 MiB pages
        where the shmem policy allows. Where the kernel refuses, the first touch still
        allocates them."""
        end = min(offset + length, self.size)
        if end > offset:
            _libc_fallocate(self.fd, _KEEP_SIZE, offset, end - offset)   # (a refusal: see above)

    def clear_from(self, offset: int, keep_pages: bool = False) -> None:
        """Bytes from `offset` on become zeros (pages freed) without changing the size: for a
        shrink that must wait while someone copies. A copy in progress then reads zeros past
        that point, never faults (the pages are still inside the file). `keep_pages`: zeros
        written into the same pages instead, for pages an engine may have page-locked (a
        device keeps the pages it locked: once the file let them go, its copies would read
        and write pages nobody else sees)."""
        if offset >= self.size:
            return
        if not keep_pages:
            _punch_hole(self.fd, offset, self.size - offset)
            return
        while offset < self.size:
            offset += os.pwrite(self.fd, _ZEROS[:min(CHUNK_SIZE, self.size - offset)], offset)

    def window(self, index: int) -> mmap.mmap:
        """Chunk `index`: the 1 MiB window at index*CHUNK_SIZE, mapped shared."""
        chunk = self.ahead.pop(index, None)
        if chunk is not None:
            return chunk
        end = (index + 1) * CHUNK_SIZE
        if self.size >= end:
            return mmap.mmap(self.fd, CHUNK_SIZE, offset=index * CHUNK_SIZE)
        return _window_past_eof(self.fd, index * CHUNK_SIZE)

    def drop_ahead(self) -> None:
        """Unmaps windows mapped ahead that the object never took (and frees their pages:
        they are holes of the file)."""
        for index, chunk in self.ahead.items():
            self._unmap_ahead(chunk)
            start = index * CHUNK_SIZE
            if start < self.size:
                _punch_hole(self.fd, start, min(CHUNK_SIZE, self.size - start))
        self.ahead.clear()

    def _unmap_ahead(self, chunk: mmap.mmap) -> None:
        if self.before_unmap is not None:
            self.before_unmap(chunk)
        close_window(chunk)

    def open_readonly(self) -> int:
        """A new read-only open of the file (for a reader that must not write it)."""
        self.lent = True
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def identity(self) -> tuple[int, int]:
        """(st_dev, st_ino): what names this file in another process's fd of it."""
        st = os.fstat(self.fd)
        return st.st_dev, st.st_ino

    def seal_growth(self) -> None:
        """The file never grows again: a write past its end fails (EPERM) whoever makes it."""
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)

    def seal_writes(self) -> None:
        """No more writes to the file through any fd (a writer's kernel's included: EPERM),
        nor growing or shrinking it; mappings made before keep working."""
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                    _F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK)

    def open_readwrite(self) -> int:
        """A new read-write open of the file, for a writer's kernel to write it directly."""
        self.lent = True
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDWR | os.O_CLOEXEC)

    def close(self) -> None:
        """The memory goes once the windows are unmapped, unless another process still has
        the file open (hostd, for a passthrough handle): then when it closes it."""
        for chunk in self.ahead.values():
            self._unmap_ahead(chunk)
        self.ahead.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def close_window(chunk: mmap.mmap) -> None:
    """Unmaps a window, or leaves that to its last view: a view may outlive the tier's use
    of it (a failed download's traceback keeps its destination views until trio's worker
    thread runs again, after the fetch gave the content back). Nobody writes through such a
    view; the mapping only keeps the pages until it goes."""
    try:
        chunk.close()
    except BufferError:
        pass


_KEEP_SIZE = 0x01            # FALLOC_FL_KEEP_SIZE (os has none)
_PUNCH_HOLE = 0x02 | _KEEP_SIZE   # FALLOC_FL_PUNCH_HOLE


def _punch_hole(fd: int, offset: int, length: int) -> None:
    """Frees the pages of [offset, offset+length) (they read as zeros), size unchanged."""
    if _libc_fallocate(fd, _PUNCH_HOLE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _load_fallocate():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.fallocate
    fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    fn.restype = ctypes.c_int
    return fn


_libc_fallocate = _load_fallocate()

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int64)
_libc.mmap.restype = ctypes.c_void_p
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10   # linux/mman.h (Python's mmap module does not export it)
_F_SEAL_FUTURE_WRITE = 0x10   # linux/fcntl.h, 5.1+ (nor does fcntl)


def _window_past_eof(fd: int, offset: int) -> mmap.mmap:
    """A 1 MiB shared window of `fd` at `offset` that reaches past the file's end. Python's
    mmap refuses that (Linux maps it; only touching a page wholly past EOF faults), and
    growing the file for the call and shrinking it back would cut bytes another writer put
    there meanwhile (a writer's kernel writes the memfd directly: Store.backing). So: an
    anonymous window, with the file mapped over it in place (MAP_FIXED); closing the mmap
    object unmaps the range whatever it maps."""
    window = mmap.mmap(-1, CHUNK_SIZE)
    anchor = ctypes.c_char.from_buffer(window)
    try:
        address = ctypes.addressof(anchor)
        got = _libc.mmap(address, CHUNK_SIZE, mmap.PROT_READ | mmap.PROT_WRITE,
                         mmap.MAP_SHARED | _MAP_FIXED, fd, offset)
    finally:
        del anchor   # the exported buffer: the window can be closed again
    if got == _MAP_FAILED or got != address:
        err = ctypes.get_errno()
        window.close()
        raise OSError(err, f"mapping a window past the end of the file: {os.strerror(err)}")
    return window



class Chunks(list):
    """An object's chunks (None = a hole, zeros in the memfd too) and the memfd they are
    windows of (None until the first chunk of an empty object is taken). `fresh`: made by
    Tiers.take_content with a memfd that had no pages (not a spare's), which the kernel fills
    faster than a copy through the windows does (DmaEngine.to_new_file)."""

    __slots__ = ("memfd", "fresh")

    def __init__(self, chunks=(), memfd: Memfd | None = None):
        super().__init__(chunks)
        self.memfd = memfd
        self.fresh = False


class DramPool:
    def __init__(self, capacity: int, before_unmap=None, after_map=None, locks_pages=None):
        self.capacity = capacity - capacity % CHUNK_SIZE
        memory = physical_memory()
        if self.capacity > memory:
            # Chunks are mapped as they are needed, so this starts; a full tier would then be
            # swapped or killed by the OOM killer, taking every cached byte with it.
            log.warning("the DRAM tier (tiers.dram.size, %d MiB) is larger than this machine's "
                        "memory (%d MiB): it will never fill without the OOM killer stepping in",
                        self.capacity >> 20, memory >> 20)
        self._spares: list[Memfd] = []   # memfds with windows mapped ahead (map_ahead)
        self._freed: list[Memfd] = []    # freed objects' memfds, for map_ahead to zero
        self.ahead_chunks = 0            # map_ahead's budget: what may wait mapped ahead
        self._in_use = 0
        # Told before a chunk is unmapped (a DMA engine may hold a registration on it), and
        # after a chunk is mapped ahead, in map_ahead's worker thread (the engine may register
        # it then, off any request's path).
        self.before_unmap = before_unmap
        self.after_map = after_map
        # whether the engine may hold page-locks on chunks now (then no page under a chunk
        # in use may leave its file: Tiers.unlock_from, Memfd.clear_from)
        self.locks_pages = locks_pages or (lambda: False)
        self._taken = trio.Event()   # set by take(): map_ahead tops the spares up
        self._prepare_spares = False     # prepare_spares() asked, map_ahead not done yet
        self._unmapper = None            # unmap_behind's channel, while that task runs
        self._spares_prepared = False
        self.last_take = -1e9        # time.monotonic() of the last take

    @property
    def object_limit(self) -> int:
        return object_limit(self.capacity)

    @property
    def used_bytes(self) -> int:
        return self._in_use * CHUNK_SIZE

    @property
    def free_chunks(self) -> int:
        return self.capacity // CHUNK_SIZE - self._in_use

    @property
    def _free(self) -> list[mmap.mmap]:
        """The chunks mapped ahead and not taken yet (spares, and freed memfds to reuse)."""
        return [c for memfd in self._spares + self._freed for c in memfd.ahead.values()]

    def new_memfd(self, size: int | None = None) -> Memfd:
        """A memfd for an object's content, `size` bytes long, a spare's (pages faulted in
        ahead) where there is one. None: an empty object about to be written, which takes a
        spare as it is (zeros past the object's end, trimmed when it is complete)."""
        if self._spares and size != 0:
            self._taken.set()
            memfd = self._spares.pop()
            if size is not None:
                memfd.resize(size)
        else:
            memfd = Memfd(size or 0)
        memfd.length = size or 0
        return memfd

    def take(self, memfd: Memfd, index: int, over: bool = False) -> mmap.mmap | None:
        """Chunk `index` of the memfd, or None when the tier is full (the caller evicts and
        retries; `over`: counted past the capacity instead). It reads as what the memfd holds
        there: zeros for holes and fresh file space."""
        if self._in_use >= self.capacity // CHUNK_SIZE and not over:
            return None
        chunk = memfd.window(index)   # before counting it: mmap may fail (ENOMEM)
        self._in_use += 1
        self._taken.set()
        self.last_take = time.monotonic()
        return chunk

    def missing_chunks(self) -> int:
        """Chunks of the capacity not mapped yet (neither in use nor mapped ahead)."""
        return self.capacity // CHUNK_SIZE - self._in_use - len(self._free)

    def prepare_spares(self) -> None:
        """The engine began to want host memory prepared (a first CUDA region): map_ahead
        passes the spares mapped before that through after_map too, once, so that a copy
        into them pays no registration on the request's path."""
        if not self._spares_prepared:
            self._spares_prepared = self._prepare_spares = True
            self._taken.set()

    def add_spare(self, memfd: Memfd) -> None:
        """A memfd mapped ahead of need (map_ahead): kept while within the capacity."""
        memfd.before_unmap = self.before_unmap   # its windows may carry after_map's pins
        if self.missing_chunks() >= len(memfd.ahead):
            self._spares.append(memfd)
        else:
            memfd.close()

    def give_content(self, memfd: Memfd, chunks) -> None:
        """A whole content nobody else may read any more (no copy in progress, no other
        process holding the memfd). While map_ahead runs and what waits mapped ahead is
        within its budget, it is kept, zeroed there and taken again as a spare: fresh memory
        costs a page fault per 4 KiB on first touch (about 1.2 GiB/s on the 2-core VM, for a
        copy that runs near 10), and closing a populated memfd costs its unmapping and page
        freeing on the event loop; the anonymous free list this replaced paid neither twice.
        (One object may overshoot the budget: then map_ahead maps nothing new, and a steady
        state of one freed per one written never frees or faults.) Else the memfd is
        closed and its memory returns at once."""
        windows = {i: c for i, c in enumerate(chunks) if c is not None}
        self._in_use -= len(windows)
        # Never one that was lent: an application's mmap of a passthrough file maps this
        # memfd itself and outlives every handle; it must not see the next object's bytes.
        if (windows and memfd.fd >= 0 and not memfd.lent
                and 0 < self.ahead_chunks >= len(self._free)):
            end = (max(windows) + 1) * CHUNK_SIZE
            if memfd.size < end:   # every window inside the file: zeroing it cannot fault
                memfd.resize(end)
            # The windows keep a DMA engine's registrations (a CUDA page-lock): every way out
            # of `ahead` unmaps through before_unmap, and a copy into the reused window then
            # pays no registration (cuMemHostRegister of a 1 MiB window took ~70 us, and
            # cuMemHostUnregister ~45 us, on an H200 host: docs/benchmarks/gpu-notes.md).
            memfd.ahead.update(windows)
            memfd.before_unmap = self.before_unmap
            self._freed.append(memfd)
            self._taken.set()   # map_ahead zeroes it once takes pause
            return
        if self._unmapper is not None:
            self._unmapper.send_nowait((list(windows.values()), memfd))
            return
        self.close_content(list(windows.values()), memfd)

    def close_content(self, windows: list, memfd: Memfd) -> None:
        """Unmaps a freed content's windows and closes its memfd (blocking where an engine
        registered them: unmap_behind runs it in a worker thread)."""
        for chunk in windows:
            self._unmap(chunk)
        memfd.close()

    def give(self, chunk: mmap.mmap) -> None:
        self._in_use -= 1
        self._unmap(chunk)

    def _unmap(self, chunk: mmap.mmap) -> None:
        if self.before_unmap is not None:
            self.before_unmap(chunk)
        close_window(chunk)

    def close(self) -> None:
        for spare in self._spares + self._freed:
            spare.close()
        self._spares.clear()
        self._freed.clear()


_ZEROS = bytes(CHUNK_SIZE)
SPARE_CHUNKS = 32          # the windows of one spare memfd: a typical 32 MiB KV block
MAP_AHEAD_QUIET_S = 0.05   # a pause in takes this long lets map_ahead top the spares up


async def unmap_behind(pool: DramPool) -> None:
    """Closes freed contents in a worker thread instead of on the event loop: dropping the
    CUDA page-locks of one 32 MiB object's windows took ~1.4 ms and its munmap more on an
    H200 host (a FORGET's median was 3.1 ms, every other request waiting behind it). The
    tier counts the chunks free at once; their pages go back a moment later."""
    send, receive = trio.open_memory_channel(math.inf)
    pool._unmapper = send
    try:
        async for windows, memfd in receive:
            with trio.CancelScope(shield=True):   # one received is closed, cancelled or not
                await trio.to_thread.run_sync(pool.close_content, windows, memfd)
    finally:
        pool._unmapper = None
        while True:   # what was queued still goes (the pool may close next)
            try:
                windows, memfd = receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            pool.close_content(windows, memfd)


async def map_ahead(pool: DramPool, ahead_bytes: int) -> None:
    """Keeps at least `ahead_bytes` of chunks mapped and touched ahead of need, in spare
    memfds that new objects take, so that no request pays the page faults of fresh memory.
    It tops them up in a worker thread once takes pause for MAP_AHEAD_QUIET_S: mapping
    costs the CPU the kernel spends zeroing pages, which a burst of writes needs more.
    Memory committed: what is in use plus that much; `ahead_bytes` >= the capacity maps the
    whole tier at once."""
    ahead = pool.ahead_chunks = ahead_bytes // CHUNK_SIZE
    while True:
        if pool._prepare_spares and pool.after_map is not None:
            pool._prepare_spares = False
            # out of the pool while a worker thread prepares them: none is taken, and so
            # none unmapped, under its hands
            spares, pool._spares = pool._spares, []
            for spare in spares:
                await trio.to_thread.run_sync(prepare_windows, spare, pool.after_map)
            pool._spares = spares + pool._spares
        while pool._freed:
            freed = pool._freed.pop()
            await trio.to_thread.run_sync(zero_windows, freed, pool.after_map)
            pool.add_spare(freed)
        while (missing := min(pool.missing_chunks(), ahead - len(pool._free))) > 0:
            pool.add_spare(await trio.to_thread.run_sync(populated_memfd,
                                                         min(SPARE_CHUNKS, missing),
                                                         pool.after_map))
        pool._taken = trio.Event()
        await pool._taken.wait()
        # Until takes pause. Polled, not woken by each take: a burst takes a chunk per 1 MiB
        # written, and a wake-up (new Event, new cancel scope) for each was 7.7% of
        # bluecached's working samples under 8 llm-d writers (py-spy, 2-core Intel Xeon VM).
        while (quiet := time.monotonic() - pool.last_take) < MAP_AHEAD_QUIET_S:  # noqa: ASYNC110
            await trio.sleep(MAP_AHEAD_QUIET_S - quiet)


def prepare_windows(memfd: Memfd, after_map) -> None:
    """A spare's windows passed through the engine's after_map (blocking: a worker thread)."""
    for chunk in memfd.ahead.values():
        after_map(chunk)


def zero_windows(memfd: Memfd, after_map=None) -> None:
    """A freed object's memfd made a spare (blocking: a worker thread's job): its windows
    zeroed in place, a memory-speed copy instead of a page fault per 4 KiB."""
    for chunk in memfd.ahead.values():
        chunk[:] = _ZEROS
        if after_map is not None:
            after_map(chunk)
    memfd.length = 0


def populated_memfd(count: int, after_map=None) -> Memfd:
    """A spare memfd of `count` chunks whose pages the kernel has already supplied and mapped
    (blocking: a worker thread's job): a first write to fresh memory otherwise takes 256 page
    faults per chunk on the request's path. Its pages are 2 MiB ones where the shmem policy
    covers fallocate (`tiers.dram.huge_pages`: bluecached/huge_pages.py)."""
    memfd = Memfd(count * CHUNK_SIZE)
    with contextlib.suppress(OSError):   # where fallocate is refused, MAP_POPULATE faults
        os.posix_fallocate(memfd.fd, 0, count * CHUNK_SIZE)
    for index in range(count):
        memfd.ahead[index] = mmap.mmap(memfd.fd, CHUNK_SIZE, mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                       offset=index * CHUNK_SIZE)
        if after_map is not None:
            after_map(memfd.ahead[index])
    return memfd
