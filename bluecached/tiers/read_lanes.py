"""One lane per object for its direct NVMe reads: they reach the disk one at a time, the lowest
offset first.

hostd reads a file's next pieces ahead, so an NVMe hit's reads of one object arrive together
(five 4 MiB reads within 0.5 ms). Sent to the disk together, they come back together: this
VM's virtio disk answered a batch of queued reads at once, after the time of all of them (ad
hoc, O_DIRECT, 32 MiB files: one 4 MiB read at a time, the first after 1.2 ms and all in 9.2
ms; eight at once, all after 9.0 ms). The reader then waits for the whole batch before its
first piece, and its replies (a CRC32C check and a 4 MiB copy each) all come after the disk's
last byte. One at a time, in order, each piece is checked and answered while the next one is
on the disk, for about the same disk time. Other objects' reads (other readers) still go
beside them, so the disk keeps a queue when several files are read.

A lane lives while reads of its object wait or run: no thread of its own, each read runs in
the caller's worker thread, which waits for its turn.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Iterator


class _Lane:
    __slots__ = ("changed", "waiting", "running")

    def __init__(self, lock: threading.Lock) -> None:
        self.changed = threading.Condition(lock)
        self.waiting: list[int] = []   # offsets, sorted
        self.running = False


class ReadLanes:
    """`with lanes.turn(key, offset):` around a blocking read of object `key` at `offset`.
    Thread-safe; a read waits while one of the same key runs, or while one of it at a lower
    offset waits (so a reader's pieces go in its order even when asked for out of it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lanes: dict[object, _Lane] = {}

    @contextlib.contextmanager
    def turn(self, key: object, offset: int) -> Iterator[None]:
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane(self._lock)
            bisect.insort(lane.waiting, offset)
            while lane.running or lane.waiting[0] != offset:
                lane.changed.wait()
            lane.waiting.pop(0)
            lane.running = True
        try:
            yield
        finally:
            with self._lock:
                lane.running = False
                if lane.waiting:
                    lane.changed.notify_all()
                else:
                    del self._lanes[key]

    def waiting(self, key: object) -> int:
        """Reads of `key` waiting for their turn."""
        with self._lock:
            lane = self._lanes.get(key)
            return len(lane.waiting) if lane is not None else 0

    def busy(self) -> int:
        """Objects with a read running or waiting."""
        with self._lock:
            return len(self._lanes)
