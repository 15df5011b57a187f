"""A regular file's bytes and where they live (DRAM: chunks of its memfd; an NVMe extent; or
both)."""

import mmap

import trio

from .dram import CHUNK_SIZE, Chunks
from .nvme import Extent

# Never written: the source for holes in sparse files, on reads and on write-behind.
ZERO_CHUNK = mmap.mmap(-1, CHUNK_SIZE)


class StoredObject:
    __slots__ = (
        "chunks",      # Chunks: windows of the object's memfd (None = hole), or None when
                       # not in DRAM
        "dirty",       # DRAM holds content that is not on NVMe
        "extent",      # NVMe placement of the persisted content, if any
        "crcs",        # CRC32C per chunk of the persisted content (packed little-endian u32)
        "persisted",   # a FILE record for the current content is in the journal
        "version",     # bumped on every change: write-behind discards a copy that raced one
        "opens",       # open handles
        "writers",     # open handles with write access
        "backed",      # open handles whose client holds the memfd (the `backing` op)
        "pins",        # operations touching the chunks right now (copies, write-behind)
        "deferred",    # chunks freed while pinned, returned to the pool at unpin
        "unpinned",    # trio.Event set when pins drop to 0, while someone waits for that
        "lock",        # serialises changes to the content (write, truncate, promotion)
        "lock_reads",  # the lock's holder only reads the content (write-behind): a read
                       # of resident chunks need not wait for it
        "queued",      # waiting for write-behind
        "remote_version",  # the content version the remote tier holds (-1: none known)
        "remote_info",     # a placeholder's S3 object (content only remote), else None
        "uploading",       # trio.Event while an upload reads the chunks; writes wait for it
        "arrival",         # a remote fetch in flight (bluecached.arrival): readers wait on it
        "kernel_writer",   # the handle whose client's kernel writes the memfd directly
                           # (Store.backing): size and bytes are the memfd's, seen by
                           # Store.observe; None otherwise
        "kernel_seen",     # (size, mtime_ns) of the memfd when last observed
        "kernel_refused",  # (errno, why): the kernel writer's memfd was stopped from growing
        "read_from_nvme",  # served straight from NVMe once: the next open promotes it
        "removed",         # why the cache removed the file (Store.remove_object), else None
    )

    def __init__(self):
        self.chunks: Chunks | None = Chunks()
        self.dirty = False
        self.extent: Extent | None = None
        self.crcs = b""
        self.persisted = False
        self.version = 0
        self.opens = 0
        self.writers = 0
        self.backed = 0
        self.pins = 0
        self.deferred: list = []
        self.unpinned: trio.Event | None = None
        self.lock: trio.Lock | None = None
        self.lock_reads = False
        self.queued = False
        self.remote_version = -1
        self.remote_info = None
        self.uploading: trio.Event | None = None
        self.arrival = None
        self.kernel_writer: int | None = None
        self.kernel_seen = (0, 0)
        self.kernel_refused: tuple[int, str] | None = None
        self.read_from_nvme = False
        self.removed: str | None = None

    def content_lock(self) -> trio.Lock:
        if self.lock is None:
            self.lock = trio.Lock()
        return self.lock

    @property
    def resident(self) -> bool:
        return self.chunks is not None

    @property
    def busy(self) -> bool:
        """Open, in flight or locked: never evicted."""
        return bool(self.opens or self.pins or (self.lock is not None and self.lock.locked()))


def chunk_count(size: int) -> int:
    return -(-size // CHUNK_SIZE)


def views(chunks: list, offset: int, length: int) -> list[memoryview]:
    """Consecutive slices of the chunks covering [offset, offset+length); holes read as zeros."""
    out = []
    end = offset + length
    while offset < end:
        index, start = divmod(offset, CHUNK_SIZE)
        stop = min(CHUNK_SIZE, start + end - offset)
        chunk = chunks[index] if index < len(chunks) else None
        out.append(memoryview(chunk if chunk is not None else ZERO_CHUNK)[start:stop])
        offset += stop - start
    return out
