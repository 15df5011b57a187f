"""Where object bytes live: DRAM chunks, NVMe extents, and the moves between them.

An object in DRAM is a memfd of its own (tiers/dram.py); once hostd holds it as a passthrough
backing file (`StoredObject.backed`), nothing here replaces it with another: the object is
open, so eviction skips it, and promotion and remote fetches only fill objects not in DRAM.

Write-behind (DRAM -> NVMe), promotion (NVMe -> DRAM, checksum verified), eviction by
watermarks in LRU order, and the index journal that makes NVMe contents survive restarts.
Removing an object from the namespace is the store's business: the tiers ask it through
`remove_object`.
"""

import contextlib
import errno
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import trio

from .. import crc
from ..log_limit import LogLimiter
from ..namespace import FsError, Inode
from . import index
from .dram import CHUNK_SIZE, Chunks, DramPool, Memfd
from .journal import Journal
from .nvme import SegmentStore
from .objects import ZERO_CHUNK, StoredObject, chunk_count
from .promotion import Promotions, read_and_verify
from .read_lanes import READ_DEPTH, ReadLanes

log = logging.getLogger("bluecached.tiers")

WRITEBACK_STALL_S = 10  # a write waiting for write-behind re-checks at least this often
WRITEBACK_QUIET_S = 0.02      # write-behind waits for this long a pause in foreground writes
WRITEBACK_MAX_DEFER_S = 2.0   # ... but never longer than this per object
KNOWN_CRCS_MAX = 65536        # chunk CRCs kept for write-behind (a bound, not a working size)
WRITEBACK_BACKOFF_MIN_S = 0.1  # after a failed write-behind, the next waits this long,
WRITEBACK_BACKOFF_MAX_S = 5.0  # ... doubling up to this while they keep failing
FAILURE_LOG_S = 30.0           # write-behind failures are logged at most this often


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0   # served to readers straight from the tier (NVMe: direct, past_dram)
    clones: int = 0      # opens lent a clone of the object's NVMe extent (hit_path clone)
    clones_ahead: int = 0   # ... of them made at the lookup before the open (clone_ahead.py)
    past_dram: int = 0   # NVMe: reads served from the disk because DRAM had no room for them

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Watermarks:
    high: float
    low: float


@dataclass
class Counters:
    dram: TierStats = field(default_factory=TierStats)
    nvme: TierStats = field(default_factory=TierStats)
    checksum_failures: int = 0
    writeback_failures: int = 0
    tmp_collected: int = 0


def _crc_and_write(nvme: SegmentStore, extent, chunks: list, size: int,
                   crcs: bytes | None = None) -> bytes:
    """Worker thread: checksum each chunk (unless their CRCs are known), then write them all
    in one call."""
    bufs = [c if c is not None else ZERO_CHUNK for c in chunks]
    if crcs is None:
        crcs = crc.chunk_crcs([memoryview(b)[: min(CHUNK_SIZE, size - i * CHUNK_SIZE)]
                               for i, b in enumerate(bufs)], CHUNK_SIZE)
    nvme.write(extent, [memoryview(b) for b in bufs], size)
    nvme.sync()
    return crcs


def _write_behind_frees(node: Inode) -> bool:
    """Only DRAM holds it and write-behind will change that: dirty, no writer, named."""
    obj = node.obj
    return obj.dirty and not obj.writers and node.parent is not None


def _recency(node: Inode) -> int:
    """When the object was last used (read, opened, written), for eviction order."""
    return max(node.atime_ns, node.mtime_ns)


class Tiers:
    def __init__(self, dram: DramPool, dram_marks: Watermarks,
                 nvme: SegmentStore | None, nvme_marks: Watermarks,
                 journal: Journal | None, write_through: bool, journal_max_bytes: int,
                 remove_object):
        self.dram = dram
        self.dram_marks = dram_marks
        self.nvme = nvme
        self.nvme_marks = nvme_marks
        self.journal = journal
        self.write_through = write_through
        self.journal_max_bytes = journal_max_bytes
        self._remove_object = remove_object  # (inode, reason) -> None: the store unlinks it
        self.left_dram = lambda node: None    # a lent memfd left its object (Store.backing)
        self.stats = Counters()
        self.promotions = Promotions(self)   # streaming NVMe hits (run by the daemon)
        self.read_lanes = ReadLanes(READ_DEPTH)   # direct NVMe hits: reads on the disk at once
        self.lru_dram: OrderedDict[int, Inode] = OrderedDict()   # resident objects
        self.lru_nvme: OrderedDict[int, Inode] = OrderedDict()   # persisted objects
        self.dirty_bytes = 0
        self._wb_send, self._wb_recv = trio.open_memory_channel(float("inf"))
        self._space = trio.Event()       # set whenever chunks or extents were freed
        self._pressure = trio.Event()    # wakes the evictor
        self._last_write = -1e9
        self._known_crcs: dict[int, tuple[int, bytes]] = {}   # ino -> (version, chunk CRCs)
        self._wb_delay = 0.0            # write-behind's back-off after failures, and until when
        self._wb_resume = -1e9
        self._failure_log = LogLimiter(FAILURE_LOG_S)

    # -- journal ---------------------------------------------------------------------------

    def log(self, *records) -> None:
        """Appends records to the journal, all or none."""
        if self.journal is not None:
            try:
                self.journal.append_many(records)
            except OSError as e:   # the client hears why (ENOSPC above all), no traceback
                log.error("appending to the index journal failed: %s", e)
                raise FsError(e.errno or errno.EIO, f"index journal: {e.strerror}") from None

    # -- LRU and accounting ----------------------------------------------------------------

    def touch(self, node: Inode) -> None:
        obj = node.obj
        if obj.chunks is not None and node.ino in self.lru_dram:
            self.lru_dram.move_to_end(node.ino)
        if obj.persisted and node.ino in self.lru_nvme:
            self.lru_nvme.move_to_end(node.ino)

    def mark_resident(self, node: Inode) -> None:
        self.lru_dram[node.ino] = node
        self.maybe_pressure_dram()

    def _dram_above(self, mark: float) -> bool:
        """DRAM above `mark` of its capacity, in bytes or in objects. Every object in DRAM
        holds a memfd, and an empty file takes no bytes: 20,000 empty files once took every
        fd bluecached could open (EMFILE: each create after failed with EIO). So the count
        has a bound of its own, the one the open-file limit is raised for (allow_fds_for)."""
        dram = self.dram
        return (dram.used_bytes > mark * dram.capacity
                or len(self.lru_dram) > mark * dram.object_limit)

    def _signal_space(self) -> None:
        self._space.set()
        self._space = trio.Event()

    def give_chunks(self, obj: StoredObject, chunks) -> None:
        """Returns chunks to the pool, later if an operation still reads them. A whole
        content (Chunks) goes with its memfd: to the pool when nobody else may read it, else
        closed here: the pages live on while any window is mapped (a reader still copying)
        or another process holds the file (hostd, for a handle released after the object
        left DRAM)."""
        if isinstance(chunks, Chunks) and chunks.memfd is not None:
            if not obj.pins and not obj.backed:
                self.dram.give_content(chunks.memfd, chunks)
                self._signal_space()
                return
            chunks.memfd.close()
        chunks = [c for c in chunks if c is not None]
        if obj.pins:
            obj.deferred.extend(chunks)
            return
        for c in chunks:
            self.dram.give(c)
        if chunks:
            self._signal_space()

    def pin(self, obj: StoredObject) -> None:
        obj.pins += 1

    def unpin(self, obj: StoredObject) -> None:
        obj.pins -= 1
        if obj.pins == 0:
            if obj.deferred:
                deferred, obj.deferred = obj.deferred, []
                self.give_chunks(obj, deferred)
            self.fit_memfd(obj)
            if obj.unpinned is not None:
                obj.unpinned.set()
                obj.unpinned = None

    @staticmethod
    async def wait_unpinned(obj: StoredObject) -> None:
        """Until no copy reads the chunks. The caller holds the content lock, so no reader
        pins them meanwhile (readers pin under it)."""
        while obj.pins:
            if obj.unpinned is None:
                obj.unpinned = trio.Event()
            await obj.unpinned.wait()

    # -- the memfd's size ------------------------------------------------------------------

    def memfd_of(self, obj: StoredObject, size: int, spare: bool = True) -> Memfd:
        """The resident object's memfd, made for one that has no chunks yet (from a spare
        when it is about to be written); `size` is the object's (a file grown by truncation
        has one before it has any chunk)."""
        chunks = obj.chunks
        if chunks.memfd is None:
            chunks.memfd = self._new_memfd(None if spare else 0)
            self.set_length(obj, size)
        return chunks.memfd

    def _new_memfd(self, size: int | None) -> Memfd:
        try:
            return self.dram.new_memfd(size)
        except OSError as e:
            # Out of file descriptors (one per object: dram.allow_fds_for) or memory: to the
            # writer, the cache is full (ENOSPC), as a file system out of inodes or blocks.
            raise FsError(errno.ENOSPC, f"DRAM tier: no memfd for the object: {e}") from None

    def set_length(self, obj: StoredObject, size: int) -> None:
        """The object's size changed: its memfd follows (fit_memfd)."""
        memfd = obj.chunks.memfd if obj.chunks is not None else None
        if memfd is None:
            return
        shrinking = size < memfd.length
        memfd.length = size
        if shrinking and not self._may_trim(obj):
            # what was cut off reads as zeros at once
            memfd.clear_from(size, keep_pages=self.dram.locks_pages())
        self.fit_memfd(obj)

    @staticmethod
    def _may_trim(obj: StoredObject) -> bool:
        # Pinned: a copy may be touching the pages a shrink would cut (SIGBUS). Being written
        # and never lent: the rest of a spare is room for the writes to come (its pages
        # faulted in ahead), trimmed once the object is complete. Once lent, the kernel may
        # map it through any handle of the inode (or an application's mmap): exact always.
        return not obj.pins and (not obj.writers or obj.chunks.memfd.lent)

    def fit_memfd(self, obj: StoredObject) -> None:
        """Makes the memfd's size the object's, as soon as that is safe (a passthrough reader
        stops at the memfd's EOF, so it must not see more or less than the object)."""
        memfd = obj.chunks.memfd if obj.chunks is not None else None
        if memfd is None:
            return
        if obj.kernel_writer is not None:
            # The writer's kernel sets the size (Store.observe): grow only, never cut what it
            # wrote since; a truncation resizes it itself (Store._truncate).
            if memfd.size < memfd.length:
                try:
                    memfd.grow_to(memfd.length)
                except OSError as e:   # sealed: Store._bound_kernel_writes stopped it
                    raise FsError(errno.ENOSPC, f"the file cannot grow: {e.strerror}") from None
            return
        if memfd.size < memfd.length:
            memfd.resize(memfd.length)
        if not self._may_trim(obj):
            return
        if memfd.ahead and not obj.writers:   # complete: the spare's windows not taken go
            memfd.drop_ahead()                 # (holes of a sparse file among them)
        if memfd.size > memfd.length:
            self.unlock_from(obj, memfd.length)
            memfd.resize(memfd.length)

    def unlock_from(self, obj: StoredObject, offset: int) -> None:
        """The chunks from the one holding `offset` on drop an engine's page-locks before the
        memfd is cut there: a device keeps the pages it locked after the file lets them go,
        and a copy after the file grew again would move the old pages, not the file's bytes.
        (A later copy locks the chunk again, on the pages it has then.) Only where no copy
        runs: the caller made sure (_may_trim, or no pins)."""
        if self.dram.before_unmap is None or obj.chunks is None or not self.dram.locks_pages():
            return
        for chunk in obj.chunks[offset // CHUNK_SIZE:]:
            if chunk is not None:
                self.dram.before_unmap(chunk)

    def drop_dram(self, node: Inode) -> None:
        obj = node.obj
        if obj.chunks is not None:
            chunks, obj.chunks = obj.chunks, None
            self.give_chunks(obj, chunks)   # hostd's fd, if any, keeps the pages (an open handle)
            if chunks.memfd is not None and chunks.memfd.lent:
                self.left_dram(node)
        self.lru_dram.pop(node.ino, None)
        if obj.dirty:
            obj.dirty = False
            self.dirty_bytes -= node.size

    def unpersist(self, node: Inode) -> None:
        """The journal stops naming this content (DROP). The extent stays readable for handles
        still open on an unlinked file until `free_extent`."""
        obj = node.obj
        if obj.persisted:
            self.log(index.drop_record(node.ino))
            obj.persisted = False
        self.lru_nvme.pop(node.ino, None)

    def free_extent(self, node: Inode) -> None:
        obj = node.obj
        if obj.extent is not None:
            self.nvme.free(obj.extent)  # after the DROP: rule 2 in docs/architecture.md
            obj.extent = None
            self._signal_space()
        obj.crcs = b""

    def drop_nvme(self, node: Inode) -> None:
        self.unpersist(node)
        self.free_extent(node)

    def note_crcs(self, node: Inode, crcs: bytes) -> None:
        """The chunk CRCs of the object's current content, computed elsewhere (an upload, a
        checked fetch): write-behind uses them instead of a pass of its own."""
        if self.nvme is None:
            return
        if len(self._known_crcs) >= KNOWN_CRCS_MAX:
            self._known_crcs.clear()
        self._known_crcs[node.ino] = (node.obj.version, crcs)

    def forget(self, node: Inode) -> None:
        self._known_crcs.pop(node.ino, None)
        self.drop_dram(node)
        self.drop_nvme(node)

    def begin_modify(self, node: Inode) -> None:
        """The content is about to change: the NVMe copy is no longer this file's content."""
        obj = node.obj
        obj.version += 1
        if obj.persisted or obj.extent is not None:
            self.drop_nvme(node)
        if not obj.dirty:
            obj.dirty = True
            self.dirty_bytes += node.size

    def resize_dirty(self, node: Inode, new_size: int) -> None:
        if node.obj.dirty:
            self.dirty_bytes += new_size - node.size

    # -- DRAM space ------------------------------------------------------------------------

    def _evictable_dram(self, dirty_too: bool = False):
        for node in self.lru_dram.values():
            obj = node.obj
            if obj.busy:
                continue
            # An unlinked file only a kernel reference keeps: nobody can open it by name, and
            # it will never be written behind; its bytes may go.
            if self.nvme is None or not obj.dirty or node.parent is None or dirty_too:
                yield node

    def _evict_dram_one(self, dirty_too: bool = False) -> bool:
        """Evicts the least recently used object DRAM may let go of: clean ones (NVMe has
        them), or with `dirty_too` also those only DRAM holds (removed: a miss later)."""
        for node in self._evictable_dram(dirty_too):
            self.stats.dram.evictions += 1
            if node.obj.dirty or not node.obj.persisted:
                # No tier below holds it: evicting it from DRAM removes it.
                self._remove_object(node, "evicted from dram")
            else:
                self.drop_dram(node)
            return True
        return False

    def _writeback_can_help(self) -> bool:
        return self.nvme is not None and any(map(_write_behind_frees, self.lru_dram.values()))

    def bytes_write_behind_frees(self) -> int:
        """What DRAM holds of finished objects no other tier has: write-behind copies them to
        NVMe, and eviction can then free them (none without an NVMe tier)."""
        if self.nvme is None:
            return 0
        return sum(n.size for n in self.lru_dram.values() if _write_behind_frees(n))

    def adopt_windows(self, chunks: Chunks, indices) -> None:
        """As take_windows, for bytes a writer's kernel already put in the memfd: they are in
        memory whatever the tier says, so they are counted now, evicting what can go, and
        over the capacity if nothing can (write-behind and eviction bring it back)."""
        for i in indices:
            while (chunk := self._take(chunks.memfd, i)) is None:
                if not self._evict_dram_one():
                    chunk = self._take(chunks.memfd, i, over=True)
                    break
            chunks[i] = chunk
        self.maybe_pressure_dram()

    def room_for_kernel_writes(self, need: int) -> bool:
        """Whether `need` bytes fit in DRAM without waiting: free, or held by objects that
        can be evicted now (a writer's kernel is then given the memfd: Store.backing)."""
        room = self.dram.free_chunks * CHUNK_SIZE
        if room >= need:
            return True
        for node in self._evictable_dram():
            room += node.size
            if room >= need:
                return True
        return False

    async def take_windows(self, chunks: Chunks, indices) -> None:
        """Fills chunks[i] for each index with that window of their memfd (zeros), evicting to
        make room. ENOSPC only when nothing can be evicted: every resident object is open, in
        flight, or dirty with no NVMe room to go to. What was taken stays on failure."""
        for i in indices:
            while (chunk := self._take(chunks.memfd, i)) is None:
                if not self._evict_dram_one():
                    await self._wait_for_writeback()
            chunks[i] = chunk
        self.maybe_pressure_dram()

    def _take(self, memfd: Memfd, index: int, over: bool = False):
        try:
            return self.dram.take(memfd, index, over)
        except OSError as e:   # mapping it failed: out of memory, to the writer a full cache
            raise FsError(errno.ENOSPC, f"DRAM tier: cannot map a chunk: {e}") from None

    async def take_content(self, size: int) -> Chunks:
        """A new content of `size` bytes: a memfd that long and all its chunks (zeros)."""
        count = chunk_count(size)
        chunks = Chunks([None] * count, self._new_memfd(size))
        chunks.fresh = not chunks.memfd.ahead
        try:
            await self.take_windows(chunks, range(count))
        except BaseException:
            self.discard_content(chunks)
            raise
        return chunks

    def try_take_content(self, size: int) -> Chunks | None:
        """A new content of `size` bytes now (as take_content), evicting clean objects NVMe
        also holds (least recently used first) if need be, or None (nothing taken) where that
        would mean waiting: for speculative work (a prefetch) that must neither stall nor push
        out data no tier below holds."""
        count = chunk_count(size)
        try:
            chunks = Chunks([None] * count, self._new_memfd(size))
        except FsError:
            return None
        try:
            for i in range(count):
                while (chunk := self._take(chunks.memfd, i)) is None:
                    victim = next((n for n in self._evictable_dram()
                                   if not n.obj.dirty and n.obj.persisted), None)
                    if victim is None:
                        raise FsError(errno.ENOSPC, "DRAM tier full of what no tier below has")
                    self.stats.dram.evictions += 1
                    self.drop_dram(victim)
                chunks[i] = chunk
        except FsError:
            self.discard_content(chunks)
            return None
        self.maybe_pressure_dram()
        return chunks

    def discard_content(self, chunks: Chunks) -> None:
        """Gives back a content no object holds (nobody reads it)."""
        self.dram.give_content(chunks.memfd, chunks)
        self._signal_space()

    async def _wait_for_writeback(self) -> None:
        if self._writeback_can_help():
            failures = self.stats.writeback_failures
            self.kick_writeback_all()
            with trio.move_on_after(WRITEBACK_STALL_S):
                await self._space.wait()
            if self.stats.writeback_failures > failures:
                # The NVMe tier cannot take what DRAM holds (a full or failing disk): as
                # without an NVMe tier, the least recently used object goes (a miss later),
                # rather than the writer getting ENOSPC for space the cache can free.
                if not self._evict_dram_one(dirty_too=True):
                    raise FsError(errno.ENOSPC,
                                  "DRAM tier is full of data the NVMe tier cannot take")
        elif any(n.obj.busy and not n.obj.opens for n in self.lru_dram.values()):
            await trio.sleep(0.005)  # a write-behind or promotion is finishing: retry soon
        else:
            raise FsError(errno.ENOSPC, "DRAM tier is full of open or in-flight objects")

    # -- promotion (NVMe -> DRAM) ----------------------------------------------------------

    async def promote(self, node: Inode, *, wait: bool = True) -> bool:
        """Makes a persisted object resident. Caller holds the object's content lock. With
        `wait` False (a reader's promotion), only if DRAM has room now or clean objects NVMe
        also holds to evict (try_take_content): False, nothing done, where it has not. A
        reader is then served from NVMe (Store._read_past_dram) rather than waiting for
        write-behind, or having an object only DRAM holds removed for bytes NVMe has."""
        obj = node.obj
        if obj.chunks is not None:
            self.stats.dram.hits += 1
            return True
        self.stats.dram.misses += 1
        if obj.extent is None and node.size:
            raise FsError(errno.EIO, f"inode {node.ino} has no content in any tier")
        if wait:
            chunks = await self.take_content(node.size)
        elif (chunks := self.try_take_content(node.size)) is None:
            return False
        if obj.extent is None:  # an empty file
            obj.chunks = chunks
            self.mark_resident(node)
            return True
        self.pin(obj)
        try:
            bad = await trio.to_thread.run_sync(
                read_and_verify, self.nvme, obj.extent, chunks, node.size, obj.crcs)
        except OSError as e:
            self.unpin(obj)
            self.discard_content(chunks)
            log.error("reading inode %d from NVMe failed: %s", node.ino, e)
            raise FsError(errno.EIO, f"NVMe read failed: {e}") from None
        self.unpin(obj)
        if bad >= 0:
            self.discard_content(chunks)
            self.stats.checksum_failures += 1
            log.error("checksum mismatch in inode %d (%s) chunk %d: object removed",
                      node.ino, node.name, bad)
            self.drop_corrupt(node)
            raise FsError(errno.EIO, "checksum mismatch: object removed")
        self.stats.nvme.hits += 1
        obj.chunks = chunks
        self.mark_resident(node)
        return True

    def drop_corrupt(self, node: Inode) -> None:
        """An object whose bytes failed their checksum: no name shows it again."""
        self._remove_object(node, "checksum mismatch")

    # -- write-behind (DRAM -> NVMe) -------------------------------------------------------

    def queue_writeback(self, node: Inode) -> None:
        obj = node.obj
        if self.nvme is None or obj.queued or not obj.dirty or obj.writers:
            return
        obj.queued = True
        self._wb_send.send_nowait(node)

    def kick_writeback_all(self) -> None:
        for node in list(self.lru_dram.values()):
            self.queue_writeback(node)

    async def _allocate_extent(self, length: int, for_node: Inode):
        while True:
            extent = self.nvme.allocate(length)
            if extent is not None:
                return extent
            if not self._evict_nvme_one(older_than=_recency(for_node)):
                return None

    def _evict_nvme_one(self, older_than: int | None = None) -> bool:
        """Evicts the least recently used object NVMe holds; with `older_than`, only one used
        less recently than that: an old object's write-behind (one that waited while the disk
        was full, say) must not push out newer ones; it stays in DRAM, first in line there."""
        for node in self.lru_nvme.values():
            if node.obj.busy:
                continue
            if older_than is not None and _recency(node) > older_than:
                return False
            self.stats.nvme.evictions += 1
            self._remove_object(node, "evicted from nvme")
            return True
        return False

    async def writeback(self, node: Inode, kernel_writer_seen: bool = False) -> bool:
        """Writes an object's DRAM content to NVMe. False if it changed meanwhile or no space.
        An object a writer's kernel is writing is left for its release (which queues it):
        its chunks are mapped only as they are looked at (Store.observe), and a chunk not
        mapped yet would be written as a hole; fsync looks first (`kernel_writer_seen`)."""
        obj = node.obj
        if not obj.dirty or obj.chunks is None or node.parent is None:
            return False  # an unlinked file needs no persisting
        if obj.kernel_writer is not None and not kernel_writer_seen:
            return False
        version, size = obj.version, node.size
        chunks = list(obj.chunks[: chunk_count(size)])
        chunks += [None] * (chunk_count(size) - len(chunks))
        if size > self.nvme.max_extent:
            # The store refuses such sizes; this object came another way (an older
            # configuration's DRAM, a remote object). It stays in DRAM rather than fail forever.
            return self._writeback_failed(
                node, f"it is larger than an NVMe segment ({self.nvme.max_extent} bytes)")
        known = self._known_crcs.pop(node.ino, None)
        known = known[1] if known is not None and known[0] == version else None
        for attempt in (1, 2):
            extent = None
            if size:
                extent = await self._allocate_extent(size, node)
                if extent is None:
                    return self._writeback_failed(node, f"no NVMe space for {size} bytes")
            self.pin(obj)
            try:
                crcs = b""
                if extent is not None:
                    crcs = await trio.to_thread.run_sync(
                        _crc_and_write, self.nvme, extent, chunks, size, known)
                break
            except OSError as e:
                self.nvme.free(extent)
                if e.errno == errno.ENOSPC and attempt == 1:
                    self._nvme_disk_full()   # the retry's allocation evicts to fit
                    continue
                return self._writeback_failed(node, f"write-behind failed: {e}")
            finally:
                self.unpin(obj)
        self._wb_delay = 0.0
        if obj.version != version or not obj.dirty or node.parent is None:
            if extent is not None:
                self.nvme.free(extent)
            return False
        try:
            # a file with hard links: all its names with its content, or none of them
            self.log(index.file_record(node, extent, crcs),
                     *((index.names_record(node),) if node.extra is not None else ()))
        except FsError as e:   # not recorded: the copy does not count
            if extent is not None:
                self.nvme.free(extent)
            return self._writeback_failed(node, str(e))
        obj.extent, obj.crcs, obj.persisted = extent, crcs, True
        if obj.remote_version == version:   # uploaded (or fetched) before it reached NVMe
            with contextlib.suppress(FsError):   # a missing mark costs an upload, no more
                self.log(index.remote_record(node.ino))
        obj.dirty = False
        self.dirty_bytes -= size
        self.lru_nvme[node.ino] = node
        self.stats.nvme.bytes_in += size
        self._signal_space()
        self.maybe_pressure_dram()   # it may go now (empty files: by count)
        self.maybe_pressure_nvme()
        if self.journal is not None and self.journal.durable:
            # The record counts once it is durable; bookkeeping is done above, so nothing
            # that runs meanwhile (an unlink, an eviction) sees a half-updated object.
            await trio.to_thread.run_sync(self.journal.sync)
        return True

    def _writeback_failed(self, node: Inode, why: str) -> bool:
        """Counts a failed write-behind (the object stays dirty in DRAM), backs write-behind
        off, and says so at most once per FAILURE_LOG_S (a full disk fails every attempt)."""
        self.stats.writeback_failures += 1
        self._signal_space()   # writers waiting for DRAM re-check (and may get ENOSPC)
        self._wb_delay = min(max(WRITEBACK_BACKOFF_MIN_S, 2 * self._wb_delay),
                             WRITEBACK_BACKOFF_MAX_S)
        self._wb_resume = trio.current_time() + self._wb_delay
        note = self._failure_log.allow()
        if note is not None:
            log.warning("inode %d stays in DRAM: %s%s", node.ino, why, note)
        return False

    def _nvme_disk_full(self) -> None:
        """ENOSPC from the filesystem under the tier (smaller than configured, or shared and
        filled by others): the tier's capacity shrinks to what it holds now, so allocations
        evict older objects and reuse their blocks instead of asking the disk for more."""
        nvme = self.nvme
        before = nvme.capacity
        try:
            fit = nvme.fit_to_disk()
        except OSError:
            fit = before
        nvme.capacity = min(fit, nvme.used_bytes)
        nvme.capacity -= nvme.capacity % 4096
        if nvme.capacity < before:
            log.warning("the filesystem under the NVMe tier is full: the tier now holds at most "
                        "%d MiB (was %d MiB); older objects are evicted to make room",
                        nvme.capacity >> 20, before >> 20)
        self._pressure.set()

    def refit_nvme(self) -> None:
        """Gives a tier shrunk by a full disk back the room the filesystem has again."""
        nvme = self.nvme
        if nvme is None or nvme.capacity >= nvme.span:
            return
        before = nvme.capacity
        try:
            after = nvme.fit_to_disk()
        except OSError:
            return
        if after > before:
            log.info("the NVMe tier may hold %d MiB again (was %d MiB)", after >> 20, before >> 20)
        else:
            nvme.capacity = before   # shrunk below the free space by an ENOSPC: keep that

    def maybe_pressure_dram(self) -> None:
        if self._dram_above(self.dram_marks.high):
            self._pressure.set()

    def maybe_pressure_nvme(self) -> None:
        if self.nvme and self.nvme.used_bytes > self.nvme_marks.high * self.nvme.capacity:
            self._pressure.set()

    def note_foreground_write(self) -> None:
        self._last_write = trio.current_time()

    async def _yield_to_writers(self, obj: StoredObject) -> None:
        """Write-behind is later by definition: while writes are arriving, or the object is
        being uploaded to the remote tier, and DRAM has room (bytes and objects), it waits
        (bounded), so checksums
        and disk writes do not take the CPU a store or an upload needs."""
        waited = 0.0
        while ((trio.current_time() - self._last_write < WRITEBACK_QUIET_S
                or obj.uploading is not None)
               and not self._dram_above(self.dram_marks.low)
               and waited < WRITEBACK_MAX_DEFER_S):
            await trio.sleep(WRITEBACK_QUIET_S)
            waited += WRITEBACK_QUIET_S

    async def writeback_worker(self) -> None:
        async for node in self._wb_recv:
            node.obj.queued = False
            if node.obj.writers or not node.obj.dirty:
                continue  # queued again at its last release, or already written
            await trio.sleep_until(self._wb_resume)   # backing off after failures
            await self._yield_to_writers(node.obj)
            async with node.obj.content_lock():
                node.obj.lock_reads = True   # changes wait; reads of the chunks need not
                try:
                    await self.writeback(node)
                except Exception:
                    # A bug here must not take the daemon down with every object only DRAM
                    # holds: the object stays dirty in DRAM, the failure is counted and shown.
                    self.stats.writeback_failures += 1
                    log.exception("write-behind of inode %d failed unexpectedly", node.ino)
                finally:
                    node.obj.lock_reads = False

    # -- eviction by watermarks ------------------------------------------------------------

    def evict_to_watermarks(self) -> None:
        """A tier above its high watermark is evicted down to its low one (hysteresis: a tier
        between the two is left alone)."""
        nvme = self.nvme
        if self._dram_above(self.dram_marks.high):
            while self._dram_above(self.dram_marks.low):
                if not self._evict_dram_one():
                    self.kick_writeback_all()
                    break
        if nvme and nvme.used_bytes > self.nvme_marks.high * nvme.capacity:
            while nvme.used_bytes > self.nvme_marks.low * nvme.capacity:
                if not self._evict_nvme_one():
                    break

    async def evictor(self) -> None:
        while True:
            await self._pressure.wait()
            self._pressure = trio.Event()
            self.evict_to_watermarks()
            await trio.lowlevel.checkpoint()
