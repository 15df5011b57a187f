"""FUSE passthrough: reads of a cached file served by the kernel from the file's memfd.

The cache hands a read-only open its object's memfd (`Cache.backing`); the kernel is given it
as a backing file (a backing id, through the fuse shim) and the open's reply says
FOPEN_PASSTHROUGH: the kernel then reads the memfd itself and no READ reaches hostd. Anything
short of that (no passthrough negotiated, no backing, a refused ioctl) leaves the open exactly
as it would be without this module.

The kernel's rules (fs/fuse/iomode.c) shape the bookkeeping:
- an inode has at most one backing file: every passthrough open of it must name the same one,
  so the first open's backing id serves the inode until its last handle goes;
- while an inode has a backing file, an open of it without FOPEN_PASSTHROUGH fails with EIO.
  A write open then (or a read whose cache answered with another memfd) still names the
  inode's backing id, with FOPEN_DIRECT_IO kept: its reads and writes reach the cache as
  today, only mmap uses the backing file.
- the kernel applies an OPEN reply when the opener runs again, after hostd has answered: an
  open answered without a backing (the cache had no memfd for it yet) may be applied after a
  later open that attached one, and then fails with EIO. So while an inode has such plain
  handles, its opens stay plain too; both kinds never mix on one inode (seen: readers of a
  file a device STORE had just written).

A new (or truncated) file's writer gets its memfd read-write, when the cache gives it one: the
kernel writes it directly and the cache takes in the size and bytes where it looks (the
writer's FLUSH, any getattr, the RELEASE). A store then sends CREATE, FLUSH, RELEASE and no
WRITE.
"""

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import trio

log = logging.getLogger("fusefs.passthrough")
WARN_EVERY_S = 60.0
# How long an inode's backing id outlives its last handle, for the next open of the same
# memfd to reuse (no BACKING_OPEN and BACKING_CLOSE pair per open of a block read again soon).
# The kernel itself lets go of the inode's backing file before it sends that handle's RELEASE
# (fs/fuse/file.c, fuse_file_put), so a new id after it is taken.
BACKING_GRACE_S = 1.0


@dataclass
class _Backing:
    """One inode's backing file in the kernel."""
    backing_id: int
    file: tuple[int, int]   # (st_dev, st_ino): which memfd
    handles: set[int] = field(default_factory=set)


class Passthrough:
    def __init__(self, shim, grace: float = BACKING_GRACE_S):
        """`shim`: the fuse shim's cffi module, loaded before pyfuse3 (hostd does). `grace`:
        how long an inode's backing id is kept after its last handle (BACKING_GRACE_S)."""
        self.lib = shim.lib
        self.grace = grace
        self.inodes: dict[int, _Backing] = {}
        self._idle: dict[int, tuple[_Backing, float]] = {}   # ino: (backing, since when)
        self.handles: dict[int, tuple[int, int | None]] = {}   # fh: (inode, fd the cache gave)
        # inode: how many of its handles were answered without a backing (in `handles` too;
        # never beside a backing: see the top)
        self.plain: Counter[int] = Counter()
        self.served = 0      # opens answered with a passthrough read
        self.declined = 0    # read-only opens served by the cache instead
        self.writers = 0     # write opens whose writes the kernel puts in the memfd
        self._warned: dict[str, float] = {}

    def negotiated(self) -> bool:
        return self.lib.bc_passthrough_state() == 1

    async def opened(self, cache, ino: int, fh: int, flags: int) -> None:
        """A regular file's open succeeded with handle `fh`; before its reply: registers a
        backing for it where one can be had. Never fails the open. A writer of an inode
        without a backing asks too: the cache gives a new file's memfd for the kernel to
        write directly (no request per write), else nothing, without a round trip."""
        reading = flags & os.O_ACCMODE == os.O_RDONLY and not flags & os.O_TRUNC
        writing = flags & os.O_ACCMODE != os.O_RDONLY
        if not self.negotiated():
            return
        if not (reading or writing or ino in self.inodes):
            self._open_plain(ino, fh)
            return
        given = None
        if reading or (writing and ino not in self.inodes):
            given = await self._backing_of(cache, fh)
        fd, file = None, None
        if given is not None:
            fd = given[0]
            try:
                file = _identity(fd)
            except OSError as e:
                self._warn("fd", "the cache's backing fd: %s", e)
                os.close(fd)
                fd = None
        by_cache = self._register(ino, fh, fd, file, writing=writing)
        if writing and by_cache:
            # The kernel reads this inode's memfd itself, for its other handles, and would
            # not wait for a write answered before it reached the cache.
            stored = getattr(cache, "answer_writes_stored", None)
            if stored is not None:
                stored(fh)

    def released(self, fh: int) -> None:
        """The kernel released `fh`: its fd goes, and the inode's backing id with its last
        handle."""
        self.lib.bc_passthrough_clear(fh)
        entry = self.handles.pop(fh, None)
        if entry is None:
            return
        ino, fd = entry
        if fd is not None:
            os.close(fd)
        if ino in self.plain:
            self.plain[ino] -= 1
            if not self.plain[ino]:
                del self.plain[ino]
            return
        backing = self.inodes.get(ino)
        if backing is None:
            return
        backing.handles.discard(fh)
        log.debug("release %d of inode %d: backing id %d, %d open", fh, ino,
                  backing.backing_id, len(backing.handles))
        if not backing.handles:
            del self.inodes[ino]
            if self.grace > 0:
                self._idle[ino] = (backing, time.monotonic())
            else:
                self._close(backing)
        self.sweep()

    def sweep(self) -> None:
        """Closes the backing ids kept past their inode's last handle for `grace`."""
        now = time.monotonic()
        for ino, (backing, since) in list(self._idle.items()):
            if now - since >= self.grace:
                del self._idle[ino]
                self._close(backing)

    async def sweep_every(self, interval: float) -> None:
        while True:
            await trio.sleep(interval)
            self.sweep()

    def _close(self, backing: _Backing) -> None:
        log.debug("backing id %d closed", backing.backing_id)
        err = self.lib.bc_backing_close(backing.backing_id)
        if err < 0:
            self._warn("close", "closing backing id %d: %s", backing.backing_id,
                       os.strerror(-err))

    # -- helpers ---------------------------------------------------------------------------

    async def _backing_of(self, cache, fh: int) -> tuple[int, int] | None:
        ask = getattr(cache, "backing", None)
        if ask is None:
            return None
        try:
            return await ask(fh)
        except OSError as e:
            self._warn("cache", "no backing from the cache: %s", e)
            return None

    def _register(self, ino: int, fh: int, fd: int | None, file: tuple[int, int] | None,
                  writing: bool) -> bool:
        """Registers the handle; True if it is served by the cache under the inode's backing
        id (BC_PT_DAEMON_IO), False if by the kernel or plain."""
        backing = self.inodes.get(ino)
        if backing is None and file is not None and ino in self.plain:
            os.close(fd)   # plain handles the kernel may not have applied yet (see the top)
            fd, file = None, None
        if backing is None and ino in self._idle and file is not None:
            idle, _ = self._idle.pop(ino)
            if idle.file == file:   # the same memfd: its id, which the kernel may still hold
                backing = self.inodes[ino] = idle
            else:
                self._close(idle)
        if backing is None:
            if file is None:
                log.debug("open %d of inode %d: no backing", fh, ino)
                if not writing:
                    self.declined += 1
                self._open_plain(ino, fh)
                return False
            backing_id = self.lib.bc_backing_open(fd)
            if backing_id < 0:
                self._warn("open", "no backing id: %s", os.strerror(-backing_id))
                os.close(fd)
                self.declined += 1
                self._open_plain(ino, fh)
                return False
            backing = self.inodes[ino] = _Backing(backing_id, file)
        # Another memfd than the inode's (the object moved since) or a write open: the cache
        # serves it, under the inode's backing id (see the top).
        by_kernel = file is not None and file == backing.file
        if not by_kernel:
            mode = self.lib.BC_PT_DAEMON_IO
        else:
            mode = self.lib.BC_PT_KERNEL_WRITES if writing else self.lib.BC_PT_KERNEL_READS
        log.debug("open %d of inode %d: backing id %d (file %s, given %s), mode %d, %d open",
                  fh, ino, backing.backing_id, backing.file, file, mode, len(backing.handles) + 1)
        if self.lib.bc_passthrough_set(fh, backing.backing_id, mode) != 0:
            self._warn("table", "the shim's table of backed opens is full")
        backing.handles.add(fh)
        self.handles[fh] = (ino, fd)
        if by_kernel and writing:
            self.writers += 1
        elif by_kernel:
            self.served += 1
        elif not writing:
            self.declined += 1
        return not by_kernel

    def _open_plain(self, ino: int, fh: int) -> None:
        self.plain[ino] += 1
        self.handles[fh] = (ino, None)

    def _warn(self, reason: str, message: str, *args) -> None:
        """Logged at most once a minute per reason: a failure here costs speed, not answers."""
        now = time.monotonic()
        if now - self._warned.get(reason, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._warned[reason] = now
            log.warning("passthrough: " + message + " (served by the cache instead)", *args)


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino
