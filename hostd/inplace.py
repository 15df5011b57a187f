"""Writes received in place: the kernel reads each FUSE write straight into a staging slot.

native/fuse_shim.c does the reading (see there for how); this module is its Python half. The
shim keeps a small pool of slots to read requests into, topped up with `bc_take_slot` and any
surplus handed back with `bc_give_slot` (both on the trio thread), and hands every write that
landed in a slot to `bc_write_to_python`, which passes it to the link (`write_in_slot`) and
answers the kernel. hostd then copies no payload byte of a POSIX write: measured per GiB
stored, this is the copy into a new bytes object (pyfuse3) and the copy from it into the slot
(hostd) gone, and pyfuse3's handler task with them (docs/benchmarks/mount.md).

Errors are mapped to the errno an application sees by fusefs' own rule (`errno_for`), the
same as for every other request.
"""

import ctypes
import errno
import functools
import logging

from fusefs.operations import errno_for

from .link import SLOT_HEAD, SLOT_STRIDE

log = logging.getLogger("hostd.inplace")


class InPlaceWrites:
    def __init__(self, shim, link):
        self.ffi, self.lib = shim.ffi, shim.lib
        self.link = link
        self.active = False

        @self.ffi.def_extern(error=-1)
        def bc_take_slot():
            return link.staging.take_nowait()

        @self.ffi.def_extern()
        def bc_give_slot(slot):
            link.staging.give(slot)

        @self.ffi.def_extern()
        def bc_write_to_python(req, ino, fh, off, slot, size):
            # Runs inside pyfuse3's loop, on the trio thread: never block, nothing may escape.
            try:
                link.write_in_slot(fh, off, slot, size, functools.partial(self._answer, req, size))
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
        staging = self.link.staging
        # The map stays put until link.close(), after stop().
        base = ctypes.addressof(ctypes.c_char.from_buffer(staging.region.map))
        if self.lib.bc_receive_into(self.ffi.cast("char *", base), staging.slots, SLOT_STRIDE,
                                    SLOT_HEAD) != 0:
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
                self.link.staging.give(slot)

    def counts(self) -> dict:
        return {"in_place": self.lib.bc_writes_in_place(),
                "copied": self.lib.bc_writes_copied()}
