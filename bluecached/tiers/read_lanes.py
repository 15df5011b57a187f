"""Direct NVMe-hit reads on the disk: one at a time per object, lowest offset first, and at
most `depth` at once in all.

hostd reads a file's next pieces ahead, so an NVMe hit's reads of one object arrive together
(five 4 MiB reads within 0.5 ms), and with many readers, as many reads as hostd has buffers
(16). Sent to the disk together, they come back together: the 2-core AMD EPYC benchmark VM's
virtio disk answered a batch of queued reads at once, after the time of all of them (ad hoc,
O_DIRECT, 32 MiB files: one 4 MiB read at a time, the first after 1.2 ms and all in 9.2 ms;
eight at once, all after 9.0 ms). The readers then waited for the whole batch, and the replies
(a CRC32C check and a 4 MiB copy each) all came after the disk's last byte, with the disk idle
meanwhile. A few at a time, in order, each piece is checked and answered while the next ones
are on the disk, for about the same disk time. On a real NVMe the block layer splits a 4 MiB
read into the device's own request size, so a few such reads still keep its queue full.

Each read runs in its caller's worker thread, which waits for its turn; the lane holds no
thread of its own. Turns go to the object whose read waited longest (then lowest offset
first within it), so one reader's read-ahead does not starve the others.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import threading
from collections.abc import Iterator

# tiers.nvme.read_depth's default: 32 MiB blocks read after a restart through the mount by 8
# and 64 vLLM readers at once, against cold reads of the same files in a plain directory (ad
# hoc, 2 runs each, 2-core AMD EPYC VM): unbounded 0.63-0.66x (8 readers), 1 0.90-0.91x
# (8) and 0.77x (64), 2 0.90-0.92x (8 and 64), 4 0.88-0.96x (8 and 64).
READ_DEPTH = 4


class _Read:
    __slots__ = ("offset", "ticket", "go")

    def __init__(self, offset: int, ticket: int) -> None:
        self.offset = offset
        self.ticket = ticket       # arrival order, across all objects
        self.go = threading.Event()

    def __lt__(self, other: _Read) -> bool:   # a lane's waiting reads: by offset
        return (self.offset, self.ticket) < (other.offset, other.ticket)


class _Lane:
    __slots__ = ("waiting", "running")

    def __init__(self) -> None:
        self.waiting: list[_Read] = []   # sorted by offset
        self.running = False


class ReadLanes:
    """`with lanes.turn(key, offset):` around a blocking read of object `key` at `offset`.
    Thread-safe. A read waits while one of the same key runs, while one of it at a lower
    offset waits (a reader's pieces go in its order even when asked for out of it), and
    while `depth` reads run in all."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"read depth must be at least 1, not {depth}")
        self.depth = depth
        self._lock = threading.Lock()
        self._lanes: dict[object, _Lane] = {}
        self._running = 0
        self._tickets = itertools.count()

    @contextlib.contextmanager
    def turn(self, key: object, offset: int) -> Iterator[None]:
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane()
            read = _Read(offset, next(self._tickets))
            bisect.insort(lane.waiting, read)
            self._grant()
        read.go.wait()
        try:
            yield
        finally:
            with self._lock:
                lane.running = False
                self._running -= 1
                if not lane.waiting:
                    del self._lanes[key]
                self._grant()

    def _grant(self) -> None:
        """Under the lock: starts waiting reads while fewer than `depth` run, each the
        lowest offset of an idle lane, the lane whose read waited longest first."""
        while self._running < self.depth:
            ready = [lane for lane in self._lanes.values() if lane.waiting and not lane.running]
            if not ready:
                return
            lane = min(ready, key=lambda lane: min(r.ticket for r in lane.waiting))
            read = lane.waiting.pop(0)
            lane.running = True
            self._running += 1
            read.go.set()

    def waiting(self, key: object) -> int:
        """Reads of `key` waiting for their turn."""
        with self._lock:
            lane = self._lanes.get(key)
            return len(lane.waiting) if lane is not None else 0

    def busy(self) -> int:
        """Objects with a read running or waiting."""
        with self._lock:
            return len(self._lanes)
