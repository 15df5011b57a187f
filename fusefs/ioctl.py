"""The ioctl's kernel side: requests in from the fuse shim, replies out to the kernel.

pyfuse3 has no ioctl handler; native/fuse_shim.c adds one (see there) and calls
`bc_ioctl_to_python` for each request, inside pyfuse3's request loop. That callback copies the
request struct and starts a task; the task hands it to `Transfers` (hostd: validates it
against the ABI, resolves the caller's memory, asks the cache daemon to move the bytes) and
answers the kernel with the struct it returns, or with an errno from errors.py.
"""

import errno
import logging
from collections.abc import Callable
from typing import Protocol

import trio

from .errors import Refused, errno_for_transfer

log = logging.getLogger("fusefs.ioctl")

FUSE_IOCTL_DIR = 1 << 4  # the ioctl was made on a directory


class Transfers(Protocol):
    commands: frozenset[int]   # the ioctl numbers served; any other gets ENOTTY
    changing: frozenset[int]   # those that may change the file's size or bytes (a STORE)

    async def serve(self, cmd: int, fh: int, request: bytes, pid: int) -> bytes:
        """The reply struct for `request` (`cmd`, on open file `fh`, from process `pid`).
        Raises errors.Refused for a request wrong as asked, another OSError for a failure
        of the cache."""


class IoctlDispatch:
    def __init__(self, shim, transfers: Transfers,
                 forget_attributes: Callable[[int], None] | None = None):
        """`shim`: the fuse shim's cffi module (hostd loads it before pyfuse3).
        `forget_attributes(ino)`: drops what the kernel caches of an inode's attributes
        (Operations.forget_attributes)."""
        self.shim = shim
        self.transfers = transfers
        self.forget_attributes = forget_attributes
        self._nursery: trio.Nursery | None = None
        ffi = shim.ffi

        @ffi.def_extern()
        def bc_ioctl_to_python(req, ino, cmd, fh, flags, in_buf, in_bufsz, out_bufsz):
            # Runs inside pyfuse3's loop, on the trio thread: start a task, never block.
            try:
                ctx = shim.lib.fuse_req_ctx(req)
                request = bytes(ffi.buffer(in_buf, in_bufsz)) if in_bufsz else b""
                self._nursery.start_soon(self._serve, req, ino, cmd, fh, flags, request,
                                         ctx.pid, out_bufsz)
            except BaseException:  # noqa: BLE001 - nothing may escape into C
                log.exception("ioctl dispatch failed")
                shim.lib.fuse_reply_err(req, errno.EIO)

    def state(self) -> str:
        state = self.shim.lib.bc_shim_state()
        if state == 1:
            return "ioctl available"
        version = self.shim.lib.fuse_version()
        if state == -1:
            return (f"ioctl unavailable: libfuse {version}'s operations table is newer than "
                    "the shim's")
        return (f"ioctl unavailable: libfuse {version} did not call the shim's "
                "fuse_session_new@FUSE_3.0 (libfuse >= 3.17 needs another approach)")

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def _serve(self, req, ino: int, cmd: int, fh: int, flags: int, request: bytes,
                     pid: int, out_size: int) -> None:
        lib = self.shim.lib
        if cmd not in self.transfers.commands or flags & FUSE_IOCTL_DIR:
            # Not ours (e.g. the TCGETS every buffered open() sends), or on a directory.
            lib.fuse_reply_err(req, errno.ENOTTY)
            return
        err, reply = None, b""
        try:
            reply = await self.transfers.serve(cmd, fh, request, pid)
        except Refused as e:
            log.info("ioctl %#x from pid %d refused: %s", cmd, pid, e.strerror)
            lib.fuse_reply_err(req, e.errno)
            return   # refused as asked: the file is untouched
        except OSError as e:
            log.info("ioctl %#x from pid %d failed in bluecached: %s", cmd, pid, e.strerror)
            err = errno_for_transfer(e)
        except Exception:
            log.exception("ioctl %#x from pid %d", cmd, pid)
            err = errno.EIO
        if cmd in self.transfers.changing and self.forget_attributes is not None:
            # Before the reply: the cache changed the file behind the kernel, which would
            # go on trusting the size it cached (a new file's 0, for the attribute timeout)
            # for lseek(SEEK_END) and a read's EOF. llm-d's reader sizes its read that way
            # and counts 0 bytes read as a loaded block (found by a probe).
            self.forget_attributes(ino)
        if err is not None:
            lib.fuse_reply_err(req, err)
        else:
            lib.fuse_reply_ioctl(req, 0, reply, min(len(reply), out_size))
