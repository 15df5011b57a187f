"""Writes received in place: the kernel reads each FUSE write straight into a staging slot.

native/fuse_shim.c does the reading (see there for how); this module is its Python half. The
shim keeps a small pool of slots to read requests into, topped up with `bc_take_slot` and any
surplus handed back with `bc_give_slot` (both on the trio thread), and hands every write that
landed in a slot to `bc_write_to_python`, which passes it on (`write_in_slot`) and answers the
kernel. hostd then copies no payload byte of a POSIX write: measured per GiB stored, this is
the copy into a new bytes object (pyfuse3) and the copy from it into the slot (hostd) gone, and
pyfuse3's handler task with them (docs/benchmarks/mount.md).

The slots and what becomes of a write in one are hostd's (`SlotWriter`); the answer is
written here, by the errno map every other reply uses (errors.py).
"""

import errno
import functools
import logging
from collections.abc import Callable
from typing import Protocol

from .errors import errno_for

log = logging.getLogger("fusefs.inplace")


class StagingSlots(Protocol):
    """Fixed-size slots in one mapping of this process, for the kernel to read requests into."""
    slots: int    # how many
    stride: int   # bytes from one slot's start to the next
    head: int     # bytes before a slot's payload, for the request's header

    def address(self) -> int: ...          # of slot 0; mapped until after InPlaceWrites.stop()
    def take_nowait(self) -> int: ...      # a free slot, or -1; never waits
    def give(self, slot: int) -> None: ...


class SlotWriter(Protocol):
    staging: StagingSlots

    def write_in_slot(self, fh: int, offset: int, slot: int, length: int,
                      answer: Callable[[OSError | None], None]) -> None:
        """Takes the write that landed in `slot` (and the slot with it); never waits. Calls
        `answer` once, with None or the failure."""


class InPlaceWrites:
    def __init__(self, shim, writer: SlotWriter):
        """`shim`: the fuse shim's cffi module (hostd loads it before pyfuse3)."""
        self.ffi, self.lib = shim.ffi, shim.lib
        self.writer = writer
        self.active = False
        staging = writer.staging

        @self.ffi.def_extern(error=-1)
        def bc_take_slot():
            return staging.take_nowait()

        @self.ffi.def_extern()
        def bc_give_slot(slot):
            staging.give(slot)

        @self.ffi.def_extern()
        def bc_write_to_python(req, ino, fh, off, slot, size):
            # Runs inside pyfuse3's loop, on the trio thread: never block, nothing may escape.
            try:
                writer.write_in_slot(fh, off, slot, size,
                                     functools.partial(self._answer, req, size))
            except BaseException:   # noqa: BLE001 - a bug: the writer gets EIO, hostd goes on
                log.exception("write of %d bytes at %d to inode %d", size, off, ino)
                self.lib.fuse_reply_err(req, errno.EIO)

    def _answer(self, req, size: int, error: OSError | None) -> None:
        if error is None:
            self.lib.fuse_reply_write(req, size)
            return
        err = errno_for(error)
        if err == errno.EIO:
            log.warning("write: %s -> EIO", error)
        self.lib.fuse_reply_err(req, err)

    def start(self) -> str | None:
        """From now on requests are read into staging. Returns why not, if it cannot be."""
        staging = self.writer.staging
        if self.lib.bc_receive_into(self.ffi.cast("char *", staging.address()), staging.slots,
                                    staging.stride, staging.head) != 0:
            return ("the fuse shim cannot read requests into staging here (libfuse not "
                    "patched, or its receive buffer larger than a staging slot's stride)")
        self.active = True
        return None

    def stop(self) -> None:
        """Back to pyfuse3's buffers, once the session has ended; the slots the shim held
        return to the pool."""
        if self.active:
            self.active = False
            while (slot := self.lib.bc_receive_stop()) >= 0:
                self.writer.staging.give(slot)

    def counts(self) -> dict:
        return {"in_place": self.lib.bc_writes_in_place(),
                "copied": self.lib.bc_writes_copied()}
