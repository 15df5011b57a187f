"""DRAM tier: a bounded pool of page-aligned 1 MiB chunks.

Object bytes live in fixed chunks rather than one buffer per object: a FUSE write (at most
1 MiB) touches one or two chunks, files can grow without reallocating, and a list of page-aligned
chunks is what pwritev/preadv with O_DIRECT want. Freed chunks are kept for reuse, so a busy
cache does not pay mmap + page faults for every object.
"""

import mmap

CHUNK_SIZE = 1 << 20


class DramPool:
    def __init__(self, capacity: int):
        self.capacity = capacity - capacity % CHUNK_SIZE
        self._free: list[mmap.mmap] = []
        self._in_use = 0
        # Told before a chunk is unmapped (a DMA engine may hold a registration on it).
        self.before_unmap = None

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
        if self._free:
            chunk = self._free.pop()
            if zero:
                chunk[:] = _ZEROS
            return chunk
        return mmap.mmap(-1, CHUNK_SIZE)  # anonymous maps are born zeroed

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
