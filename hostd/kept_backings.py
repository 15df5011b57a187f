"""Read-only opens answered by hostd alone: of files in DRAM (a kept memfd), and of files only
on NVMe read through bluecached (prepared at the lookup: see the end).

A hit's OPEN through both daemons cost 0.4-0.75 ms on the 2-core VM, against 0.02 ms on tmpfs,
and capped one vLLM reader at ~0.8x tmpfs (docs/benchmarks/hit-notes.md): it waits on two
processes waking up, not on their work. The memfd bluecached lends for a passthrough read is
never reused for another object's bytes, and changes only in place (Memfd.lent in
bluecached/tiers/dram.py): while the object keeps it, an fd of it names the file's bytes. So
hostd keeps that fd after the handles close, and answers the next read-only open of the inode
with it at once. bluecached hears of the open right after (`open` with `kept`): it counts it as
any open (LRU, atime, the remote tier's admission) and says whether the memfd is still the
object's.

An entry goes when
- bluecached says the memfd left the object (event "left-dram": evicted, removed, unlinked),
- this hostd opens the inode to write it or changes its attributes (`changing`),
- bluecached's answer to a kept open says it is no longer the object's,
- bluecached restarts (its memfds are not the new daemon's), or
- the bound (`limit` entries, least recently used first) or `idle` seconds unused.
A writer through another client of bluecached (not this hostd) is seen by the event or the next
answer: readers served in between see the bytes as they were, as a reader that opened just
before that write would.

Files only on NVMe read through bluecached have nothing to keep or lend. For those, bluecached
says so in the reply to the lookup that comes before the open (`lookup` with `prepare`:
"plain", or "buffered" for a buffered open only, as an O_DIRECT one would read a clone). hostd
holds that for the OPEN the kernel sends next, answers it alone and opens at bluecached right
after, as for a kept memfd; the handle's first read waits for that. A vLLM hit on ext4
(LOOKUP, OPEN, reads) then waits on bluecached once before its reads instead of twice. A
prepared open is used once, by a read-only open within PREPARED_HOLD_S of its lookup, and
goes as kept ones go (`changing`, restarts, the bound). It is only ever a promise that the
open lends nothing: if the file came into DRAM meanwhile, its reads still go through
bluecached, which serves them right.
"""

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

log = logging.getLogger("hostd.kept_backings")
WARN_EVERY_S = 60.0
# The OPEN follows its LOOKUP at once; lookups with no open after them (a scheduler's exists
# checks) leave entries that go after this long, at most PREPARED_LIMIT held.
PREPARED_HOLD_S = 1.0
PREPARED_LIMIT = 64


@dataclass
class Kept:
    fd: int            # read-only, of bluecached's memfd
    identity: list     # [st_dev, st_ino] of it
    size: int
    attr: object       # the file's Attr at the open that brought it
    generation: int    # the link's, when it came
    used: float


@dataclass
class Prepared:
    kind: str          # "plain" (any read-only open) or "buffered" (not O_DIRECT)
    attr: object       # the file's Attr from the lookup
    generation: int    # the link's, when it came
    since: float


class KeptBackings:
    def __init__(self, limit: int, idle: float, clock=time.monotonic):
        self.limit = limit
        self.idle = idle
        self.clock = clock
        self._kept: OrderedDict[int, Kept] = OrderedDict()
        self._prepared: OrderedDict[int, Prepared] = OrderedDict()
        self._changes = 0      # bumps at each `changing`: an open that spanned one keeps nothing
        self.answered = 0      # opens answered from a kept memfd
        self.refused = 0       # kept memfds bluecached said were no longer the file's
        self.answered_prepared = 0   # opens answered with what their lookup prepared
        self._warned = -WARN_EVERY_S

    def __len__(self) -> int:
        return len(self._kept)

    def stamp(self) -> int:
        """Taken before an open is sent: `keep` with it adds nothing if the inode changed
        meanwhile (a write open racing this read's reply)."""
        return self._changes

    def keep(self, ino: int, fd: int, size: int, attr, generation: int, stamp: int) -> None:
        """A read-only open brought `fd` of the file's memfd: a duplicate is kept (the
        caller keeps `fd` for its handle)."""
        if self.limit <= 0 or stamp != self._changes or ino in self._kept:
            return
        try:   # never at the open's cost: out of fds, the open is simply not kept
            st = os.fstat(fd)
            self._kept[ino] = Kept(os.dup(fd), [st.st_dev, st.st_ino], size, attr, generation,
                                   self.clock())
        except OSError as e:
            self._warn(e)
            return
        while len(self._kept) > self.limit:
            self._close(self._kept.popitem(last=False)[1])

    def take(self, ino: int, generation: int) -> tuple[int, Kept] | None:
        """(a new fd of the kept memfd, the entry) for a read-only open of `ino`, or None."""
        entry = self._kept.get(ino)
        if entry is None:
            return None
        now = self.clock()
        if entry.generation != generation or now - entry.used > self.idle:
            self.drop(ino)
            return None
        try:
            fd = os.dup(entry.fd)
        except OSError as e:   # out of fds: bluecached answers this open
            self._warn(e)
            return None
        entry.used = now
        self._kept.move_to_end(ino)
        self.answered += 1
        return fd, entry

    def prepare(self, ino: int, what: dict, attr, generation: int, stamp: int) -> None:
        """A lookup's reply prepared the next read-only open of `ino` (`what`): held for it,
        replacing any earlier one; nothing if the inode changed here since `stamp`."""
        self._prepared.pop(ino, None)
        kind = what.get("kind")
        if stamp != self._changes or self.limit <= 0 or kind not in ("plain", "buffered"):
            return
        now = self.clock()
        self._expire_prepared(now)
        self._prepared[ino] = Prepared(kind, attr, generation, now)
        while len(self._prepared) > PREPARED_LIMIT:
            self._prepared.popitem(last=False)

    def take_prepared(self, ino: int, flags: int, generation: int) -> Prepared | None:
        """What the lookup of `ino` prepared, for this read-only open to be answered with; None
        where nothing was, or not for this open."""
        entry = self._prepared.pop(ino, None)
        if (entry is None or entry.generation != generation
                or self.clock() - entry.since > PREPARED_HOLD_S
                or (entry.kind == "buffered" and flags & os.O_DIRECT)):
            return None
        self.answered_prepared += 1
        return entry

    def changing(self, ino: int) -> None:
        """This hostd is about to write `ino` or change its attributes."""
        self._changes += 1
        self.drop(ino)
        self._prepared.pop(ino, None)

    def _expire_prepared(self, now: float) -> None:
        while self._prepared:
            ino, entry = next(iter(self._prepared.items()))
            if now - entry.since <= PREPARED_HOLD_S:
                break
            del self._prepared[ino]

    def refused_by_daemon(self, ino: int, identity: list) -> None:
        """bluecached's answer to a kept open: that memfd is not the file's any more."""
        entry = self._kept.get(ino)
        if entry is not None and entry.identity == identity:
            self.refused += 1
            self.drop(ino)

    def drop(self, ino: int) -> None:
        entry = self._kept.pop(ino, None)
        if entry is not None:
            self._close(entry)

    def expire(self) -> None:
        """Lets entries unused for `idle` seconds go (their memory is bluecached's to free),
        and prepared opens held past PREPARED_HOLD_S."""
        now = self.clock()
        self._expire_prepared(now)
        while self._kept:
            ino, entry = next(iter(self._kept.items()))
            if now - entry.used <= self.idle:
                break
            self.drop(ino)

    def clear(self) -> None:
        while self._kept:
            self._close(self._kept.popitem()[1])
        self._prepared.clear()

    def _warn(self, e: OSError) -> None:
        now = self.clock()
        if now - self._warned >= WARN_EVERY_S:
            self._warned = now
            log.warning("kept opens: %s (opens go to bluecached; raise LimitNOFILE or lower "
                        "mount.kept_opens)", e.strerror or e)

    @staticmethod
    def _close(entry: Kept) -> None:
        os.close(entry.fd)
