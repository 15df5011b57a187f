"""An object's bytes on their way into DRAM from the remote tier or NVMe (tiers/promotion.py),
served as they are checked.

A fetch holds the object's content lock from start to end (writes, truncation and promotion
wait for it), but readers do not take that lock while an arrival is attached: they wait only
for the chunks they need, each of which the fetch marks once its CRC32C matched. A reader pins
the object while it copies, so chunks a failed fetch gives back stay out of the pool until the
copy is done.
"""

from __future__ import annotations

import errno

import trio

from .namespace import FsError


class Arrival:
    def __init__(self, count: int, source: str = "remote tier"):
        self.source = source              # where the bytes come from, for errors
        self.chunks: list | None = None   # the DRAM chunks, once taken
        self._ready = bytearray(count)    # 1: that chunk's bytes are in and checked
        self.complete = False             # every chunk is in: the object holds them now
        self.failed: str | None = None
        self.failed_errno = errno.EIO
        self.abandoned = False            # no fetch after all: readers take the usual path
        self.was_read = False             # a reader was served from it (a prefetch's)
        self._changed = trio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def started(self, chunks: list) -> None:
        self.chunks = chunks
        self._notify()

    def mark(self, index: int) -> None:
        self._ready[index] = 1
        self._notify()

    def finish(self) -> None:
        self.complete = True
        self._notify()

    def fail(self, why: str, err: int = errno.EIO) -> None:
        """Its readers get `err`: EIO, or ESTALE for bytes that are no longer anywhere."""
        self.failed = why
        self.failed_errno = err
        self._notify()

    def abandon(self) -> None:
        self.abandoned = True
        self._notify()

    def ready_until(self, first: int, last: int) -> int:
        """One past the last chunk of the ready run that starts at `first` (at most `last`)."""
        if self.complete:
            return last
        end = self._ready.find(0, first, last)
        return last if end == -1 else end

    async def wait_complete(self) -> None:
        """Until the object holds every chunk (EIO if the fetch failed)."""
        while not self.complete:
            if self.failed is not None:
                raise FsError(self.failed_errno, f"{self.source}: {self.failed}")
            await self._changed.wait()

    async def wait_for(self, index: int) -> bool:
        """Until chunk `index` is ready (True) or the fetch was abandoned (False); EIO if it
        failed: bytes that did not arrive checked are never served."""
        while True:
            if self.failed is not None:
                raise FsError(self.failed_errno, f"{self.source}: {self.failed}")
            if self.abandoned:
                return False
            if self.chunks is not None and (self.complete or self._ready[index]):
                return True
            await self._changed.wait()
