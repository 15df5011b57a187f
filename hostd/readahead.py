"""Read-ahead for sequential reads: the daemon fills the next slot while the kernel copies out
the current one.

A FUSE read with direct_io reaches hostd 1 MiB at a time, one request after the other per
reader (the kernel waits for each answer before it sends the next), so without read-ahead a
32 MiB block costs 32 round trips to the daemon in a row. With a full 1 MiB read at offset
X (beside it, not after it: the disk then starts on what follows while X is on its way), the
next pieces (from X + 1 MiB) are asked for at once into spare slots; the reader's next
request, if it is for exactly that offset, is answered from the slot.

Bytes read ahead must never be older than what a read issued later would see. Content
changes only through a handle open for writing (writes, the zero-copy STORE, O_TRUNC) or a
truncate (setattr), and every one of those passes through hostd: so nothing is read ahead
for a file that has a writable handle open, and a read ahead still unserved when such a
handle opens or closes, or when a setattr begins or ends, is marked stale and thrown away
rather than served. A daemon restart throws away all. Read-ahead takes a slot only while at
least half of them are free, so it never makes a write or a read wait for a slot.

Reads larger than a slot (mount.max_pages above 256) are read ahead the same way, a request's
size at a time, into the staging region's large buffers (Staging.large): the piece size is the
one of the read that started it. A smaller read at a piece's offset is served from it (a file's
last read, which the kernel sizes to the file's end); a larger one starts again.
"""

from collections import deque
from dataclasses import dataclass, field

import trio

from bluecached.wire.client import RemoteError

# Large buffers read ahead per reader (of the link's 16): with 4 MiB requests, vLLM's O_DIRECT
# reads of blocks only on NVMe took 14.4-16.9 ms per 32 MiB block at 4, 15.8-17.1 at 2 (6
# alternating runs x 16 blocks, 2-core AMD EPYC VM; 8 was slower again: 17.6-18.1). Two
# readers at most (max_readers) leave half the buffers for requests.
LARGE_DEPTH = 4


@dataclass(slots=True, eq=False)
class _Fetch:
    fh: int
    ino: int
    offset: int
    slot: int
    generation: int    # the daemon connection it was read from
    piece: int         # bytes asked for: a slot's, or a large buffer's
    done: trio.Event = field(default_factory=trio.Event)
    length: int = -1
    failed: bool = False
    stale: bool = False       # the file may have changed since it was asked for
    abandoned: bool = False   # nobody will serve it: whoever finishes last gives the slot


class ReadAhead:
    """Up to `depth` consecutive pieces read ahead per open handle. `fetch(fh, offset, slot,
    length)` asks the daemon for `length` bytes at `offset` into staging slot (or large
    buffer) `slot` and returns the bytes it put there."""

    def __init__(self, staging, fetch, slot_size: int, depth: int = 4, max_readers: int = 2):
        self.staging = staging
        self.fetch = fetch
        self.slot_size = slot_size
        self.depth = depth
        # With more files open for reading, their own requests keep both daemons busy and
        # read-ahead's extra work only costs (bench/mount_bench.py, 2-core Intel Xeon VM: one
        # reader +60-75%, 8 readers -5-10% when it read ahead regardless).
        self.max_readers = max_readers
        self.readers = 0     # handles open read-only
        self.nursery: trio.Nursery | None = None   # set by the link's background task
        self.served = 0      # reads answered from a slot read ahead
        self.wasted = 0      # slots read ahead and thrown away (not sequential, changed, closed)
        self._pending: dict[int, deque[_Fetch]] = {}   # host fh -> its reads ahead, in order
        self._writers: dict[int, int] = {}             # ino -> handles open for writing

    # -- what changes a file's content ---------------------------------------------------------

    def opened(self, ino: int, writable: bool) -> None:
        if not writable:
            self.readers += 1
        else:
            self._writers[ino] = self._writers.get(ino, 0) + 1
            self._touch(ino)

    def closed(self, fh: int, ino: int, writable: bool) -> None:
        self._drop(self._pending.pop(fh, ()))
        if not writable:
            self.readers -= 1
        else:
            left = self._writers.get(ino, 0) - 1
            if left > 0:
                self._writers[ino] = left
            else:
                self._writers.pop(ino, None)
            self._touch(ino)   # its last writes landed after any read ahead began

    def changing(self, ino: int) -> None:
        """Before and after a setattr (a truncate changes content)."""
        self._touch(ino)

    def _touch(self, ino: int) -> None:
        for window in self._pending.values():   # one per reader: a short list
            for f in window:
                if f.ino == ino:
                    f.stale = True

    def _current(self, f: _Fetch, generation: int) -> bool:
        return f.generation == generation and not f.stale

    # -- reads ---------------------------------------------------------------------------------

    async def take(self, fh: int, offset: int, size: int,
                   generation: int) -> tuple[int, int] | None:
        """(slot or large buffer, bytes in it) read ahead for `fh` at `offset`, for a read of
        `size` bytes, or None. The caller gives it back. A read smaller than the piece is
        served from it too: the last read of a file, which the kernel sizes to the file's end,
        asks for less than the pieces read ahead before it."""
        window = self._pending.get(fh)
        if not window:
            return None
        f = window[0]
        if f.offset != offset or size > f.piece or not self._current(f, generation):
            self._drop(self._pending.pop(fh))   # not sequential any more: start again
            return None
        window.popleft()
        try:
            await f.done.wait()
        except BaseException:
            self._drop((f,))
            raise
        if f.failed or not self._current(f, generation):
            self._drop((f,))   # the reader asks the daemon itself, and gets any error then
            return None
        self.served += 1
        return f.slot, f.length

    def start(self, fh: int, ino: int, end: int, size: int, generation: int,
              piece: int | None = None) -> None:
        """After a full read ending at `end`: keep `depth` pieces read ahead (a slot each,
        or with `piece` larger than a slot, large buffers: at most LARGE_DEPTH), while they are to
        spare, nothing can change the file meanwhile and the file goes on.
        `size` is the file's size when the handle was opened: while no writer is open it is
        the size (a writer opening makes all read ahead stale), and after one closed it is
        only a hint, so reads past it are simply not read ahead."""
        if self.nursery is None or self._writers.get(ino) or self.readers > self.max_readers:
            return
        piece = piece or self.slot_size
        large = piece > self.slot_size
        depth = min(self.depth, LARGE_DEPTH) if large else self.depth
        window = self._pending.setdefault(fh, deque())
        while len(window) < depth and (self.staging.free_large() > 1 if large else
                                       self.staging.free() * 2 >= self.staging.slots):
            if window and window[-1].done.is_set() and window[-1].length < window[-1].piece:
                break   # the file ends there
            offset = window[-1].offset + window[-1].piece if window else end
            if offset >= size:
                break
            slot = self.staging.take_large_nowait() if large else self.staging.take_nowait()
            if slot < 0:
                break
            f = _Fetch(fh, ino, offset, slot, generation, piece)
            window.append(f)
            self.nursery.start_soon(self._run, f)
        if not window:
            del self._pending[fh]

    async def _run(self, f: _Fetch) -> None:
        try:
            f.length = await self.fetch(f.fh, f.offset, f.slot, f.piece)
        except RemoteError:
            f.failed = True
        finally:
            f.done.set()
            if f.abandoned:
                self.staging.give(f.slot)

    def _drop(self, fetches) -> None:
        for f in fetches:
            self.wasted += 1
            f.abandoned = True
            if f.done.is_set():
                self.staging.give(f.slot)
