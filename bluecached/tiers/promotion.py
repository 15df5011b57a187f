"""NVMe -> DRAM promotion, and NVMe hits served without it: reading an object back with its
CRC32Cs checked.

`read_checked` serves a first hit on an object only on NVMe straight from the disk into the
reply's memory (hostd's staging slot), one whole chunk or more per request, checked before it
is answered: no fresh DRAM to supply, no copy through the tier. Reading an object into DRAM,
two ways. `read_and_verify` reads the whole object, then checks it: what a caller that needs
the whole object at once uses (Tiers.promote: an upload, a truncate, a write). `Promotions`
streams it for readers: the object is read in pieces of PIECE_CHUNKS chunks, and each chunk is
served (bluecached.arrival) as soon as its checksum matched, so the first reader's copy runs
beside the rest of the disk read instead of after it. No byte is served before its chunk's
CRC32C matched; a mismatch fails every reader (EIO) and removes the object, as before.
"""

from __future__ import annotations

import contextlib
import logging
import os

import crc32c
import trio

from .. import crc
from ..arrival import Arrival
from ..namespace import Inode
from .clone_ahead import ClonesAhead
from .dram import CHUNK_SIZE, PAGE_SIZE
from .nvme import Extent, SegmentStore
from .objects import chunk_count
from .read_lanes import ReadLanes

log = logging.getLogger("bluecached.tiers")

# Chunks per disk read when streaming: large enough to keep a disk's queue busy (4 MiB, as
# the kernel's readahead at most), small enough that the first reader starts early.
PIECE_CHUNKS = 4


def _supply(chunks, start: int, length: int) -> None:
    """Fresh memory: fallocate supplies a memfd's pages 2.1-3.8x faster than the faults an
    O_DIRECT read takes one page at a time (bench/memfd_supply.py, 3 runs, 2-core AMD EPYC
    VM), and an NVMe hit's promotion is mostly this. (A spare's pages are there already.)"""
    memfd = getattr(chunks, "memfd", None)
    if memfd is not None and length > 0:
        with contextlib.suppress(OSError):
            os.posix_fallocate(memfd.fd, start, min(length, memfd.size - start))


def _chunk_matches(chunk, index: int, size: int, expected) -> bool:
    n = min(CHUNK_SIZE, size - index * CHUNK_SIZE)
    if crc32c.crc32c(memoryview(chunk)[:n]) != expected[index]:
        return False
    if n < CHUNK_SIZE:
        # Past the end reads as zeros (the disk holds padding there). Only within the page
        # that holds the end: a memfd's pages past its EOF fault (SIGBUS) when touched.
        pad_end = min(CHUNK_SIZE, -(-n // PAGE_SIZE) * PAGE_SIZE)
        chunk[n:pad_end] = bytes(pad_end - n)
    return True


def _expected(crcs: bytes, count: int):
    return crc.unpack(crcs) if len(crcs) == 4 * count else None


def read_and_verify(nvme: SegmentStore, extent, chunks: list, size: int, crcs: bytes) -> int:
    """Worker thread: read the extent into chunks; returns the index of the first chunk whose
    CRC32C does not match, or -1."""
    _supply(chunks, 0, size)
    nvme.read(extent, [memoryview(c) for c in chunks], size)
    expected = _expected(crcs, len(chunks))
    if expected is None:
        return 0
    for i, chunk in enumerate(chunks):
        if not _chunk_matches(chunk, i, size, expected):
            return i
    return -1


def read_verify_and_mark(nvme: SegmentStore, extent: Extent, chunks: list, size: int,
                         crcs: bytes, mark) -> int:
    """Worker thread: as read_and_verify, piece by piece, calling mark(i) for each chunk
    whose CRC32C matched, in order. Returns the first mismatching chunk's index, or -1."""
    expected = _expected(crcs, len(chunks))
    if expected is None:
        return 0
    for first in range(0, len(chunks), PIECE_CHUNKS):
        last = min(len(chunks), first + PIECE_CHUNKS)
        start = first * CHUNK_SIZE
        length = min(size, last * CHUNK_SIZE) - start
        _supply(chunks, start, length)
        nvme.read(Extent(extent.offset + start, extent.length - start),
                  [memoryview(c) for c in chunks[first:last]], length)
        for i in range(first, last):
            if not _chunk_matches(chunks[i], i, size, expected):
                return i
            mark(i)
    return -1


def read_checked(nvme: SegmentStore, lanes: ReadLanes, extent: Extent, crcs: bytes, size: int,
                 first: int, dst: memoryview) -> bool:
    """Worker thread: whole chunks from `first` on, len(dst) bytes (the last may end at the
    object's end), read from the extent straight into `dst` in the object's lane (one read
    on the disk at a time: read_lanes.py); True if every chunk's CRC32C matched, checked
    after the lane is free for the next read. The caller serves them only then."""
    expected = _expected(crcs, chunk_count(size))
    if expected is None:
        return False
    start = first * CHUNK_SIZE
    with lanes.turn(extent.offset, start):
        nvme.read(Extent(extent.offset + start, extent.length - start), [dst], len(dst))
    for k in range(-(-len(dst) // CHUNK_SIZE)):
        piece = dst[k * CHUNK_SIZE:(k + 1) * CHUNK_SIZE]
        if crc32c.crc32c(piece) != expected[first + k]:
            return False
    return True


class Promotions:
    """Streaming promotions, each a task of this service's nursery (so it outlives the
    request that started it: every reader of the object waits on it)."""

    def __init__(self, tiers):
        self.tiers = tiers
        self._nursery: trio.Nursery | None = None
        self._configured = "promote"
        self.clones_ahead = ClonesAhead(lambda extent, size: tiers.nvme.clone(extent, size))

    def configure(self, hit_path: str) -> None:
        self._configured = hit_path

    @property
    def mode(self) -> str:
        """tiers.nvme.hit_path while the service runs; "promote" (the whole object before the
        open is answered) where it does not, as in tests that drive Tiers alone."""
        return self._configured if self._nursery is not None else "promote"

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def clone_ahead(self, node: Inode) -> None:
        """Starts the clone an O_DIRECT open of the object would wait for (clone_ahead.py):
        the caller checked that such an open would clone it."""
        if self._nursery is None:
            return
        obj = node.obj

        def pinned():   # no eviction frees the extent while it is cloned
            self.tiers.pin(obj)
            return lambda: self.tiers.unpin(obj)

        self.clones_ahead.start(self._nursery, node.ino, obj.extent, obj.version, node.size,
                                pinned)

    def start(self, node: Inode) -> Arrival | None:
        """The object's promotion in flight, or a new one; None where none can stream (the
        service does not run, the object is resident or has nothing on NVMe): read it the
        usual way."""
        obj = node.obj
        if obj.arrival is not None:
            return obj.arrival
        if (self._nursery is None or obj.chunks is not None or obj.extent is None
                or obj.remote_info is not None or not node.size):
            return None
        arrival = obj.arrival = Arrival(chunk_count(node.size), source="NVMe tier")
        self._nursery.start_soon(self._promote, node, arrival)
        return arrival

    async def _promote(self, node: Inode, arrival: Arrival) -> None:
        tiers, obj = self.tiers, node.obj
        try:
            async with obj.content_lock():
                if obj.chunks is not None or obj.extent is None:
                    return   # promoted or dropped meanwhile: readers go the usual way
                tiers.stats.dram.misses += 1
                # Only room DRAM has now (Tiers.promote, wait=False): else abandoned (the
                # finally below), and its readers read the disk (Store._read_past_dram).
                chunks = tiers.try_take_content(node.size)
                if chunks is None:
                    return
                arrival.started(chunks)
                token = trio.lowlevel.current_trio_token()

                def checked(index: int) -> None:   # a worker thread: hand it to the loop
                    token.run_sync_soon(arrival.mark, index)

                tiers.pin(obj)
                try:
                    bad = await trio.to_thread.run_sync(
                        read_verify_and_mark, tiers.nvme, obj.extent, chunks, node.size,
                        obj.crcs, checked)
                except OSError as e:
                    arrival.fail(f"read failed: {e}")
                    tiers.give_chunks(obj, chunks)
                    log.error("reading inode %d from NVMe failed: %s", node.ino, e)
                    return
                except BaseException:
                    arrival.fail("the promotion was interrupted")
                    tiers.give_chunks(obj, chunks)
                    raise
                finally:
                    tiers.unpin(obj)
                if bad >= 0:
                    arrival.fail("checksum mismatch: object removed")
                    tiers.give_chunks(obj, chunks)
                    tiers.stats.checksum_failures += 1
                    log.error("checksum mismatch in inode %d (%s) chunk %d: object removed",
                              node.ino, node.name, bad)
                    tiers.drop_corrupt(node)
                    return
                tiers.stats.nvme.hits += 1
                obj.chunks = chunks
                tiers.mark_resident(node)
                arrival.finish()
        except Exception:
            # A bug here must not end the daemon (this is a task of the service's nursery)
            # with every object only DRAM holds: as write-behind, the failure is this
            # object's, its readers get EIO and it stays on NVMe.
            log.exception("promotion of inode %d failed unexpectedly", node.ino)
            if arrival.failed is None:
                arrival.fail("the promotion failed unexpectedly")
        finally:
            if obj.arrival is arrival:
                obj.arrival = None
            if not (arrival.complete or arrival.failed):
                arrival.abandon()

