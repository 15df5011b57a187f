"""DRAM tier: a bounded pool of page-aligned 1 MiB chunks.

Object bytes live in fixed chunks rather than one buffer per object: a FUSE write (at most
1 MiB) touches one or two chunks, files can grow without reallocating, and a list of page-aligned
chunks is what pwritev/preadv with O_DIRECT want. Freed chunks are kept for reuse, so a busy
cache does not pay mmap + page faults for every object.
"""

import logging
import mmap
import os
import time

import trio

CHUNK_SIZE = 1 << 20

log = logging.getLogger("bluecached.tiers.dram")


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class DramPool:
    def __init__(self, capacity: int, before_unmap=None):
        self.capacity = capacity - capacity % CHUNK_SIZE
        memory = physical_memory()
        if self.capacity > memory:
            # Chunks are mapped as they are needed, so this starts; a full tier would then be
            # swapped or killed by the OOM killer, taking every cached byte with it.
            log.warning("the DRAM tier (tiers.dram.size, %d MiB) is larger than this machine's "
                        "memory (%d MiB): it will never fill without the OOM killer stepping in",
                        self.capacity >> 20, memory >> 20)
        self._free: list[mmap.mmap] = []
        self._in_use = 0
        # Told before a chunk is unmapped (a DMA engine may hold a registration on it).
        self.before_unmap = before_unmap
        self._taken = trio.Event()   # set by take(): map_ahead tops the free list up
        self.last_take = -1e9        # time.monotonic() of the last take

    @property
    def used_bytes(self) -> int:
        return self._in_use * CHUNK_SIZE

    @property
    def free_chunks(self) -> int:
        return self.capacity // CHUNK_SIZE - self._in_use

    def take(self, zero: bool = True) -> mmap.mmap | None:
        """A chunk, or None when the tier is full (the caller evicts and retries).

        zero=False is for a caller that overwrites the whole chunk at once.
        """
        if self._in_use >= self.capacity // CHUNK_SIZE:
            return None
        self._in_use += 1
        self._taken.set()
        self.last_take = time.monotonic()
        if self._free:
            chunk = self._free.pop()
            if zero:
                chunk[:] = _ZEROS
            return chunk
        return mmap.mmap(-1, CHUNK_SIZE)  # anonymous maps are born zeroed

    def missing_chunks(self) -> int:
        """Chunks of the capacity not mapped yet (neither in use nor kept free)."""
        return self.capacity // CHUNK_SIZE - self._in_use - len(self._free)

    def add_free(self, chunks: list[mmap.mmap]) -> None:
        """Chunks mapped ahead of need (map_ahead): kept up to the capacity."""
        for chunk in chunks:
            if self.missing_chunks() > 0:
                self._free.append(chunk)
            else:
                self._unmap(chunk)

    def give(self, chunk: mmap.mmap) -> None:
        self._in_use -= 1
        if len(self._free) < self.capacity // CHUNK_SIZE - self._in_use:
            self._free.append(chunk)
        else:  # capacity shrank: let it go
            self._unmap(chunk)

    def _unmap(self, chunk: mmap.mmap) -> None:
        if self.before_unmap is not None:
            self.before_unmap(chunk)
        chunk.close()

    def close(self) -> None:
        for chunk in self._free:
            self._unmap(chunk)
        self._free.clear()


_ZEROS = bytes(CHUNK_SIZE)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
MAP_AHEAD_BATCH = 64   # chunks mapped per worker-thread call
MAP_AHEAD_QUIET_S = 0.05   # a pause in takes this long lets map_ahead top the free list up


async def map_ahead(pool: DramPool, ahead_bytes: int) -> None:
    """Keeps at least `ahead_bytes` of chunks mapped and touched in the free list (freed
    chunks count: they are warm), so that no request pays the page faults of fresh memory.
    It tops the list up in a worker thread once takes pause for MAP_AHEAD_QUIET_S: mapping
    costs the CPU the kernel spends zeroing pages, which a burst of writes needs more.
    Memory committed: what is in use plus that much; `ahead_bytes` >= the capacity maps the
    whole tier at once."""
    ahead = ahead_bytes // CHUNK_SIZE
    while True:
        while (missing := min(pool.missing_chunks(), ahead - len(pool._free))) > 0:
            pool.add_free(await trio.to_thread.run_sync(populated_chunks,
                                                        min(MAP_AHEAD_BATCH, missing)))
        pool._taken = trio.Event()
        await pool._taken.wait()
        # Until takes pause. Polled, not woken by each take: a burst takes a chunk per 1 MiB
        # written, and a wake-up (new Event, new cancel scope) for each was 7.7% of
        # bluecached's working samples under 8 llm-d writers (py-spy, 2-core Intel Xeon VM).
        while (quiet := time.monotonic() - pool.last_take) < MAP_AHEAD_QUIET_S:  # noqa: ASYNC110
            await trio.sleep(MAP_AHEAD_QUIET_S - quiet)


def populated_chunks(count: int) -> list[mmap.mmap]:
    """Chunks whose pages the kernel has already supplied (blocking: a worker thread's job):
    a first write to a fresh chunk otherwise takes 256 page faults on the request's path."""
    chunks = []
    for _ in range(count):
        chunk = mmap.mmap(-1, CHUNK_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
        if not _POPULATE:
            for page in range(0, CHUNK_SIZE, mmap.PAGESIZE):
                chunk[page] = 0
        chunks.append(chunk)
    return chunks
