"""Clones made at a lookup, for the open that follows it (tiers.nvme.hit_path clone).

vLLM's reader looks a block up and opens it at once. An NVMe hit's OPEN waited for its clone:
a worker thread woken, FICLONERANGE, the loop woken again, ~0.25 ms on the 2-core VM while the
reader's vCPU sat idle. So the lookup of an object that the next open would clone starts the
clone, and the open takes it if the object is still what was cloned (same extent, version and
size: the store checks, as after any clone).

A clone nobody opens is closed after HOLD_S (the scheduler's exists checks of blocks it then
does not load): it shares the extent's blocks, so it costs an fd and, if the extent is freed
meanwhile, its space until then. At most LIMIT are held or in flight; past that a lookup
starts none.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

log = logging.getLogger("bluecached.clone_ahead")
HOLD_S = 1.0
LIMIT = 32


@dataclass
class _Ahead:
    extent: object
    version: int
    size: int
    done: trio.Event = field(default_factory=trio.Event)
    fd: int | None = None   # set when done, unless the clone failed
    taken: bool = False


class ClonesAhead:
    def __init__(self, clone: Callable[[object, int], int], limit: int = LIMIT,
                 hold: float = HOLD_S):
        """`clone(extent, size)`: blocking, a read-only fd of a clone (SegmentStore.clone)."""
        self._clone = clone
        self.limit = limit
        self.hold = hold
        self._ahead: dict[int, _Ahead] = {}
        self.made = 0     # clones started at a lookup
        self.taken = 0    # ... and given to the open that followed

    def __len__(self) -> int:
        return len(self._ahead)

    def start(self, nursery: trio.Nursery, ino: int, extent, version: int, size: int,
              pinned: Callable[[], Callable[[], None]]) -> None:
        """Starts a clone of `ino`'s extent unless one is held or LIMIT are. `pinned()` pins
        the object and returns its unpin, for the time of the clone."""
        held = self._ahead.get(ino)
        if held is not None and (held.extent is extent and held.version == version):
            return
        if held is not None:
            self._drop(ino)
        if len(self._ahead) >= self.limit:
            return
        ahead = self._ahead[ino] = _Ahead(extent, version, size)
        self.made += 1
        nursery.start_soon(self._make, ino, ahead, pinned())

    async def take(self, ino: int, extent, version: int, size: int) -> int | None:
        """The clone made for this open, waited for if still in flight; None where there is
        none of this extent, version and size (the caller clones)."""
        ahead = self._ahead.pop(ino, None)
        if ahead is None:
            return None
        ahead.taken = True
        try:
            await ahead.done.wait()
        except BaseException:   # cancelled: the clone is nobody's
            if ahead.done.is_set() and ahead.fd is not None:
                os.close(ahead.fd)
            ahead.taken = False   # _make closes it when it is made
            raise
        if ahead.fd is not None and (ahead.extent is not extent or ahead.version != version
                                     or ahead.size != size):
            os.close(ahead.fd)
            return None
        if ahead.fd is not None:
            self.taken += 1
        return ahead.fd

    async def _make(self, ino: int, ahead: _Ahead, unpin: Callable[[], None]) -> None:
        try:
            ahead.fd = await trio.to_thread.run_sync(self._clone, ahead.extent, ahead.size)
        except OSError as e:   # the open tries again, and says so
            log.debug("no clone ahead of inode %d's open: %s", ino, e)
        finally:
            unpin()
            ahead.done.set()
        if self._ahead.get(ino) is not ahead and not ahead.taken and ahead.fd is not None:
            os.close(ahead.fd)   # dropped while it was made
            ahead.fd = None
            return
        try:
            await trio.sleep(self.hold)
        finally:
            if self._ahead.get(ino) is ahead:   # never opened (or the daemon stops)
                self._drop(ino)

    def _drop(self, ino: int) -> None:
        ahead = self._ahead.pop(ino)
        if ahead.fd is not None and ahead.done.is_set() and not ahead.taken:
            os.close(ahead.fd)
            ahead.fd = None
