"""What hostd asks of the kernel's FUSE beyond what libfuse 3.14 knows: passthrough, the
request size and the kernel's request timeout (mount.passthrough, mount.max_pages,
mount.kernel_request_timeout), all negotiated by the fuse shim in the INIT reply
(native/fuse_shim.c)."""

import logging
from pathlib import Path

import trio

from fusefs.passthrough import Passthrough

log = logging.getLogger("hostd")
MAX_PAGES_LIMIT = Path("/proc/sys/fs/fuse/max_pages_limit")   # kernel 6.13+
LIBFUSE_PAGES = 256   # what libfuse 3.14 asks for: its 1 MiB request buffer


class FuseFeatures:
    def __init__(self, shim, mount):
        """Before pyfuse3.init: tells the shim what to negotiate (raising the kernel's limit
        on max_pages first, as root). `passthrough`: what fusefs serves opens with, or None."""
        self.shim = shim
        self.passthrough: Passthrough | None = None
        self.asked = False
        pages = mount.max_pages if mount.max_pages != LIBFUSE_PAGES else 0
        if pages > LIBFUSE_PAGES:
            _allow_pages(pages)
        self.request_timeout = self._ask_request_timeout(mount.kernel_request_timeout)
        if not mount.passthrough and not pages:
            return
        if shim.lib.bc_negotiate(int(mount.passthrough), pages) != 0:
            log.warning("the fuse shim cannot negotiate passthrough or max_pages (libfuse's "
                        "operations table is newer than the shim's): reads go through hostd")
            return
        self.asked = True
        if mount.passthrough:
            self.passthrough = Passthrough(shim)

    def _ask_request_timeout(self, seconds: int) -> int:
        """The kernel's request timeout the shim asks for in INIT (0: none)."""
        if seconds and self.shim.lib.bc_negotiate_request_timeout(seconds) != 0:
            log.warning("the fuse shim cannot negotiate the kernel's request timeout: a "
                        "stopped hostd makes callers wait until it runs again")
            return 0
        return seconds

    def _report_request_timeout(self) -> None:
        """Once INIT is answered: whether the kernel took mount.kernel_request_timeout."""
        if not self.request_timeout:
            return
        got = self.shim.lib.bc_request_timeout_state()
        if got < 0:
            log.warning("the kernel's INIT was not answered through the fuse shim: kernel "
                        "request timeout unknown")
        elif got > 0:
            log.info("kernel request timeout: %d s (a request hostd leaves unanswered that "
                     "long aborts the mount)", got)
        else:
            log.info("kernel request timeout: not offered by the kernel (FUSE 7.%d; needs "
                     "7.43, Linux 6.14): a stopped hostd makes callers wait",
                     self.shim.lib.bc_kernel_minor())

    async def report(self) -> str:
        """Once the kernel's INIT has been answered (pyfuse3.main answers it first): logs
        what was negotiated; returns it in a few words (for systemd's STATUS)."""
        lib = self.shim.lib
        if not self.asked and not self.request_timeout:
            return "passthrough off"
        with trio.move_on_after(5):
            # set in C, with nothing to wait on: a few polls, once per mount
            while lib.bc_max_pages() == 0:  # noqa: ASYNC110
                await trio.sleep(0.01)
        self._report_request_timeout()
        if not self.asked:
            return "passthrough off"
        if lib.bc_max_pages() == 0:
            log.warning("the kernel's INIT was not answered through the fuse shim: "
                        "passthrough and max_pages unknown")
            return "passthrough unknown"
        if self.passthrough is None:
            words = "passthrough off"
        elif lib.bc_passthrough_state() == 1:
            words = "passthrough on"
        else:
            words = "passthrough not offered by the kernel"
        mmap = ("shared mmap allowed" if lib.bc_shared_mmap_state() == 1 else
                "shared mmap not offered by the kernel (ENODEV unless passthrough)")
        log.info("FUSE 7.%d: %s, read requests up to %d KiB, %s", lib.bc_kernel_minor(), words,
                 lib.bc_max_pages() * 4, mmap)
        return words

    def summary(self) -> str:
        """At stop: what passthrough served."""
        p = self.passthrough
        if p is None:
            return "passthrough off"
        return (f"opens served by passthrough: {p.served}, read-only opens served by hostd: "
                f"{p.declined}, write opens written by the kernel: {p.writers}")


def _allow_pages(pages: int) -> None:
    try:
        limit = int(MAX_PAGES_LIMIT.read_text())
        if limit < pages:
            MAX_PAGES_LIMIT.write_text(f"{pages}\n")
    except FileNotFoundError:
        pass   # before kernel 6.13 the limit is fixed at 256: the kernel caps the request there
    except (OSError, ValueError) as e:
        log.warning("cannot raise %s to %d (%s): the kernel caps requests at its limit",
                    MAX_PAGES_LIMIT, pages, e)
