"""Writes hostd has acknowledged to the kernel whose daemon call has not returned yet.

FUSE `direct_io` sends one request at a time per writer, so waiting for bluecached before
answering puts a whole daemon round trip on the writer's path for every 1 MiB. hostd answers
once the bytes are in its staging slot instead, and sends the daemon call in the background.
What keeps that invisible to clients: the writes go out in the order they were answered (one
sender, link.py), and, here, anything that could observe an inode (a read, its attributes, a
rename or a listing) first waits for the writes it must see.
"""

from __future__ import annotations

import trio


class WritesInFlight:
    def __init__(self):
        self._by_ino: dict[int, set[int]] = {}   # ino -> seqs of its writes in flight
        self._seq = 0
        self._changed = trio.Event()

    def add(self, ino: int) -> int:
        self._seq += 1
        self._by_ino.setdefault(ino, set()).add(self._seq)
        return self._seq

    def done(self, ino: int, seq: int) -> None:
        writes = self._by_ino[ino]
        writes.remove(seq)
        if not writes:
            del self._by_ino[ino]
        self._changed.set()
        self._changed = trio.Event()

    def pending(self, ino: int) -> bool:
        return ino in self._by_ino

    def count(self) -> int:
        return sum(len(w) for w in self._by_ino.values())

    async def _until(self, condition) -> None:
        while not condition():
            await self._changed.wait()

    async def settled(self, ino: int) -> None:
        """Until every write to `ino` has been answered by the daemon."""
        await self._until(lambda: ino not in self._by_ino)

    async def earlier_done(self) -> None:
        """Until every write sent before this call has been answered (later ones may run):
        for operations on names, which cannot tell which inode they will touch."""
        mark = self._seq
        await self._until(lambda: all(seq > mark for writes in self._by_ino.values()
                                      for seq in writes))
