"""The cache as its clients see it: POSIX-like operations over the namespace and the tiers.

Every method raises FsError with the errno the client should see. Bulk bytes move only through
the DMA engine, between a client's registered region and the object's chunks.
"""

import contextlib
import errno
import logging
import mmap
import os
import stat
import time
from dataclasses import dataclass
from typing import NamedTuple

import trio

from . import crc, xattrs
from .log_limit import LogLimiter
from .namespace import ROOT_INO, TMP_SUFFIX, FsError, Inode, Namespace
from .tiers import index
from .tiers.dram import CHUNK_SIZE, PAGE_SIZE, Chunks, close_window
from .tiers.objects import StoredObject, chunk_count, views
from .tiers.placement import WRITEBACK_STALL_S, Tiers
from .tiers.promotion import read_checked

log = logging.getLogger("bluecached.store")

MAX_FILE_SIZE = 1 << 40   # without an NVMe tier; with one, an object is one extent (see below)
# A writer's kernel is given the memfd only while this much (or a quarter of the tier) fits
# in DRAM without waiting: its writes are counted after the fact (Store.observe).
KERNEL_WRITE_ROOM = 64 << 20
# How often the kernel writers' memfds are looked at: a writer can overshoot a file's size
# limit or the DRAM tier by what it writes in this time before its memfd stops growing.
KERNEL_WRITE_WATCH_S = 0.02
INODE_LIMIT = 1 << 32   # what statfs reports as the inode total
PAST_DRAM_LOG_S = 30.0   # reads served past a full DRAM tier are logged at most this often


@dataclass(slots=True)
class Handle:
    fh: int
    node: Inode
    writable: bool
    session: int
    backed: bool = False   # its client holds the object's memfd (`backing`)
    unbuffered: bool = False   # opened O_DIRECT: its reads bypass the page cache
    # a kernel writer's: its memfd's (size, mtime) at its client's last close (FLUSH)
    closed_as: tuple[int, int] | None = None


class Lent(NamedTuple):
    """A backing file lent for a read-only open (Store.backing_loaded)."""
    fd: int
    size: int
    # True: the object's memfd, which names the file's bytes as long as bluecached says so
    # (hostd may keep it: hostd/kept_backings.py). False: a clone of its NVMe extent, the
    # bytes as they were at this open, for this open's handles only.
    keepable: bool = True


def _writable(flags: int) -> bool:
    return (flags & os.O_ACCMODE) in (os.O_WRONLY, os.O_RDWR)


class Store:
    def __init__(self, tiers: Tiers, engine, publish=lambda event, **fields: None,
                 tmp_max_age: float = 3600.0, clock=time.time_ns):
        self.tiers = tiers
        self.engine = engine
        self.publish = publish
        # a memfd a client may keep past its handles left the object: it is to let it go
        tiers.left_dram = lambda node: self.publish("left-dram", ino=node.ino)
        self.tmp_max_age = tmp_max_age
        self.clock = clock
        self.boot = 1
        self._ino_counter = 0
        self.ns = Namespace(self._new_ino, clock, issued_now=self._issued_now)
        self.handles: dict[int, Handle] = {}
        # Inodes some client's kernel still holds (looked up, not yet forgotten): a file
        # unlinked or replaced by rename stays openable until then, as on a local disk.
        self.kernel_refs: dict[int, int] = {}
        self._next_fh = 1
        self.tmp_inos: set[int] = set()
        self.kernel_writers: dict[int, Inode] = {}   # written by a client's kernel (observe)
        # session: whether its last read-only open was O_DIRECT (vLLM's reader), for what its
        # lookups ready (ready_open)
        self._unbuffered_readers: dict[int, bool] = {}
        self._kernel_writers_changed = trio.Event()
        # persisted objects a writer may have changed through a shared mapping (check_mapped)
        self._mapped_send, self._mapped_receive = trio.open_memory_channel(float("inf"))
        # (since, write-behind failures then) while kernel writers hold DRAM past its capacity
        self._over_dram_since: tuple[float, int] | None = None
        self._past_dram_log = LogLimiter(PAST_DRAM_LOG_S)
        self.logical_bytes = 0
        self.remote = None   # a RemoteTier when configured (compose.add_remote_tier sets it)
        self.kv_events = None   # a KvEvents when kv_events.enabled (the daemon sets it)
        # An object lives in one NVMe extent, which never crosses a segment: a file larger than
        # a segment could never be written behind, so it is refused when it would grow past
        # one (EFBIG, as a file system refuses a file past its maximum size), not later.
        largest = tiers.nvme.max_extent if tiers.nvme is not None else MAX_FILE_SIZE
        self.max_file_size = min(MAX_FILE_SIZE, largest)

    # -- start and stop --------------------------------------------------------------------

    def _new_ino(self) -> int:
        self._ino_counter += 1
        return (self.boot << index.INO_BOOT_SHIFT) | self._ino_counter

    def _issued_now(self, ino: int) -> bool:
        return ino >> index.INO_BOOT_SHIFT == self.boot

    def load(self, last_boot: int = 0) -> dict:
        """Rebuilds the namespace from the journal. This run's boot (in its inode numbers) is
        one past the journal's and `last_boot` (the state directory's: bluecached/boots.py).
        Returns a summary for the log."""
        t0 = time.monotonic()
        journal = self.tiers.journal
        records = journal.load() if journal else []
        replayed = index.replay(self.ns, records)
        self.boot = max(replayed.boot, last_boot) + 1
        self.tiers.log((index.BOOT, self.boot))
        files = replayed.files
        if self.tiers.nvme is not None:
            self.tiers.nvme.rebuild([e for _, e, _ in files.values() if e is not None])
        by_atime = []
        for ino, (size, extent, crcs) in files.items():
            node = self.ns.inodes[ino]
            obj = node.obj = StoredObject()
            obj.chunks = None
            obj.extent, obj.crcs, obj.persisted = extent, crcs, True
            if ino in replayed.remote:
                obj.remote_version = obj.version
            self.logical_bytes += size
            self._note_name(node)
            by_atime.append(node)
        by_atime.sort(key=lambda n: n.atime_ns)
        for node in by_atime:
            self.tiers.lru_nvme[node.ino] = node
        summary = {"files": len(files), "inodes": len(self.ns.inodes), "records": len(records),
                   "skipped": replayed.skipped, "seconds": round(time.monotonic() - t0, 3)}
        log.info("index rebuilt: %(files)d files, %(inodes)d inodes from %(records)d records "
                 "in %(seconds).2fs", summary)
        return summary

    async def flush_all(self) -> None:
        """Writes every dirty object behind (SIGTERM path: everything persisted), except a
        file a client's kernel is writing that holds no version its writer finished
        (_writer_unfinished): as after a crash, that stays its last fsync, or nothing."""
        if self.tiers.nvme is None:
            return
        while True:   # mapped writers let go of just now: checked first, so they are dirty
            try:
                await self._check_mapped(self._mapped_receive.receive_nowait())
            except trio.WouldBlock:
                break
        unfinished = set()
        for node in list(self.tiers.lru_dram.values()):
            obj = node.obj
            if obj.kernel_writer is not None and self._writer_unfinished(obj.kernel_writer):
                unfinished.add(node.ino)
            elif obj.dirty and node.parent is not None:
                async with obj.content_lock():
                    try:
                        self.observe(node, chunks=True)   # a closed kernel writer's bytes
                        await self.tiers.writeback(node, kernel_writer_seen=True)
                    except Exception:   # the rest still deserve their chance
                        log.exception("persisting inode %d failed", node.ino)
        if unfinished:
            log.warning("%d files being written by a client's kernel are not persisted with "
                        "this stop: their writers' closes fail (EIO), as after a crash",
                        len(unfinished))
        lost = [n for n in self.tiers.lru_dram.values()
                if n.obj.dirty and n.parent is not None and n.ino not in unfinished]
        if lost:
            log.error("%d files (%d MiB) held only in DRAM could not be written to NVMe and are "
                      "lost with this stop (see the write-behind messages above for why)",
                      len(lost), sum(n.size for n in lost) >> 20)

    def _snapshot(self) -> list:
        persisted = {n.ino: (n.obj.extent, n.obj.crcs)
                     for n in self.tiers.lru_nvme.values() if n.obj.persisted}
        remote = {ino for ino in persisted
                  if self.ns.inodes[ino].obj.remote_version == self.ns.inodes[ino].obj.version}
        return index.snapshot_records(self.ns, persisted, self.boot, remote)

    def checkpoint(self) -> None:
        """Snapshot the index now (shutdown)."""
        if self.tiers.journal is None:
            return
        try:
            self.tiers.journal.checkpoint(self._snapshot())
        except OSError as e:
            # Nothing is lost: the journals the snapshot would have replaced stay, and the next
            # start replays them (slower).
            log.error("could not write the index snapshot (%s); the journal keeps every record "
                      "and the next start replays it", e)

    async def checkpoint_in_background(self) -> None:
        """Snapshot while serving: switching journals and capturing the state happen together
        on the event loop; writing the snapshot happens in a worker thread."""
        journal = self.tiers.journal
        journal.checkpoint_begin()
        records = self._snapshot()
        await trio.to_thread.run_sync(journal.checkpoint_finish, records)

    # -- helpers ---------------------------------------------------------------------------

    def _note_name(self, node: Inode) -> None:
        """A file whose every name ends in .tmp is a writer's temporary (collect_orphans)."""
        names = node.names()
        if node.obj is not None and names and all(n.endswith(TMP_SUFFIX) for _, n in names):
            self.tmp_inos.add(node.ino)
        else:
            self.tmp_inos.discard(node.ino)

    def _handle(self, fh: int) -> Handle:
        try:
            return self.handles[fh]
        except KeyError:
            raise FsError(errno.EBADF, f"no open handle {fh}") from None

    def _file(self, ino: int) -> Inode:
        node = self.ns.get(ino)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        if node.obj is None:   # the kernel opens these itself (FIFOs, devices) or follows them
            raise FsError(errno.ELOOP if stat.S_ISLNK(node.mode) else errno.ENXIO,
                          "not a regular file")
        return node

    def _check_size(self, size: int) -> None:
        if size > self.max_file_size:
            raise FsError(errno.EFBIG, f"a file here holds at most {self.max_file_size} bytes "
                                       f"(the NVMe tier's segment size): {size} asked")

    def _set_size(self, node: Inode, size: int) -> None:
        self.tiers.resize_dirty(node, size)
        self.tiers.set_length(node.obj, size)
        self.logical_bytes += size - node.size
        node.size = size

    def _maybe_destroy(self, node: Inode) -> None:
        """An unlinked file goes away with its last handle and its last kernel reference."""
        if node.parent is not None or node.ino in self.kernel_refs:
            return
        if node.is_meta:
            self.ns.forget(node)
        elif node.obj is not None and not node.obj.opens:
            self.tiers.forget(node)
            self.logical_bytes -= node.size
            self.tmp_inos.discard(node.ino)
            self.ns.forget(node)

    def _unlinked(self, node: Inode) -> None:
        """Bookkeeping after a file lost its name (unlink, rename-replace, eviction)."""
        if node.obj is not None:
            self.tiers.unpersist(node)
        elif node.is_meta:   # journaled since its creation
            self.tiers.log(index.drop_record(node.ino))
        self.tmp_inos.discard(node.ino)
        self._maybe_destroy(node)

    def remove_object(self, node: Inode, reason: str) -> None:
        """The cache itself removes a file (eviction, checksum failure, orphan collection):
        its names go, every one (no name may point at bytes that are gone), and hosts are
        told so they drop what their kernels cached."""
        names = node.names()
        for parent, name in names:
            self.ns.unlink(parent, name)
        if node.obj is not None:
            node.obj.removed = reason
        self.tiers.forget(node)
        self._unlinked(node)
        for parent, name in names or [(None, None)]:
            self.publish("removed", ino=node.ino, parent=parent, name=name, reason=reason)
        for parent, name in names:
            self._kv_event(parent, name, reason)

    def _kv_event(self, parent: int, name: bytes, removed: str | None = None) -> None:
        """KV events (kv_events.py) for a name a block file got or lost (`removed`: why)."""
        if self.kv_events is None or not name.endswith(b".bin"):
            return
        path = self.ns.path_of(self.ns.inodes[parent]).rstrip(b"/") + b"/" + name
        if removed is None:
            self.kv_events.stored(path)
        else:
            self.kv_events.removed(path, removed)

    # -- namespace operations --------------------------------------------------------------

    def lookup(self, parent: int, name: bytes) -> Inode:
        return self.ns.lookup(parent, name)

    async def find(self, parent: int, name: bytes) -> Inode:
        """A client's lookup: the namespace, then the remote tier (a miss stays ENOENT)."""
        try:
            node = self.ns.lookup(parent, name)
            self.observe(node)
            if node.parent is None:   # its kernel writer was stopped just now: names gone
                raise FsError(errno.ENOENT, "removed")
            return node
        except FsError as e:
            if e.errno != errno.ENOENT or self.remote is None:
                raise
        return await self.remote.lookup(parent, name)

    def mkdir_like_parent(self, parent: int, name: bytes) -> Inode:
        """A directory the remote tier has: owned and permissioned like its parent."""
        p = self.ns.get(parent)
        return self.mkdir(parent, name, p.mode, p.uid, p.gid)

    def add_placeholder(self, parent: int, name: bytes, info) -> Inode:
        """A file the remote tier has: its size now, its bytes on first read (`_load`)."""
        if info.size > self.max_file_size:   # could never be cached here: a miss
            raise FsError(errno.ENOENT, f"the remote object is larger ({info.size} bytes) than "
                                        f"a file here can be ({self.max_file_size})")
        p = self.ns.get(parent)
        node = self.ns.add(parent, name, stat.S_IFREG | 0o644, p.uid, p.gid)
        node.size = info.size
        node.mtime_ns = node.ctime_ns = int(info.mtime * 1e9)
        obj = node.obj = StoredObject()
        obj.chunks = None
        obj.remote_info = info
        obj.remote_version = obj.version
        self.logical_bytes += info.size
        return node

    async def _load(self, node: Inode, wait: bool = True) -> bool:
        """Makes the content resident: from NVMe, or from the remote tier. Caller holds the
        content lock. Not `wait`ing (a reader), False where DRAM has no room for it from NVMe
        now (Tiers.promote); a fetch from the remote tier always waits for its room."""
        if node.obj.remote_info is not None:
            await self.remote.fetch(node)
            return True
        return await self.tiers.promote(node, wait=wait)

    @staticmethod
    async def _wait_upload(obj: StoredObject) -> None:
        """An upload reads the chunks in place: changing them waits until it is done."""
        while obj.uploading is not None:
            await obj.uploading.wait()

    def getattr(self, ino: int) -> Inode:
        node = self.ns.get(ino)
        self.observe(node)
        return node

    async def setattr(self, ino: int, size: int | None = None, mode: int | None = None,
                      uid: int | None = None, gid: int | None = None,
                      atime_ns: int | None = None, mtime_ns: int | None = None,
                      atime_now: bool = False, mtime_now: bool = False) -> Inode:
        node = self.ns.get(ino)
        self.observe(node)
        now = self.clock()
        if size is not None:
            if node.is_dir:
                raise FsError(errno.EISDIR)
            if node.obj is None:
                raise FsError(errno.EINVAL, "only a regular file has a size to change")
            if size < 0:
                raise FsError(errno.EINVAL, "negative size")
            self._check_size(size)
            self._kernel_refusal(node)
            await self._truncate(node, size)
            node.mtime_ns = now
        if mode is not None:
            node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(mode)
        if uid is not None:
            node.uid = uid
        if gid is not None:
            node.gid = gid
        if atime_now or atime_ns is not None:
            node.atime_ns = now if atime_now else atime_ns
            if node.obj is not None:
                self.tiers.touch(node)  # an explicit atime update is an access (llm-d dedup)
        if mtime_now or mtime_ns is not None:
            node.mtime_ns = now if mtime_now else mtime_ns
        node.ctime_ns = now
        if node.obj is None or node.obj.persisted:   # directories, symlinks, special files
            self.tiers.log(index.dir_record(node) if node.is_dir else index.attr_record(node))
        return node

    async def _truncate(self, node: Inode, size: int) -> None:
        obj = node.obj
        async with obj.content_lock():
            # A kernel writer's size first: an O_TRUNC open beside it found the size from
            # before its writes (0) and cut nothing (found by a probe).
            self.observe(node)
            if size == node.size:
                return
            if size and obj.chunks is None:
                await self._load(node)
            await self._wait_upload(obj)
            obj.remote_info = None
            self.tiers.begin_modify(node)
            if obj.chunks is None:
                obj.chunks = Chunks()
                self.tiers.mark_resident(node)
            keep = chunk_count(size)
            if size < node.size:
                dropped = obj.chunks[keep:]
                del obj.chunks[keep:]
                self.tiers.give_chunks(obj, dropped)
            # In place, never a new memfd (a passthrough reader may hold this one): past the
            # new EOF reads as zeros because the memfd is cut there (Tiers.set_length).
            self._set_size(node, size)
            if obj.kernel_writer is not None:   # the one cut a kernel writer's memfd gets
                if not obj.pins:
                    self.tiers.unlock_from(obj, size)
                obj.chunks.memfd.resize(size)
                obj.kernel_seen = _seen(obj.chunks.memfd.fd)
        self.tiers.queue_writeback(node)

    def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        node = self.ns.add(parent, name, stat.S_IFDIR | stat.S_IMODE(mode), uid, gid)
        self.tiers.log(index.dir_record(node))
        return node

    def _make_meta(self, parent: int, name: bytes, mode: int, uid: int, gid: int,
                   rdev: int = 0, target: bytes | None = None) -> Inode:
        node = self.ns.add(parent, name, mode, uid, gid, rdev=rdev, target=target)
        try:
            self.tiers.log(index.node_record(node))
        except FsError:   # not recorded: not made
            self.ns.unlink(parent, name)
            self.ns.forget(node)
            raise
        return node

    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        """A symlink: its target is all there is, kept in the index (no object, no tier)."""
        return self._make_meta(parent, name, stat.S_IFLNK | 0o777, uid, gid, target=target)

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int,
              gid: int) -> Inode:
        """A FIFO, socket or character/block device node: attributes only, in the index."""
        if stat.S_IFMT(mode) not in (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK):
            raise FsError(errno.EINVAL, f"mknod makes FIFOs, sockets and devices, not "
                                        f"{stat.S_IFMT(mode):#o}")
        return self._make_meta(parent, name, stat.S_IFMT(mode) | stat.S_IMODE(mode), uid, gid,
                               rdev=rdev)

    def readlink(self, ino: int) -> bytes:
        node = self.ns.get(ino)
        if not stat.S_ISLNK(node.mode):
            raise FsError(errno.EINVAL, "not a symlink")
        return node.target

    def _open(self, node: Inode, flags: int, session: int) -> Handle:
        fh = self._next_fh
        self._next_fh += 1
        handle = Handle(fh, node, _writable(flags), session,
                        unbuffered=bool(flags & os.O_DIRECT))
        self.handles[fh] = handle
        if not handle.writable:
            self._unbuffered_readers[session] = handle.unbuffered
        obj = node.obj
        obj.opens += 1
        if handle.writable:
            obj.writers += 1
        node.atime_ns = self.clock()
        self.tiers.touch(node)
        return handle

    async def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int,
                     flags: int, session: int = 0) -> Handle:
        try:
            node = self.ns.add(parent, name, stat.S_IFREG | stat.S_IMODE(mode), uid, gid)
        except FsError as e:
            # Another host (or a race) created it first: plain O_CREAT opens it.
            if e.errno != errno.EEXIST or flags & os.O_EXCL:
                raise
            return await self.open(self.ns.lookup(parent, name).ino, flags, session)
        node.obj = StoredObject()
        node.obj.dirty = True
        self.tiers.mark_resident(node)
        self._note_name(node)
        return self._open(node, flags, session)

    async def open(self, ino: int, flags: int, session: int = 0) -> Handle:
        node = self._file(ino)
        obj = node.obj
        if obj.removed is not None:
            # The cache removed it behind a kernel that still holds its number, under a name
            # that kernel has not dropped yet (hostd's invalidation is on its way). ESTALE, as
            # NFS answers for a file gone behind the client's back: the kernel looks the name
            # up again (LOOKUP_REVAL) and misses, so an O_CREAT open makes a new file. ENOENT
            # would fail that open; opening the nameless file would give a writer a file that
            # drops its bytes at the close (both found by a probe: evict, then open at once).
            raise FsError(errno.ESTALE, f"inode {ino} was removed ({obj.removed}): "
                                        "look its name up again")
        if node.parent is None and not obj.resident and obj.extent is None and node.size:
            raise FsError(errno.ENOENT, "the file was removed and its data evicted")
        if flags & os.O_TRUNC and _writable(flags):
            await self._truncate(node, 0)
        elif obj.read_from_nvme and obj.chunks is None and obj.arrival is None:
            self.tiers.promotions.start(node)   # hit again: into DRAM with it, streaming
        return self._open(node, flags, session)

    async def read(self, fh: int, offset: int, length: int, region, region_offset: int) -> int:
        node = self._handle(fh).node
        self._observe_content(node)
        obj = node.obj
        if offset < 0 or length < 0:
            raise FsError(errno.EINVAL, "negative offset or length")
        arrival = obj.arrival   # a prefetch or promotion in flight
        served = None
        if arrival is None and obj.chunks is None:
            if offset >= node.size:
                served = 0   # at the end: nothing to bring in for that
            elif obj.remote_info is not None:
                arrival = self.remote.start_fetch(node)
            else:
                served = await self._read_from_nvme(node, offset, length, region,
                                                    region_offset)
                if served is None:
                    arrival = self.tiers.promotions.start(node)   # None: loaded below
        if served is None and arrival is not None:
            served = await self._read_arriving(node, arrival, offset, length, region,
                                               region_offset)
        if served is None:
            served = await self._read_resident(node, offset, length, region, region_offset)
        node.atime_ns = self.clock()
        self.tiers.touch(node)
        if self.remote is not None and not obj.writers and node.parent is not None:
            self.remote.admit(node, "read")
        return served

    async def _read_resident(self, node: Inode, offset: int, length: int, region,
                             region_offset: int) -> int:
        obj = node.obj
        # Waits out a promotion or a write in progress; not write-behind, which holds the
        # lock only reading (a CRC and an NVMe write of the whole object, tens of ms): a hit
        # copies beside it as it would after it, the pin keeping the chunks (the copy below
        # never held the lock anyway).
        beside = obj.chunks is not None and obj.lock_reads
        async with contextlib.nullcontext() if beside else obj.content_lock():
            if obj.chunks is None:
                try:
                    loaded = await self._load(node, wait=False)
                except FsError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    # A reader is not out of space: its read failed (EIO), as a fetch's
                    # readers are told.
                    raise FsError(errno.EIO, f"no DRAM for it: {e}") from None
                if not loaded:   # under the lock: no write or truncation changes it meanwhile
                    return await self._read_past_dram(node, offset, length, region,
                                                      region_offset)
            else:
                self.tiers.stats.dram.hits += 1
            length = max(0, min(length, node.size - offset))
            self.tiers.pin(obj)
        if self.remote is not None:
            self.remote.note_read(node)
        try:
            if length:
                await self.engine.from_store(views(obj.chunks, offset, length),
                                             region, region_offset)
        finally:
            self.tiers.unpin(obj)
        return length

    async def _read_from_nvme(self, node: Inode, offset: int, length: int, region,
                              region_offset: int) -> int | None:
        """A hit on an object only on NVMe, read from the disk straight into the reply's
        memory and checked chunk by chunk before it is answered (tiers/promotion.py): the
        object stays on NVMe (obj.read_from_nvme: its next open promotes it). None where
        that cannot be: a read not of whole chunks, memory the engine does not map here,
        the direct path turned off; or the object changed while it was read."""
        obj = node.obj
        size = node.size
        length = max(0, min(length, size - offset))
        end = offset + length
        if (self.tiers.promotions.mode not in ("direct", "clone") or not length
                or obj.extent is None
                or offset % CHUNK_SIZE or region_offset % PAGE_SIZE
                or (end % CHUNK_SIZE and end != size)):
            return None
        dst = self.engine.host_view(region, region_offset, length)
        if dst is None:
            return None
        extent, crcs, version = obj.extent, obj.crcs, obj.version
        try:
            ok = await self._read_chunks_checked(node, extent, crcs, size, offset, dst)
        finally:
            dst.release()
        if not ok:
            if obj.extent is not extent or obj.version != version or obj.chunks is not None:
                return None   # it changed under the read: the usual way
            raise self._corrupt(node, offset)
        if not obj.read_from_nvme:
            obj.read_from_nvme = True
            self.tiers.stats.nvme.hits += 1
        self.tiers.stats.nvme.bytes_out += length
        return length

    async def _read_chunks_checked(self, node: Inode, extent, crcs: bytes, size: int,
                                   offset: int, dst: memoryview) -> bool:
        """len(dst) bytes of whole chunks from `offset` read from the extent into dst in a
        worker thread (promotion.read_checked); whether every chunk's CRC32C matched. EIO
        where the disk read failed."""
        self.tiers.pin(node.obj)   # no eviction frees the extent meanwhile
        try:
            return await trio.to_thread.run_sync(read_checked, self.tiers.nvme,
                                                 self.tiers.read_lanes, extent, crcs, size,
                                                 offset // CHUNK_SIZE, dst)
        except OSError as e:
            log.error("reading inode %d from NVMe failed: %s", node.ino, e)
            raise FsError(errno.EIO, f"NVMe read failed: {e}") from None
        finally:
            self.tiers.unpin(node.obj)

    def _corrupt(self, node: Inode, offset: int) -> FsError:
        """Removes an object whose bytes at `offset` failed their checksum; its reader's
        error."""
        self.tiers.stats.checksum_failures += 1
        log.error("checksum mismatch in inode %d (%s) at offset %d: object removed",
                  node.ino, node.name, offset)
        self.tiers.drop_corrupt(node)
        return FsError(errno.EIO, "checksum mismatch: object removed")

    async def _read_past_dram(self, node: Inode, offset: int, length: int, region,
                              region_offset: int) -> int:
        """A read of an object only on NVMe that DRAM has no room for now (full of objects
        being written, or only DRAM holds): read from the disk, checked chunk by chunk, and
        served without caching it, whatever tiers.nvme.hit_path. Straight into the reply
        where it is whole chunks in memory the engine maps here (as _read_from_nvme), else
        through a buffer of the chunks it spans. Caller holds the content lock."""
        obj = node.obj
        size = node.size
        length = max(0, min(length, size - offset))
        if not length:
            return 0
        end = offset + length
        first = offset // CHUNK_SIZE
        start, stop = first * CHUNK_SIZE, min(size, -(-end // CHUNK_SIZE) * CHUNK_SIZE)
        dst = None
        if start == offset and stop == end and region_offset % PAGE_SIZE == 0:
            dst = self.engine.host_view(region, region_offset, length)
        bounce = None
        if dst is None:   # page-aligned, as O_DIRECT reads need
            bounce = mmap.mmap(-1, stop - start)
            dst = memoryview(bounce)
        try:
            if not await self._read_chunks_checked(node, obj.extent, obj.crcs, size, start,
                                                   dst):
                raise self._corrupt(node, start)
            if bounce is not None:
                await self.engine.from_store([dst[offset - start:end - start]], region,
                                             region_offset)
        finally:
            dst.release()
            if bounce is not None:
                close_window(bounce)
        stats = self.tiers.stats.nvme
        stats.past_dram += 1
        stats.bytes_out += length
        note = self._past_dram_log.allow()
        if note is not None:   # once in a while: under a write burst, every read may come here
            log.warning("no room in DRAM for inode %d (%s): read from NVMe without keeping "
                        "it in DRAM; is the DRAM tier smaller than the writes in flight?%s",
                        node.ino, node.name, note)
        return length

    async def _read_arriving(self, node: Inode, arrival, offset: int, length: int, region,
                             region_offset: int) -> int | None:
        """A read of an object the remote tier is fetching: each run of chunks is copied
        once its checksums matched, without waiting for the rest. None: the fetch did not
        happen after all (read it the usual way)."""
        obj = node.obj
        length = max(0, min(length, node.size - offset))
        end = offset + length
        self.tiers.pin(obj)   # a failed fetch's chunks stay out of the pool while we copy
        try:
            done = 0
            while done < length:
                pos = offset + done
                first = pos // CHUNK_SIZE
                if not await arrival.wait_for(first):
                    if done:   # an abandoned fetch never marked a chunk; cannot happen
                        raise FsError(errno.EIO, "remote fetch abandoned mid-read")
                    return None
                arrival.was_read = True
                last = arrival.ready_until(first, -(-end // CHUNK_SIZE))
                n = min(end, last * CHUNK_SIZE) - pos
                await self.engine.from_store(views(arrival.chunks, pos, n), region,
                                             region_offset + done)
                done += n
            if length and end == node.size:
                # a read to the end returns with the object whole (and counted) in DRAM: the
                # last chunk's check is the end of the fetch, so this costs next to nothing
                await arrival.wait_complete()
        finally:
            self.tiers.unpin(obj)
        return length

    async def write(self, fh: int, offset: int, length: int, region, region_offset: int) -> int:
        handle = self._handle(fh)
        if not handle.writable:
            raise FsError(errno.EBADF, "handle is not open for writing")
        if offset < 0 or length < 0:
            raise FsError(errno.EINVAL, "negative offset or length")
        self._check_size(offset + length)
        if not length:
            return 0
        node = handle.node
        self._kernel_refusal(node)
        obj = node.obj
        async with obj.content_lock():
            if obj.chunks is None:
                await self._load(node)
            await self._wait_upload(obj)
            self._observe_content(node, chunks=False)
            self.tiers.begin_modify(node)
            end = offset + length
            first, last = offset // CHUNK_SIZE, (end - 1) // CHUNK_SIZE
            if len(obj.chunks) <= last:
                obj.chunks.extend([None] * (last + 1 - len(obj.chunks)))
            self.tiers.memfd_of(obj, node.size)
            if end > node.size:   # the memfd grows first: a page past its EOF faults
                self.tiers.set_length(obj, end)
            try:
                missing = [i for i in range(first, last + 1) if obj.chunks[i] is None]
                await self.tiers.take_windows(obj.chunks, missing)
                if missing:
                    await self._allocate_for(region, obj.chunks.memfd, offset, length)
                self.tiers.pin(obj)
                try:
                    await self.engine.to_store(region, region_offset,
                                               views(obj.chunks, offset, length))
                finally:
                    self.tiers.unpin(obj)
            except BaseException:
                self.tiers.set_length(obj, node.size)
                raise
            if end > node.size:
                self._set_size(node, end)
            node.mtime_ns = node.ctime_ns = self.clock()
            obj.version += 1
        self.tiers.note_foreground_write()
        return length

    async def replace(self, fh: int, length: int, region, region_offset: int) -> int:
        """The zero-copy STORE: the file's content becomes `length` bytes of the region, all at
        once. The bytes go into fresh chunks first; readers see the old content or the new,
        never a mix (chunks they are copying from are returned only when they finish)."""
        handle = self._handle(fh)
        if not handle.writable:
            raise FsError(errno.EBADF, "handle is not open for writing")
        self._check_size(length)
        node = handle.node
        obj = node.obj
        self._observe_content(node, chunks=False)
        swap_lent = obj.kernel_writer == fh and obj.opens == 1 and self._stop_kernel_writes(node)
        chunks = await self.tiers.take_content(length)
        try:
            if length and not (chunks.fresh and await self.engine.to_new_file(
                    region, region_offset, chunks.memfd.fd, length)):
                if chunks.fresh:
                    await self._allocate_for(region, chunks.memfd, 0, length)
                await self.engine.to_store(region, region_offset, views(chunks, 0, length))
        except BaseException:
            self.tiers.discard_content(chunks)
            raise
        async with obj.content_lock():
            obj.remote_info = None
            self.tiers.begin_modify(node)
            if _lent(obj) and not swap_lent:
                # The memfd was lent: the kernel may read it for any handle of the inode, or
                # an application have it mapped, past the handle that got it. They must keep
                # seeing this file, so the bytes go into it, in place (as a write would).
                await self._copy_in_place(node, chunks, length)
            else:
                old, obj.chunks = obj.chunks, chunks
                if old is not None:
                    self.tiers.give_chunks(obj, old)
            self.tiers.mark_resident(node)
            self._set_size(node, length)
            node.mtime_ns = node.ctime_ns = self.clock()
            obj.version += 1
        self.tiers.note_foreground_write()   # write-behind waits for a pause in STOREs too
        return length

    async def _allocate_for(self, region, memfd, offset: int, length: int) -> None:
        """The memfd's pages for a copy the engine wants them allocated for first."""
        if memfd is not None and self.engine.wants_allocated(region):
            await trio.to_thread.run_sync(memfd.allocate, offset, length)

    async def _copy_in_place(self, node: Inode, content: Chunks, length: int) -> None:
        """Makes the object's own chunks hold `content` (then given back), its size still to
        be set by the caller. Caller holds the content lock."""
        obj = node.obj
        count = chunk_count(length)
        self.tiers.memfd_of(obj, node.size, spare=False)
        if length > node.size:
            self.tiers.set_length(obj, length)
        if len(obj.chunks) < count:
            obj.chunks.extend([None] * (count - len(obj.chunks)))
        await self.tiers.take_windows(obj.chunks, [i for i in range(count)
                                                   if obj.chunks[i] is None])
        # A read through the daemon still sees one whole version, as with a new memfd: no
        # copy out overlaps this copy in (the kernel's passthrough reads may, as on tmpfs).
        await self.tiers.wait_unpinned(obj)
        self.tiers.pin(obj)
        try:
            await trio.to_thread.run_sync(_copy_pairs, views(obj.chunks, 0, length),
                                          views(content, 0, length))
        finally:
            self.tiers.unpin(obj)
        self.tiers.discard_content(content)
        dropped = obj.chunks[count:]
        del obj.chunks[count:]
        self.tiers.give_chunks(obj, dropped)

    async def checksum(self, fh: int) -> tuple[int, Inode]:
        """CRC32C of the whole content (QUERY), and the inode it describes."""
        node = self._handle(fh).node
        self._observe_content(node)
        obj = node.obj
        async with obj.content_lock():
            if obj.chunks is None:
                await self._load(node)
            self.tiers.pin(obj)
        try:
            return await trio.to_thread.run_sync(crc.crc_of, views(obj.chunks, 0, node.size)), node
        finally:
            self.tiers.unpin(obj)

    async def flush(self, fh: int) -> None:
        handle = self._handle(fh)
        node = handle.node
        self.observe(node)   # a kernel writer's close: its size, seen
        if node.obj is not None and node.obj.kernel_writer is not None:
            self._bound_kernel_writes()
            if node.obj.kernel_writer == fh:
                handle.closed_as = node.obj.kernel_seen
        self._kernel_refusal(node)
        if self.tiers.write_through:
            await self._persist(fh, "write-through")

    async def fsync(self, fh: int) -> None:
        """Returns once the file's content is on NVMe and its index record durable (as far as
        `durability` asks), so it survives a crash of the daemon. Without an NVMe tier there
        is nothing more durable than DRAM: a no-op (docs/operations.md)."""
        await self._persist(fh, "fsync")

    async def _persist(self, fh: int, why: str) -> None:
        node = self._handle(fh).node
        self._observe_content(node)
        obj = node.obj
        if obj.dirty and self.tiers.nvme is not None:
            async with obj.content_lock():
                self._observe_content(node)   # what the kernel wrote, all mapped
                if (not await self.tiers.writeback(node, kernel_writer_seen=True) and obj.dirty
                        and node.parent is not None):
                    raise FsError(errno.EIO, f"{why}: writing the file to NVMe failed")

    def backing(self, fh: int) -> tuple[int, int]:
        """A read-only fd of the object's memfd and its size, for a client that hands it to
        its kernel as a FUSE passthrough backing file; it may keep the fd past the handle
        (hostd/kept_backings.py: the memfd is then never reused for other bytes, and its
        leaving the object is published as "left-dram"). ENODATA (serve through the daemon,
        the open stays good) unless the object is complete and in DRAM: written by nobody,
        no writer's temporary. Its content lock may be held: write-behind holds it while it
        copies to NVMe, changing nothing, and a truncation changes the memfd in place, which
        such a reader is to see anyway."""
        handle = self._handle(fh)
        if handle.writable:
            return self._writer_backing(handle)
        memfd = self._backable(handle)
        fd = memfd.open_readonly()
        self._lent_to(handle)
        return fd, handle.node.size

    def keep(self, fh: int, identity: list[int]) -> bool:
        """Read-only handle `fh` was answered by its client with the memfd it kept from an
        earlier backing, `identity` its [st_dev, st_ino]: counted as backing() counts it when
        that is still the object's memfd and could be lent now. False: the client is to
        forget the one it kept."""
        handle = self._handle(fh)
        if len(identity) != 2:
            raise FsError(errno.EINVAL, "kept: [st_dev, st_ino] of the memfd")
        if handle.writable:
            return False
        try:
            memfd = self._backable(handle)
        except FsError:
            return False
        if not memfd.lent or list(memfd.identity()) != identity:
            return False
        self._lent_to(handle)
        return True

    def _backable(self, handle: Handle):
        """The read-only handle's memfd, if it may be lent now; else ENODATA, saying why."""
        node = handle.node
        obj = node.obj
        why = None
        if obj.writers:
            why = "open for writing"
        elif obj.chunks is None or obj.arrival is not None or obj.remote_info is not None:
            why = "not in DRAM"
        elif node.ino in self.tmp_inos:
            why = "a writer's temporary file"
        if why is None:
            memfd = self.tiers.memfd_of(obj, node.size, spare=False)
            self.tiers.fit_memfd(obj)
            if memfd.size != node.size:   # a copy still reads past the end: not yet
                why = "its memory is being resized"
        if why is not None:
            raise FsError(errno.ENODATA, f"no backing: serve through the daemon ({why})")
        return memfd

    def _lent_to(self, handle: Handle) -> None:
        """The handle's client reads the memfd from now on, unseen: counted as a read."""
        self._read_unseen(handle.node)
        if not handle.backed:
            handle.backed = True
            handle.node.obj.backed += 1

    async def backing_loaded(self, fh: int) -> Lent:
        """As backing(), for a read-only handle whose object is only on NVMe, by
        tiers.nvme.hit_path: clone, for an O_DIRECT open, a reflink clone of its extent
        (_clone_from_nvme), read by the kernel itself and checked by the filesystem (a
        buffered reader would fill a page cache of the clone's own, dropped at its close:
        slower and far noisier than direct, docs/benchmarks/hit-notes.md); direct (also
        clone's fallback and its buffered opens), no
        backing (ENODATA): its reads go through hostd and are read from the disk straight into
        the reply (_read_from_nvme). An open of it after such a hit promotes it (Store.open).
        stream: its promotion starts here, no backing; reads are served as its chunks come in
        checked, opens after it read the memfd by passthrough. promote: promoted whole first,
        and this open reads the memfd. Objects in the remote tier are left to reads, which are
        served chunk by chunk as the fetch arrives."""
        handle = self._handle(fh)
        node = handle.node
        obj = node.obj
        if not handle.writable and self._only_on_nvme(node):
            promotions = self.tiers.promotions
            if promotions.mode == "clone" and handle.unbuffered:
                fd = await self._clone_from_nvme(handle)
                if fd is not None:
                    return Lent(fd, node.size, keepable=False)
            elif promotions.mode == "stream":
                promotions.start(node)
            elif promotions.mode == "promote":
                async with obj.content_lock():   # no room in DRAM: no backing, reads go past
                    await self.tiers.promote(node, wait=False)   # it (_read_past_dram)
        return Lent(*self.backing(fh))

    def _only_on_nvme(self, node: Inode) -> bool:
        """Whether the file's bytes are in its NVMe extent alone, and written by nobody."""
        obj = node.obj
        return (obj.chunks is None and obj.remote_info is None and obj.arrival is None
                and not obj.writers and node.ino not in self.tmp_inos)

    async def _clone_from_nvme(self, handle: Handle) -> int | None:
        """A read-only fd of a clone of the object's NVMe extent (tiers/nvme_clone.py), counted
        as a hit on NVMe; None where there is none to give: a size not of whole pages (the
        pad after it would show), a filesystem that refused, or the object changed meanwhile."""
        node = handle.node
        obj = node.obj
        extent, version, size = obj.extent, obj.version, node.size
        if extent is None or not size or size % PAGE_SIZE:
            return None
        self.tiers.pin(obj)   # no eviction frees the extent meanwhile
        try:
            fd = await self.tiers.promotions.clones_ahead.take(node.ino, extent, version, size)
            ahead = fd is not None
            if fd is None:
                fd = await trio.to_thread.run_sync(self.tiers.nvme.clone, extent, size)
        except OSError as e:
            log.warning("no clone of inode %d's NVMe extent: %s (read through bluecached)",
                        node.ino, e)
            return None
        finally:
            self.tiers.unpin(obj)
        if (obj.extent is not extent or obj.version != version or node.size != size
                or obj.chunks is not None or obj.writers):
            os.close(fd)   # it changed under the clone: the usual way
            return None
        if not obj.read_from_nvme:
            obj.read_from_nvme = True
            self.tiers.stats.nvme.hits += 1
        self.tiers.stats.nvme.clones += 1
        self.tiers.stats.nvme.clones_ahead += ahead
        self._read_unseen(node)
        return fd

    # -- opens readied at the lookup (hostd/kept_backings.py, tiers/clone_ahead.py) ---------

    def ready_open(self, node: Inode, session: int, prepare: bool) -> dict | None:
        """A lookup by a client on this host, of a file only on NVMe: readies what a read-only
        open right after it would need, as this session's last read-only open went.
        - hit_path clone, an O_DIRECT session: the clone that open would wait for is started
          now, for the open to take (tiers/clone_ahead.py).
        With `prepare`, returns what such an open would be given where the client can answer
        that open itself and send it here after:
        - {"kind": "plain"}: hit_path direct: the reads of any open go through the daemon,
          there is nothing to lend;
        - {"kind": "buffered"}: hit_path clone, a session whose last read-only open was
          buffered (an O_DIRECT open would clone);
        - None: anything else (a memfd or a clone to lend, a promotion or a fetch to start, a
          session not yet seen reading): the client asks at the open, as without this."""
        if (not stat.S_ISREG(node.mode) or node.obj is None or node.parent is None
                or not self._only_on_nvme(node)):
            return None
        mode = self.tiers.promotions.mode
        if mode == "direct":
            return {"kind": "plain"} if prepare else None
        if mode != "clone":
            return None
        unbuffered = self._unbuffered_readers.get(session)
        if unbuffered and node.obj.extent is not None and node.size and not node.size % PAGE_SIZE:
            self.tiers.promotions.clone_ahead(node)   # what _clone_from_nvme would clone
        if unbuffered is False and prepare:
            return {"kind": "buffered"}
        return None

    def _read_unseen(self, node: Inode) -> None:
        """A client's kernel reads the file's bytes from a backing file bluecached lent: as a
        read for the LRU, atime and the remote tier's admission."""
        node.atime_ns = self.clock()
        self.tiers.touch(node)
        if self.remote is not None:
            self.remote.note_read(node)
            if node.parent is not None:
                self.remote.admit(node, "read")

    def release(self, fh: int) -> None:
        handle = self.handles.pop(fh, None)
        if handle is None:
            raise FsError(errno.EBADF, f"no open handle {fh}")
        node = handle.node
        obj = node.obj
        if obj.kernel_writer == fh:
            self._kernel_writes_end(node)
        if handle.writable and _lent(obj):
            self._take_mapped_writes(node)
        obj.opens -= 1
        if handle.backed:
            obj.backed -= 1
        if handle.writable:
            obj.writers -= 1
            if not obj.writers:
                self.tiers.queue_writeback(node)
                if self.remote is not None:
                    self.remote.admit(node, "written")
        self.tiers.fit_memfd(obj)   # complete now, maybe: a spare's rest is let go
        self._maybe_destroy(node)

    # -- writes through a shared mapping of a lent memfd -----------------------------------

    def _take_mapped_writes(self, node: Inode) -> None:
        """A writer's handle goes from an inode whose memfd was lent. Its kernel may have
        written the memfd through a shared mapping (a passthrough inode's mmap maps the memfd
        itself, a write handle's too: fusefs/passthrough.py), which neither a request nor the
        memfd's size or mtime shows. The memfd is the content: chunks it filled in a hole are
        counted, a write-behind that copied it meanwhile is void (a new version), and a
        persisted copy is checked against it (check_mapped_writes). Found by a probe: bytes
        written through a mapping read as zeros through hostd, or went at a restart."""
        obj = node.obj
        try:
            self._adopt_holes(node)
        except FsError as e:   # no window to count them in: a mapped write there is lost
            log.warning("inode %d: chunks written through a mapping not taken in: %s",
                        node.ino, e.message)
        if obj.dirty:
            obj.version += 1
        elif obj.persisted and node.size:
            self._mapped_send.send_nowait(node)

    async def check_mapped_writes(self) -> None:
        """Compares each persisted object a mapped writer let go of (_take_mapped_writes)
        with its NVMe copy's chunk CRCs, in a worker thread; one that differs is modified
        now and written behind again. Until then a crash keeps the copy: the bytes written
        through the mapping were never fsynced."""
        async for node in self._mapped_receive:
            await self._check_mapped(node)

    async def _check_mapped(self, node: Inode) -> None:
        obj = node.obj
        if (obj is None or obj.dirty or not obj.persisted or obj.chunks is None
                or node.parent is None):
            return
        version, size = obj.version, node.size
        chunks = list(obj.chunks)
        self.tiers.pin(obj)
        try:
            crcs = await trio.to_thread.run_sync(_chunk_crcs, chunks, size)
        finally:
            self.tiers.unpin(obj)
        if obj.version == version and not obj.dirty and obj.persisted and crcs != obj.crcs:
            log.info("inode %d: written through a shared mapping: written behind again",
                     node.ino)
            self.tiers.begin_modify(node)
            node.mtime_ns = node.ctime_ns = self.clock()
            self.tiers.queue_writeback(node)

    # -- a writer's kernel writing the memfd (FUSE passthrough) ---------------------------

    def _writer_unfinished(self, fh: int) -> bool:
        """Whether kernel writer `fh`'s memfd, its client gone or going, holds no version the
        writer finished: written since its last close (FLUSH) or never closed, and not
        persisted as it stands (fsynced, unchanged since). Such a writer goes on writing a
        memfd no daemon has any more and its close fails (EIO: hostd's link is new); a name
        must not show what the memfd held (llm-d renames before it closes: the block's
        final name would). A close's RELEASE is sent after it returned, and may be lost
        with its client: a FLUSH is the close."""
        handle = self.handles[fh]
        obj = handle.node.obj
        self.observe(handle.node)
        return obj.dirty and handle.closed_as != obj.kernel_seen

    def _writer_backing(self, handle: Handle) -> tuple[int, int]:
        """A writer's memfd, read-write, for its client's kernel to write directly: the
        connectors' store (create, write it all, close, rename) then sends no request per
        write. Only for a new (or truncated) file this handle alone has open, with room in
        DRAM; from then on its size and bytes are the memfd's, seen by observe()."""
        node = handle.node
        obj = node.obj
        memfd = obj.chunks.memfd if obj.chunks is not None else None
        why = None
        if obj.opens != 1 or obj.kernel_writer is not None:
            why = "open more than once"
        elif (node.size or obj.chunks is None or len(obj.chunks) or obj.remote_info is not None
              or obj.arrival is not None or (memfd is not None and (memfd.size or memfd.ahead))):
            why = "not a new, empty file"
        elif node.mode & (stat.S_ISUID | stat.S_ISGID):
            why = "set-ID bits, which a write must clear"
        elif not self.tiers.room_for_kernel_writes(min(KERNEL_WRITE_ROOM,
                                                       self.tiers.dram.capacity // 4)):
            why = "DRAM tier full"
        if why is not None:
            raise FsError(errno.ENODATA, f"no backing: write through the daemon ({why})")
        memfd = self.tiers.memfd_of(obj, 0, spare=False)
        fd = memfd.open_readwrite()
        obj.kernel_writer = handle.fh
        self.tiers.note_foreground_write()
        self.kernel_writers[node.ino] = node
        self._kernel_writers_changed.set()
        obj.kernel_seen = _seen(memfd.fd)
        handle.backed = True
        obj.backed += 1
        return fd, 0

    def observe(self, node: Inode, chunks: bool = False) -> None:
        """What a writer's kernel wrote to the memfd since last seen, taken in: the size and
        mtime are the memfd's and the content changed (dirty, a new version); with `chunks`
        (for whatever reads the content here) its chunks are mapped and counted in the tier
        too, which the watch and the writer's release do anyway. Called wherever the size or
        content is used, so nothing works on a stale view; one fstat, nothing for other
        files."""
        obj = node.obj
        if obj is None or obj.chunks is None:
            return   # (a refused writer's object is gone from DRAM: _refuse_kernel_writer)
        if obj.kernel_writer is None:
            if chunks and obj.writers and _lent(obj):
                try:   # a writer may have filled them through a mapping
                    self._adopt_holes(node)
                except FsError as e:   # no window for them: they read as holes, as before
                    log.debug("inode %d: holes not mapped for a read: %s", node.ino, e.message)
            return
        seen = _seen(obj.chunks.memfd.fd)
        if seen != obj.kernel_seen:
            # Bounded before its size is taken in: one pwrite far past EOF makes a sparse
            # memfd of any size up to 8 EiB, whose chunk list (and a window, an fd, per
            # chunk) would end the daemon.
            if seen[0] > self.max_file_size:
                self._refuse_kernel_writer(node, errno.EFBIG, (
                    f"a file here holds at most {self.max_file_size} bytes (the NVMe tier's "
                    "segment size): it was written past that"))
                return
            if seen[0] > self.tiers.dram.capacity:
                self._refuse_kernel_writer(node, errno.ENOSPC, (
                    f"a file is written whole in the DRAM tier ({self.tiers.dram.capacity} "
                    "bytes) first: it was written past that"))
                return
            obj.kernel_seen = seen
            self._take_kernel_writes(node, *seen)
        if chunks:
            # Until then a chunk the kernel wrote is None here, which reads as a hole.
            try:
                self._adopt_holes(node)
            except FsError as e:   # no window to count them in (no fd or mapping left)
                self._refuse_kernel_writer(node, e.errno, e.message)

    def _adopt_holes(self, node: Inode) -> None:
        """Maps and counts the chunks of the memfd that are holes here (None): what a
        client's kernel wrote into the memfd itself is there."""
        if node.size > self.tiers.dram.capacity:   # (a window per chunk holds an fd)
            raise FsError(errno.ENOSPC, f"{node.size} bytes cannot all be mapped in the DRAM "
                                        f"tier ({self.tiers.dram.capacity} bytes)")
        chunks = node.obj.chunks
        count = chunk_count(node.size)
        if len(chunks) < count:   # a truncation up leaves the list short: holes too
            chunks.extend([None] * (count - len(chunks)))
        holes = [i for i, c in enumerate(chunks) if c is None]
        if holes:
            self.tiers.adopt_windows(chunks, holes)

    def _take_kernel_writes(self, node: Inode, size: int, mtime_ns: int) -> None:
        obj = node.obj
        self.tiers.begin_modify(node)
        memfd = obj.chunks.memfd
        memfd.size = memfd.length = size
        count = chunk_count(size)
        if len(obj.chunks) < count:
            obj.chunks.extend([None] * (count - len(obj.chunks)))
        elif len(obj.chunks) > count:   # cut (_bound_kernel_writes)
            dropped = obj.chunks[count:]
            del obj.chunks[count:]
            self.tiers.give_chunks(obj, dropped)
        self.tiers.resize_dirty(node, size)
        self.logical_bytes += size - node.size
        node.size = size
        node.mtime_ns = node.ctime_ns = mtime_ns
        self.tiers.note_foreground_write()   # write-behind waits for a pause, as for writes

    @staticmethod
    def _kernel_refusal(node: Inode) -> None:
        """A kernel writer stopped for its size or a full tier: its close says why, and so
        does every later use of its content (its bytes went with its names): a truncate
        would otherwise make it a file again, with no name and a memfd that is no longer
        the writer's."""
        refusal = node.obj.kernel_refused if node.obj is not None else None
        if refusal is not None:
            raise FsError(*refusal)

    def _observe_content(self, node: Inode, chunks: bool = True) -> None:
        """observe(), before a use of the content: a writer stopped then (or before) raises
        why, as its chunks are gone."""
        self.observe(node, chunks)
        self._kernel_refusal(node)

    def _stop_kernel_writes(self, node: Inode) -> bool:
        """The kernel writer's own zero-copy STORE: the new content goes into fresh chunks
        (page-locked ahead for a GPU's copy engines, where the kernel writer's memfd is not)
        instead of being copied into the memfd a second time. The memfd is sealed against
        further writes first, so a write(2) on that handle after the STORE fails (EPERM)
        instead of landing in memory nobody reads. False where it cannot be sealed."""
        obj = node.obj
        try:
            obj.chunks.memfd.seal_writes()
        except OSError as e:
            log.info("inode %d: kernel writer's memfd not sealed (%s): STORE copies in place",
                     node.ino, e)
            return False
        self._kernel_writes_end(node)
        return True

    def _kernel_writes_end(self, node: Inode) -> None:
        """The kernel writer's handle goes: its final size and bytes are taken in. A write
        after the last look changed the mtime even within one clock tick (tmpfs takes
        fine-grained timestamps once they were looked at: multigrain timestamps, 6.13+), so
        an unchanged (size, mtime) means unchanged bytes: an fsync'ed file stays persisted."""
        self.observe(node, chunks=True)
        node.obj.kernel_writer = None
        self.kernel_writers.pop(node.ino, None)
        self.tiers.fit_memfd(node.obj)

    async def watch_kernel_writes(self, interval: float = KERNEL_WRITE_WATCH_S) -> None:
        """Looks at every kernel writer's memfd every `interval` while there are any (no
        request tells the daemon of their writes): their chunks are counted as they grow,
        and a file past the size a file here may have, or a DRAM tier full beyond what can
        be evicted, stops a memfd from growing (writes then fail: EPERM from the kernel)
        and its close fails with EFBIG or ENOSPC (_bound_kernel_writes)."""
        while True:
            if not self.kernel_writers:
                self._kernel_writers_changed = trio.Event()
                await self._kernel_writers_changed.wait()
            await trio.sleep(interval)
            for node in list(self.kernel_writers.values()):
                self.observe(node, chunks=True)
            self._bound_kernel_writes()

    def _bound_kernel_writes(self) -> None:
        """Stops the kernel writers that went too far: while DRAM is over its capacity with
        what can be evicted gone, the writers that wrote last (not one that finished before
        the tier filled). One past the size a file here may have is stopped by observe()."""
        if not self._over_dram():
            self._over_dram_since = None
            return
        if self._write_behind_makes_room():
            return
        latest_first = sorted(self.kernel_writers.values(),
                              key=lambda n: n.obj.kernel_seen[1], reverse=True)
        for node in latest_first:
            self._refuse_kernel_writer(node, errno.ENOSPC,
                                       "the DRAM tier is full: nothing more could be evicted")
            if self.tiers.dram.used_bytes <= self.tiers.dram.capacity:
                break

    def _write_behind_makes_room(self) -> bool:
        """Whether the kernel writers may go on past the DRAM tier's capacity for now: by no
        more than write-behind frees (finished objects only DRAM holds, evictable once on
        NVMe), for at most WRITEBACK_STALL_S with no write-behind failing, as a write through
        the daemon waits for write-behind (Tiers.take_windows). ENOSPC is for room the cache
        cannot free: eight writers given their memfds at once after a restart, with the
        files finished before them still on their way to NVMe, are not that."""
        tiers = self.tiers
        now = trio.current_time()
        if self._over_dram_since is None:
            self._over_dram_since = (now, tiers.stats.writeback_failures)
        since, failures = self._over_dram_since
        return (now - since < WRITEBACK_STALL_S
                and tiers.stats.writeback_failures == failures
                and tiers.dram.used_bytes - tiers.dram.capacity
                <= tiers.bytes_write_behind_frees())

    def _over_dram(self) -> bool:
        """Whether the DRAM tier is over its capacity with every kernel writer's chunks
        counted, once what can be evicted has gone (mapping them, which evicts, only when it
        may be over)."""
        for n in list(self.kernel_writers.values()):
            self.observe(n)   # their sizes now: one fstat each (one past a file's limit stops)
        writers = list(self.kernel_writers.values())
        pending = sum(1 for n in writers for c in n.obj.chunks if c is None) * CHUNK_SIZE
        if self.tiers.dram.used_bytes + pending <= self.tiers.dram.capacity:
            return False
        for n in writers:
            self.observe(n, chunks=True)   # (a writer whose windows cannot be had: stopped)
        return self.tiers.dram.used_bytes > self.tiers.dram.capacity

    def _refuse_kernel_writer(self, node: Inode, err: int, why: str) -> None:
        obj = node.obj
        memfd = obj.chunks.memfd
        try:
            if _seen(memfd.fd)[0] > self.max_file_size:   # cut at the limit, as a refused
                memfd.resize(self.max_file_size)          # write would have stopped it
            memfd.seal_growth()
        except OSError as e:
            log.warning("inode %d: could not stop its kernel writer (%s)", node.ino, e)
            return
        obj.kernel_refused = (err, why)
        log.info("inode %d: its writer's kernel writes refused: %s", node.ino, why)
        self.kernel_writers.pop(node.ino, None)
        # Writes past this point fail: what the file holds is not what its writer wrote.
        # Its names go now (never partial bytes under a name), as when a write hostd
        # answered early fails (`discard`); the writer's close says why.
        self.remove_object(node, why)

    def reference(self, ino: int) -> None:
        self.kernel_refs[ino] = self.kernel_refs.get(ino, 0) + 1

    def unreference(self, ino: int) -> None:
        left = self.kernel_refs.get(ino, 0) - 1
        if left > 0:
            self.kernel_refs[ino] = left
            return
        self.kernel_refs.pop(ino, None)
        node = self.ns.inodes.get(ino)
        if node is not None:
            self._maybe_destroy(node)

    def release_session(self, session: int) -> int:
        """Closes what a client that went away left open. A file its kernel was writing
        and holding no version the writer finished (_writer_unfinished) goes, whatever
        name it has by then: as after a crash, where it was never persisted."""
        fhs = [h.fh for h in self.handles.values() if h.session == session]
        unfinished = []
        for fh in fhs:
            node = self.handles[fh].node
            if node.obj.kernel_writer == fh and self._writer_unfinished(fh):
                unfinished.append(node)
            self.release(fh)
        for node in unfinished:
            if node.obj is not None and self.ns.inodes.get(node.ino) is node:
                log.warning("inode %d (%s): its writer's client went away before closing it: "
                            "removed, as it holds no finished version", node.ino, node.name)
                self.remove_object(node, "writer gone before its close")
        self._unbuffered_readers.pop(session, None)
        return len(fhs)

    def _remote_key(self, node: Inode) -> str | None:
        return self.remote.key_of(node) if self.remote is not None else None

    def _journaled(self, node: Inode) -> bool:
        """Whether the journal names this inode (so a change of its names is recorded)."""
        return node.obj is None or node.obj.persisted

    def _renamed(self, node: Inode) -> None:
        """Bookkeeping after an inode that keeps a name had one taken or given."""
        if self._journaled(node):
            self.tiers.log(index.place_record(node))
        self._note_name(node)

    async def link(self, ino: int, new_parent: int, new_name: bytes) -> Inode:
        """A hard link: one more name for a file (or symlink, or special file). Every name
        is the same inode: one object, one set of attributes; the object's eviction takes
        every name with it. A file with several names stays out of the remote tier (its key
        is a path): a copy it had there goes."""
        node = self.ns.get(ino)
        obj = node.obj
        if obj is not None and obj.remote_info is not None and not node.is_dir:
            async with obj.content_lock():   # only remote: fetched first, as for a write
                if obj.remote_info is not None:
                    await self._load(node)
        key = self._remote_key(node)
        self.ns.link(ino, new_parent, new_name)
        if self.remote is not None and obj is not None:
            self.remote.forget_copy(node, key)
        self._renamed(node)
        return node

    def unlink(self, parent: int, name: bytes) -> None:
        key = self._remote_key(self.ns.lookup(parent, name))
        node = self.ns.unlink(parent, name)
        if node.obj is not None:
            self._kv_event(parent, name, "deleted")
        if node.parent is not None:   # another name of it stays
            self._renamed(node)
            return
        if self.remote is not None:
            self.remote.forget_copy(node, key)
        self._unlinked(node)

    def discard(self, ino: int) -> None:
        """A client lost bytes it had accepted for this file (a write it acknowledged early
        failed here): the file goes, so no reader gets it without them. Idempotent."""
        node = self.ns.inodes.get(ino)
        if node is None or node.obj is None or node.parent is None:
            return
        self.remove_object(node, "a write to it failed after the writer was answered")

    def rmdir(self, parent: int, name: bytes) -> None:
        node = self.ns.rmdir(parent, name)
        self.tiers.log(index.drop_record(node.ino))

    def rename(self, parent: int, name: bytes, new_parent: int, new_name: bytes,
               flags: int = 0) -> None:
        old_key = self._remote_key(self.ns.lookup(parent, name))
        node, replaced = self.ns.rename(parent, name, new_parent, new_name, flags)
        if node.obj is not None:   # readable under the new name now; the old one is gone
            self._kv_event(parent, name, "renamed")
            self._kv_event(new_parent, new_name)
        if self.remote is not None and node.obj is not None:
            self.remote.forget_copy(node, old_key, renamed=True)
        if replaced is not None:
            if replaced.is_dir:
                self.tiers.log(index.drop_record(replaced.ino))
            elif replaced.parent is not None:   # a file with another name: it keeps that
                self._renamed(replaced)
            else:
                if self.remote is not None and (node.obj is None or node.extra is not None):
                    # no upload of what took the name (a symlink, a special file, a file with
                    # hard links) replaces the file's remote copy under it: that goes now
                    self.remote.forget_copy(replaced, self.remote.key_for(
                        self.ns.path_of(self.ns.get(new_parent)) + b"/" + new_name))
                self._unlinked(replaced)
        self._renamed(node)
        if self.remote is not None and node.obj is not None and not node.obj.writers:
            # after _renamed: a temporary renamed to its final name (vLLM closes it first)
            # is no longer one, and only then is it admitted
            self.remote.admit(node, "written")

    def readdir(self, ino: int, offset: int, limit: int = 1024) -> list:
        return self.ns.readdir(ino, offset, limit)

    def parent_of(self, ino: int) -> int:
        return self.ns.parent_of(ino)

    def statfs(self) -> dict:
        tiers = self.tiers
        capacity = tiers.nvme.capacity if tiers.nvme is not None else tiers.dram.capacity
        used = min(capacity, self.logical_bytes)
        bsize = 4096
        return {"bsize": bsize, "frsize": bsize, "blocks": capacity // bsize,
                "bfree": (capacity - used) // bsize, "bavail": (capacity - used) // bsize,
                # inodes: no fixed table, so a total of 2^32 with those in use taken off (df -i)
                "files": INODE_LIMIT, "ffree": INODE_LIMIT - len(self.ns.inodes),
                "namemax": 255}

    # -- extended attributes (the rules and limits: xattrs.py) -----------------------------

    def getxattr(self, ino: int, name: bytes) -> bytes:
        return xattrs.get(self.ns.get(ino), name)

    def listxattr(self, ino: int) -> list[bytes]:
        return xattrs.names(self.ns.get(ino))

    async def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        node = self.ns.get(ino)
        xattrs.check_name(name)
        await self._xattrs_change(node, lambda: xattrs.set_(node, name, value, flags))

    async def removexattr(self, ino: int, name: bytes) -> None:
        node = self.ns.get(ino)
        xattrs.check_name(name)
        await self._xattrs_change(node, lambda: xattrs.remove(node, name))

    async def _xattrs_change(self, node: Inode, change) -> None:
        """Applies `change` to the inode's table and records it where the inode is recorded:
        a journaled inode (a directory, a file whose content is on NVMe) gets the whole new
        table in one record; a file not yet written behind carries it in its FILE record.
        A file in the remote tier is uploaded again with the new table (its copy there goes
        first: another host sees no attributes but the current ones)."""
        obj = node.obj
        if obj is not None and obj.remote_info is not None:
            async with obj.content_lock():   # only remote: fetched first, its copy goes below
                if obj.remote_info is not None:
                    await self._load(node)
        old = node.xattrs
        change()
        node.ctime_ns = self.clock()
        if self._journaled(node) and not node.is_meta:
            try:
                self.tiers.log(index.xattrs_record(node))
            except FsError:   # not recorded: not changed
                node.xattrs = old
                raise
        if self.remote is not None and obj is not None and node.parent is not None:
            self.remote.forget_copy(node, self._remote_key(node))
            if not obj.writers:
                self.remote.admit(node, "written")

    # -- operator commands -----------------------------------------------------------------

    def evict(self, path: str | None) -> dict:
        """Removes files from the cache (a path, a directory's tree, or everything)."""
        top = self.ns.resolve(path or "/")
        removed = skipped = 0
        for node in list(self.ns.walk(top)):
            if node.obj is None or node.parent is None:   # symlinks etc. cost nothing
                continue
            if node.obj.busy:
                skipped += 1
                continue
            self.remove_object(node, "evicted by operator")
            removed += 1
        return {"removed": removed, "skipped_open": skipped}

    def usage(self, path: str | None) -> dict:
        top = self.ns.resolve(path or "/")
        out = {"files": 0, "dirs": 0, "other": 0, "bytes": 0, "dram_bytes": 0, "nvme_bytes": 0,
               "dirty": 0}
        for node in self.ns.walk(top):
            if node.is_dir:
                out["dirs"] += 1
                continue
            if node.obj is None:   # symlinks and special files: in the index, no bytes
                out["other"] += 1
                continue
            out["files"] += 1
            out["bytes"] += node.size
            if node.obj.resident:
                out["dram_bytes"] += node.size
            if node.obj.persisted:
                out["nvme_bytes"] += node.size
            out["dirty"] += node.obj.dirty
        return out

    def tier_of(self, node: Inode) -> str:
        obj = node.obj
        if obj is None:   # a directory, symlink or special file: the index is all of it
            return "dir" if node.is_dir else "index"
        in_remote = obj.remote_info is not None or (
            self.remote is not None and obj.remote_version == obj.version)
        where = [t for t, here in (("dram", obj.resident), ("nvme", obj.persisted),
                                   ("remote", in_remote)) if here]
        return "+".join(where) or "none"

    async def collect_orphans(self) -> int:
        """Removes `*.tmp` files nobody has open whose mtime is older than tmp_max_age:
        crashed writers leave them, and no connector cleans them up."""
        if not self.tmp_max_age:
            return 0
        cutoff = self.clock() - int(self.tmp_max_age * 1e9)
        count = 0
        for ino in list(self.tmp_inos):
            node = self.ns.inodes.get(ino)
            if node is None or node.obj is None or node.obj.busy or node.mtime_ns > cutoff:
                continue
            if node.parent is not None:
                self.remove_object(node, "orphaned temporary file")
                count += 1
        if count:
            self.tiers.stats.tmp_collected += count
            log.info("collected %d orphaned .tmp files", count)
        return count

    async def maintain(self, interval: float = 10.0) -> None:
        """Background housekeeping: orphan collection and journal checkpoints."""
        journal = self.tiers.journal
        while True:
            await trio.sleep(interval)
            await self.collect_orphans()
            self.tiers.refit_nvme()
            if journal is not None and journal.journal_bytes > self.tiers.journal_max_bytes:
                await self.checkpoint_in_background()

    def root(self) -> Inode:
        return self.ns.inodes[ROOT_INO]


def _lent(obj: StoredObject) -> bool:
    """Whether the object's memfd in DRAM was lent: a client's kernel may map it for any
    handle of the file (a writer's too) and write it with no request."""
    return obj.chunks is not None and obj.chunks.memfd is not None and obj.chunks.memfd.lent


def _chunk_crcs(chunks: list, size: int) -> bytes:
    """Worker thread: the chunk CRCs of an object's DRAM content, as write-behind takes them."""
    return crc.chunk_crcs(views(chunks, 0, size), CHUNK_SIZE)


def _seen(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns


def _copy_pairs(destinations: list, sources: list) -> None:
    for dst, src in zip(destinations, sources, strict=True):   # chunk-aligned alike
        dst[:] = src


class RemoteView:
    """The store as the remote tier sees it (bluecached.tiers.remote.StoreView): the few
    operations it may ask for, so it never reaches into the namespace or the tiers."""

    def __init__(self, store: Store):
        self._store = store

    def lookup(self, parent: int, name: bytes) -> Inode:
        return self._store.ns.lookup(parent, name)

    def directory_path(self, ino: int) -> bytes:
        ns = self._store.ns
        return ns.path_of(ns.directory(ino))

    def path_of(self, node: Inode) -> bytes:
        return self._store.ns.path_of(node)

    def holds(self, node: Inode) -> bool:
        return self._store.ns.inodes.get(node.ino) is node

    def is_temporary(self, node: Inode) -> bool:
        return node.ino in self._store.tmp_inos

    def add_directory(self, parent: int, name: bytes) -> Inode:
        return self._store.mkdir_like_parent(parent, name)

    def add_placeholder(self, parent: int, name: bytes, info) -> Inode:
        return self._store.add_placeholder(parent, name, info)

    def remove_object(self, node: Inode, reason: str) -> None:
        self._store.remove_object(node, reason)
